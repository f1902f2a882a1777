// The whole public surface of shardopt.
#pragma once

#include <shardopt/comm.h>
#include <shardopt/oss.h>
#include <shardopt/data_sampler.h>
#include <shardopt/partition.h>
#include <shardopt/sampler.h>
#include <shardopt/sharded_ddp.h>

// The whole public surface of shardopt.
#pragma once

#include <shardopt/comm.h>
#include <shardopt/oss.h>
#include <shardopt/partition.h>

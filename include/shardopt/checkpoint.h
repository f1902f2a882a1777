// Checkpoints (the path user code includes): see shardopt/checkpoint/checkpoint.h and
// shardopt/checkpoint/async_save.h.
#pragma once

#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/checkpoint/async_save.h>

// Checkpoints (the path user code includes): see shardopt/checkpoint/checkpoint.h.
#pragma once

#include <shardopt/checkpoint/checkpoint.h>

// BalancedSampler (the path user code includes): see shardopt/data/sampler.h.
#pragma once

#include <shardopt/data/sampler.h>

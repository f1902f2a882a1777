// OSS, the sharded optimizer (the path user code includes): see shardopt/optim/oss.h.
#pragma once

#include <shardopt/optim/oss.h>

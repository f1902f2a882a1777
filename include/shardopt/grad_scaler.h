// The sharded gradient scaler (the path user code includes): see shardopt/optim/grad_scaler.h.
#pragma once

#include <shardopt/optim/grad_scaler.h>

// ShardedDDP, gradient sharding (the path user code includes): see shardopt/ddp/sharded_ddp.h.
#pragma once

#include <shardopt/ddp/sharded_ddp.h>

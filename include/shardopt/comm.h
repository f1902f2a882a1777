// Process groups (the path user code includes): see shardopt/comm/process_group.h.
#pragma once

#include <shardopt/comm/process_group.h>

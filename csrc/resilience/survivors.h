// Agreeing on who is gone, through the store (Note [Who is gone] in survivors.cpp). Internal.
#pragma once

#include <shardopt/comm/process_group.h>

#include <vector>

namespace shardopt::detail {

struct Survivors {
  std::vector<int> alive;  // ranks of the broken group, ascending, this rank among them
  std::vector<int> lost;
};

// Called by every surviving rank of a broken group (it must have a store).
Survivors agree_on_survivors(ProcessGroup& group);

}  // namespace shardopt::detail

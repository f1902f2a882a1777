// The versions a rank announces when it joins a group (ranks of other versions are refused).
#pragma once

#include <string>

namespace shardopt {

// shardopt's version, "MAJOR.MINOR.PATCH".
std::string version();
// The LibTorch version shardopt was built against, "MAJOR.MINOR.PATCH".
std::string torch_version();

}  // namespace shardopt

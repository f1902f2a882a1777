#include <shardopt/version.h>

#include <torch/version.h>

#include <string>

namespace shardopt {

std::string version() { return SHARDOPT_VERSION_STRING; }

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

}  // namespace shardopt

// What the launcher's variables say about the nodes (shardopt/comm/launch_env.h): the ranks span
// nodes only where a local world size below the world size says so, in any launcher's
// convention. The tool's and ddp_bench's --step-in-backward auto follow it.
#include <shardopt/comm/launch_env.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

// Sets the given variables and unsets every other launcher variable for its life; restores all.
class LaunchVariables {
 public:
  explicit LaunchVariables(const std::map<std::string, std::string>& set) {
    for (const auto& v : kLaunchVariables) {
      const char* now = std::getenv(v.name);
      saved_[v.name] = now ? std::optional<std::string>(now) : std::nullopt;
      ::unsetenv(v.name);
    }
    for (const auto& [name, value] : set) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~LaunchVariables() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(LaunchEnv, RanksSpanNodesOnlyWhereALocalWorldSizeBelowTheWorldSaysSo) {
  {
    LaunchVariables env({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
    EXPECT_TRUE(ranks_span_nodes());
  }
  {
    LaunchVariables env({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
    EXPECT_FALSE(ranks_span_nodes());
  }
  {
    LaunchVariables env({{"RANK", "1"}, {"WORLD_SIZE", "4"}});  // no local world size: not known to span
    EXPECT_FALSE(ranks_span_nodes());
  }
  {
    LaunchVariables env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
    EXPECT_TRUE(ranks_span_nodes());
  }
  {
    LaunchVariables env({});  // no launcher: one process
    EXPECT_FALSE(ranks_span_nodes());
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

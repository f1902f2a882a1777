// The rendezvous store a launcher serves (shardopt/comm/store_server.h, docs/api.md): port 0 binds
// a free loopback port and says which, clients reach it until the store is destroyed, nothing
// listens beyond loopback, and bad addresses are errors that name them.
#include <shardopt/comm/store_server.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

c10::intrusive_ptr<c10d::TCPStore> client(int port, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
}

// The local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on
// `port`.
std::vector<std::string> listening_addresses(int port) {
  std::vector<std::string> out;
  char want[8];
  std::snprintf(want, sizeof(want), "%04X", port);
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // "  sl  local_address rem_address   st ..." : local "ADDR:PORT", state 0A = LISTEN
      std::istringstream fields(line);
      std::string sl, local, remote, state;
      fields >> sl >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == want) {
        out.push_back(local.substr(0, colon));
      }
    }
  }
  return out;
}

TEST(StoreServer, PortZeroBindsAFreeLoopbackPortThatClientsReachUntilTheStoreGoes) {
  int port = 0;
  auto store = serve_store("127.0.0.1", port, std::chrono::seconds(10));
  ASSERT_GT(port, 0);
  ASSERT_LT(port, 65536);
  // Listening on loopback only (IPv4 127.0.0.1 is 0100007F in /proc/net/tcp).
  EXPECT_EQ(listening_addresses(port), std::vector<std::string>{"0100007F"});
  {
    auto a = client(port, std::chrono::seconds(10));
    auto b = client(port, std::chrono::seconds(10));
    a->set("key", std::vector<uint8_t>{7, 8});
    EXPECT_EQ(b->get("key"), (std::vector<uint8_t>{7, 8}));
  }
  store.reset();
  EXPECT_TRUE(listening_addresses(port).empty()) << "port " << port << " still listens after the store went";
}

TEST(StoreServer, BadAddressesAreErrorsThatNameThem) {
  int port = 0;
  try {
    serve_store("10.1.2.3", port);
    ADD_FAILURE() << "port 0 on a host that is not loopback was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("10.1.2.3"), std::string::npos) << e.what_without_backtrace();
  }
  port = 70000;
  try {
    serve_store("127.0.0.1", port);
    ADD_FAILURE() << "port 70000 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("70000"), std::string::npos) << e.what_without_backtrace();
  }
  // A port another store holds: the error names the address.
  int taken = 0;
  auto first = serve_store("127.0.0.1", taken, std::chrono::seconds(10));
  int again = taken;
  try {
    serve_store("127.0.0.1", again, std::chrono::seconds(2));
    ADD_FAILURE() << "a second store on port " << taken << " was served";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("127.0.0.1:" + std::to_string(taken)), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(StoreServer, TheLauncherVariableSaysALauncherServesTheStore) {
  const char* before = std::getenv(kLauncherStoreVariable);
  const std::string saved = before ? before : "";
  setenv(kLauncherStoreVariable, "True", 1);
  EXPECT_TRUE(store_served_by_launcher());
  setenv(kLauncherStoreVariable, "False", 1);
  EXPECT_FALSE(store_served_by_launcher());
  unsetenv(kLauncherStoreVariable);
  EXPECT_FALSE(store_served_by_launcher());
  if (before) setenv(kLauncherStoreVariable, saved.c_str(), 1);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

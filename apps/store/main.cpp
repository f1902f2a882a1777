// shardopt-store: the rendezvous store of tools/launch (installed as shardopt-launch), served by a
// process apart from every rank, as `shardopt train -n N` serves its own: any rank, rank 0
// included, can die without taking the store along. The launcher starts it; a C++ process starts
// in a fraction of the time a Python interpreter takes to import PyTorch's TCPStore.
//
//   shardopt-store PORT     serves 127.0.0.1:PORT (0: any free port), loopback only
//
// It prints "ready PORT" once it listens, or "error MESSAGE" and exits 1. Then it answers one line
// per line on its standard input: "check KEY" gets "1" where the store holds KEY, else "0". It
// exits when its standard input closes: when the launcher has exited, however it ended.
#include <shardopt/comm/store_server.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdio>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  int port = -1;
  if (argc == 2) {
    try {
      size_t used = 0;
      port = std::stoi(argv[1], &used);
      if (used != std::string(argv[1]).size()) port = -1;
    } catch (const std::exception&) {
    }
  }
  if (port < 0) {
    std::printf("error usage: shardopt-store PORT (a port number, 0 for any free port), got '%s'\n",
                argc > 1 ? argv[1] : "");
    return 1;
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = shardopt::serve_store("127.0.0.1", port);
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    std::printf("error %s\n", message.substr(0, message.find('\n')).c_str());
    return 1;
  }
  std::printf("ready %d\n", port);
  std::fflush(stdout);
  const std::string check = "check ";
  for (std::string line; std::getline(std::cin, line);) {
    bool held = false;
    if (line.rfind(check, 0) == 0) {
      try {
        held = store->check({line.substr(check.size())});
      } catch (const std::exception&) {
        // a store that cannot answer holds nothing the launcher waits for
      }
    }
    std::printf("%d\n", held ? 1 : 0);
    std::fflush(stdout);
  }
  return 0;
}

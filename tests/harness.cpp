#include "harness.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace shardopt::testing {

std::vector<std::string> run_ranks_collect_errors(
    int world_size, const std::function<void(std::shared_ptr<ProcessGroup>)>& fn,
    std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        auto group = init_process_group(store, InitOptions().backend("gloo").rank(r).world_size(world_size).timeout(timeout));
        fn(group);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "unknown error";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void run_ranks(int world_size, const std::function<void(std::shared_ptr<ProcessGroup>)>& fn,
               std::chrono::milliseconds timeout) {
  auto errors = run_ranks_collect_errors(world_size, fn, timeout);
  for (int r = 0; r < world_size; ++r) {
    TORCH_CHECK(errors[r].empty(), "rank ", r, ": ", errors[r]);
  }
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "free_port: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace shardopt::testing

#include "harness.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <ftw.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
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
        // (The clock of a test's timeout starts once the group has formed: forming 8 or 64
        // ranks' groups on two loaded cores may take longer than a failure test allows.)
        auto group = init_process_group(store, InitOptions().backend("gloo").rank(r).world_size(world_size).timeout(timeout)
                                                   .setup_timeout(std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(60))));
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

ReservedPort::ReservedPort() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd_ >= 0, "ReservedPort: socket() failed");
  const int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  TORCH_CHECK(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
              "ReservedPort: cannot bind a port on 127.0.0.1");
  port_ = ntohs(addr.sin_port);
}

ReservedPort::~ReservedPort() { ::close(fd_); }

int64_t written_bytes() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  TORCH_CHECK(false, "/proc/self/io has no wchar");
}

// (POSIX calls, not std::filesystem: libtorch.so carries its own copy of those symbols.)
std::string temp_dir(const std::string& name) {
  std::string pattern = "/tmp/shardopt-" + name + "-XXXXXX";
  const char* made = ::mkdtemp(pattern.data());
  TORCH_CHECK(made, "mkdtemp failed for ", pattern);
  return made;
}

void remove_tree(const std::string& dir) {
  ::nftw(dir.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

}  // namespace shardopt::testing

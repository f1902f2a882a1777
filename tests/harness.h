// Several ranks in one process, one thread each, over a shared c10d::HashStore and real Gloo
// process groups: fast multi-rank tests.
#pragma once

#include <shardopt/comm/process_group.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace shardopt::testing {

// Runs fn on world_size threads, each with its own group; rethrows the lowest failing rank's
// exception (as a c10::Error whose message starts with "rank R: ").
void run_ranks(int world_size, const std::function<void(std::shared_ptr<ProcessGroup>)>& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Collects every rank's error message, in rank order ("" for a rank that did not throw).
std::vector<std::string> run_ranks_collect_errors(
    int world_size, const std::function<void(std::shared_ptr<ProcessGroup>)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Bytes this process has written with write/writev, all its threads together (/proc/self/io's
// wchar; Gloo's TCP transport writes with writev).
int64_t written_bytes();

// A new folder /tmp/shardopt-<name>-XXXXXX, and its removal with everything in it.
std::string temp_dir(const std::string& name);
void remove_tree(const std::string& dir);

// A TCP port on 127.0.0.1 kept for a tcp:// rendezvous in a test: a socket bound to it (not
// listening, SO_REUSEADDR) stays open while this object lives, so no other process gets the port,
// and rank 0's store, which binds it with SO_REUSEADDR, still can.
class ReservedPort {
 public:
  ReservedPort();
  ~ReservedPort();
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }
  std::string tcp() const { return "tcp://127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace shardopt::testing

// The thread that keeps a group's heartbeat in the store (Note [Roll call] in liveness.cpp).
// Internal: the group's constructor and destructor need the complete type.
#pragma once

#include <shardopt/comm/process_group.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace shardopt {

struct ProcessGroup::Heartbeat {
  std::mutex mu;
  std::condition_variable stop_cv;
  bool stop = false;
  std::thread thread;
};

}  // namespace shardopt

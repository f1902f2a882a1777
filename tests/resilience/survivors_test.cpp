// Who the survivors of a broken group count as gone (Note [Who is gone] in
// csrc/resilience/survivors.cpp): a rank whose heartbeat stood still, for how long.
#include "comm/watch.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Watches ranks 1 and 2 from rank 0 with `silence`: rank 2 beats every 100 ms; rank 1's heartbeat
// thread goes unscheduled for 4 s (as on an overloaded machine), then beats again.
detail::RankWatch watch_a_stalled_rank(milliseconds silence) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  for (int r = 0; r < 3; ++r) store->add(detail::heartbeat_key(r), 1);
  std::atomic<bool> done{false};
  std::thread live([&] {
    while (!done) {
      store->add(detail::heartbeat_key(2), 1);
      std::this_thread::sleep_for(milliseconds(100));
    }
  });
  std::thread stalled([&] {
    const auto until = std::chrono::steady_clock::now() + seconds(4);  // the stall, simulated
    while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(milliseconds(50));
    while (!done) {
      store->add(detail::heartbeat_key(1), 1);
      std::this_thread::sleep_for(milliseconds(100));
    }
  });
  const detail::RankWatch w = detail::watch_ranks(*store, 3, 0, "shardopt/recovering/", /*flag_counts_as_known=*/true,
                                                  silence);
  done = true;
  live.join();
  stalled.join();
  return w;
}

// The survivors wait for a heartbeat as long as a collective would have waited for that rank
// (the group's timeout), from 3 to 10 s: a live rank whose heartbeat thread stalls for 4 s stays
// in the run. With the roll call's 3 s it was counted gone.
TEST(Survivors, ALiveRankWhoseHeartbeatStallsFourSecondsIsNotCountedGone) {
  EXPECT_EQ(detail::survivors_silence(seconds(1)), seconds(3));
  EXPECT_EQ(detail::survivors_silence(seconds(6)), seconds(6));
  EXPECT_EQ(detail::survivors_silence(seconds(300)), seconds(10));
  const detail::RankWatch kept = watch_a_stalled_rank(detail::survivors_silence(seconds(60)));
  EXPECT_TRUE(kept.beat[1]) << "the stalled rank beat again within the survivors' silence";
  EXPECT_TRUE(kept.beat[2]);
  const detail::RankWatch dropped = watch_a_stalled_rank(detail::kHeartbeatTimeout);
  EXPECT_FALSE(dropped.beat[1]) << "3 s of silence takes the stalled rank for gone";
  EXPECT_TRUE(dropped.beat[2]);
}

// A rank whose process is on this machine counts as gone at once, without waiting out the
// silence, when its process has exited: its pid is gone, a zombie, or now another process's
// (the start time differs). This process itself, recorded the same way, is not.
TEST(Survivors, ARankWhosePidIsGoneAZombieOrAnothersIsGoneAtOnce) {
  const std::string me = detail::this_process();
  ASSERT_FALSE(me.empty()) << "/proc cannot tell this process";
  const std::string machine = me.substr(0, me.find('|'));
  const std::string start = me.substr(me.rfind('|') + 1);
  auto spawn_exiting = [] {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(0);
    return pid;
  };
  const pid_t reaped = spawn_exiting();
  ASSERT_GT(reaped, 0);
  ASSERT_EQ(::waitpid(reaped, nullptr, 0), reaped);
  const pid_t zombie = spawn_exiting();
  ASSERT_GT(zombie, 0);
  siginfo_t info{};  // wait for its exit, leaving it unreaped
  ASSERT_EQ(::waitid(P_PID, zombie, &info, WEXITED | WNOWAIT), 0);

  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<std::string> processes = {
      me,                                                         // rank 0: the watcher
      machine + "|" + std::to_string(reaped) + "|" + start,       // rank 1: pid gone
      machine + "|" + std::to_string(zombie) + "|" + start,       // rank 2: a zombie
      machine + "|" + std::to_string(::getpid()) + "|" + start + "0",  // rank 3: pid reused
      me,                                                         // rank 4: alive, silent
  };
  for (int r = 0; r < 5; ++r) {
    store->add(detail::heartbeat_key(r), 1);
    store->set(detail::process_key(r), std::vector<uint8_t>(processes[r].begin(), processes[r].end()));
  }
  const detail::RankWatch w = detail::watch_ranks(*store, 5, 0, "x/", /*flag_counts_as_known=*/false, milliseconds(1500));
  ::waitpid(zombie, nullptr, 0);
  EXPECT_TRUE(w.exited[1]) << "a reaped pid";
  EXPECT_TRUE(w.exited[2]) << "a zombie";
  EXPECT_TRUE(w.exited[3]) << "a pid with another start time";
  EXPECT_FALSE(w.exited[4]) << "a live process is not taken for exited";
  EXPECT_FALSE(w.beat[4]);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

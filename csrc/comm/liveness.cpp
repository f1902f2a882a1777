// Liveness and agreement of a group's collectives: the heartbeat and roll call that name a dead
// rank, and the desync check.
#include <shardopt/comm/process_group.h>
#include <shardopt/comm/store_server.h>
#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/failure_watch.h"
#include "comm/heartbeat.h"
#include "comm/watch.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <sstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardopt {

// Note [Roll call]
// A collective fails quickly when a peer's process is gone (its connections close) and after
// the timeout when a peer is stuck; a survivor whose own collective involves only live peers may
// notice only later. Each rank's group keeps a heartbeat in the rendezvous store (a counter it
// bumps once a second from a thread of its own, whatever the rank is doing) and records which
// process it is (boot id, pid namespace, pid and start time). A rank whose collective failed
// watches every other rank until it knows each one: alive when its counter moves (within a
// second), gone at once when its process is on this machine and has exited (or is a zombie, or
// its pid now belongs to another process), and gone when its counter stood still for
// kHeartbeatTimeout (3 s: a stopped process, or one on another machine). The watch ends as soon
// as every rank is known, so a peer that was killed on this machine is named within about a
// second, and a hung one within 3 s. Under a plain env:// rendezvous the store is served by rank
// 0's process, so when it cannot be reached at all, rank 0 is the one gone; under a launcher that
// serves it (torchrun, `shardopt train -n N`: shardopt/comm/store_server.h) any rank can die and
// be named.

std::string detail::heartbeat_key(int rank) { return "shardopt/heartbeat/" + std::to_string(rank); }

namespace {
using detail::heartbeat_key;

// Every rank's heartbeat count: a check and one multi-get where the store has them and every
// counter exists (a constant number of requests however many ranks there are), else one request
// per rank.
std::vector<int64_t> heartbeat_counts(c10d::Store& store, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(heartbeat_key(r));
  std::vector<int64_t> counts(size);
  if (store.hasExtendedApi() && store.check(keys)) {
    const auto values = store.multiGet(keys);
    for (int r = 0; r < size; ++r) counts[r] = std::stoll(std::string(values[r].begin(), values[r].end()));
  } else {
    for (int r = 0; r < size; ++r) counts[r] = store.add(keys[r], 0);
  }
  return counts;
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The state (field 3) and start time (field 22) of /proc/<pid>/stat; false when there is no such
// process.
bool process_stat(const std::string& pid, char* state, std::string* start_time) {
  const std::string text = first_line("/proc/" + pid + "/stat");
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int index = 3; fields >> field; ++index) {
    if (index == 3) *state = field[0];
    if (index == 22) {
      *start_time = field;
      return true;
    }
  }
  return false;
}

std::vector<std::string> split_bar(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, '|')) parts.push_back(item);
  return parts;
}

// Whether the process `recorded` (this_process() of a rank) is known to have exited: it is on
// this machine and its pid is gone, a zombie, or another process's.
bool known_to_have_exited(const std::string& recorded, const std::string& machine) {
  const auto parts = split_bar(recorded);
  if (parts.size() != 3 || machine.empty() || parts[0] != machine) return false;
  char state = 0;
  std::string start;
  if (!process_stat(parts[1], &state, &start)) return true;
  return state == 'Z' || state == 'X' || start != parts[2];
}

// Every rank's recorded process ("" where a rank recorded none).
std::vector<std::string> recorded_processes(c10d::Store& store, int size) {
  std::vector<std::string> keys, out(size);
  for (int r = 0; r < size; ++r) keys.push_back(detail::process_key(r));
  if (store.hasExtendedApi() && store.check(keys)) {
    const auto values = store.multiGet(keys);
    for (int r = 0; r < size; ++r) out[r].assign(values[r].begin(), values[r].end());
    return out;
  }
  for (int r = 0; r < size; ++r) {
    if (store.check({keys[r]})) {
      const auto v = store.get(keys[r]);
      out[r].assign(v.begin(), v.end());
    }
  }
  return out;
}
}  // namespace


namespace detail {

std::string process_key(int rank) { return "shardopt/process/" + std::to_string(rank); }
std::string silent_key(int rank) { return "shardopt/silent/" + std::to_string(rank); }

std::string this_process() {
  const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  char ns[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  const std::string pid = std::to_string(::getpid());
  char state = 0;
  std::string start;
  if (boot.empty() || n <= 0 || !process_stat(pid, &state, &start)) return "";
  return boot + "/" + std::string(ns, static_cast<size_t>(n)) + "|" + pid + "|" + start;
}

std::chrono::milliseconds survivors_silence(std::chrono::milliseconds group_timeout) {
  return std::clamp<std::chrono::milliseconds>(group_timeout, kHeartbeatTimeout, kHungTimeout);
}

RankWatch watch_ranks(c10d::Store& store, int size, int self, const std::string& flag_prefix,
                      bool flag_counts_as_known, std::chrono::milliseconds silence) {
  RankWatch w{std::vector<bool>(size), std::vector<bool>(size), std::vector<bool>(size), std::vector<bool>(size)};
  const std::string me = this_process();
  const std::string machine = me.substr(0, me.find('|'));
  const std::vector<std::string> processes = recorded_processes(store, size);
  const std::vector<int64_t> before = heartbeat_counts(store, size);
  std::vector<bool> silent_flags(size);
  for (int r = 0; r < size; ++r) silent_flags[r] = r != self && store.check({silent_key(r)});
  const auto start = std::chrono::steady_clock::now();
  // Every rank of a broken group may watch at once: a slower poll where there are many.
  const auto poll = std::chrono::milliseconds(size <= 64 ? 100 : 500);
  auto flag = [&](int r) { return store.check({flag_prefix + std::to_string(r)}); };
  for (;;) {
    const std::vector<int64_t> now = heartbeat_counts(store, size);
    bool all_known = true;
    for (int r = 0; r < size; ++r) {
      if (r == self) continue;
      w.beat[r] = w.beat[r] || now[r] != before[r];
      if (!w.exited[r]) w.exited[r] = known_to_have_exited(processes[r], machine);
      if (flag_counts_as_known && !w.flagged[r] && !w.beat[r] && !w.exited[r]) w.flagged[r] = flag(r);
      // A rank found silent for kHungTimeout while others waited on it (Note [A silent rank
      // breaks the group]) and not recovering: gone, without waiting out the heartbeat timeout
      // again.
      if (!w.exited[r] && !w.beat[r] && !w.flagged[r] && silent_flags[r]) {
        w.exited[r] = true;
        w.hung[r] = true;
      }
      all_known = all_known && (w.beat[r] || w.exited[r] || w.flagged[r]);
    }
    if (all_known || std::chrono::steady_clock::now() - start >= silence) break;
    std::this_thread::sleep_for(poll);
  }
  for (int r = 0; r < size; ++r) {
    if (r != self && !w.flagged[r] && !w.beat[r]) w.flagged[r] = flag(r);
  }
  return w;
}

}  // namespace detail

void ProcessGroup::set_store(c10::intrusive_ptr<c10d::Store> store) {
  store_ = std::move(store);
  if (!store_ || size_ == 1 || heartbeat_) return;
  // Which process this rank is, for a roll call on the same machine (Note [Roll call]).
  const std::string me = detail::this_process();
  store_->set(detail::process_key(rank_), std::vector<uint8_t>(me.begin(), me.end()));
  heartbeat_ = std::make_unique<Heartbeat>();
  heartbeat_->thread = std::thread([store = store_, key = heartbeat_key(rank_), hb = heartbeat_.get(),
                                    failure = failure_, size = size_, rank = rank_] {
    // Note [A silent rank breaks the group]
    // Under the failure watch, a rank that is stopped or hung (SIGSTOP, a deadlock) fails no
    // collective: its peers would wait for it until the timeout. While this rank waits on the
    // group, its heartbeat thread also reads every rank's counter once a second; a rank whose
    // counter stood still for kHungTimeout (10 s) is marked silent in the store and the group
    // is marked broken, so every rank leaves its wait and recovery starts; the survivors' watch
    // then counts the silent rank as gone without waiting for it again (Note [Roll call]).
    std::vector<int64_t> seen;
    std::vector<std::chrono::steady_clock::time_point> moved_at;
    std::unique_lock<std::mutex> lock(hb->mu);
    while (!hb->stop) {
      try {
        store->add(key, 1);
        // Note [Failure watch]: another rank saw this group fail.
        // (A sub-group shares its parent's watch, whose key is in the parent's store.)
        if (failure->watching && !failure->broken && (failure->store ? failure->store : store)->check({detail::kBrokenKey})) {
          failure->told();
        }
        if (failure->watching && !failure->broken && failure->waits > 0) {
          const auto now = std::chrono::steady_clock::now();
          const std::vector<int64_t> counts = heartbeat_counts(*store, size);
          if (seen.size() != counts.size()) {
            seen = counts;
            moved_at.assign(counts.size(), now);
          }
          std::vector<int> silent;
          for (int r = 0; r < size; ++r) {
            if (counts[r] != seen[r]) seen[r] = counts[r], moved_at[r] = now;
            if (r != rank && now - moved_at[r] >= detail::kHungTimeout) silent.push_back(r);
          }
          if (!silent.empty()) {
            std::string names;
            for (int r : silent) {
              store->set(detail::silent_key(r), std::vector<uint8_t>{1});
              names += (names.empty() ? "rank " : ", rank ") + std::to_string(r);
            }
            failure->mark("waiting on the group", names + " sent no heartbeat for " +
                                                      std::to_string(detail::kHungTimeout.count()) +
                                                      " s (stopped or hung)");
          }
        } else {
          seen.clear();
        }
      } catch (const std::exception&) {
        return;  // the store is gone: the job is ending
      }
      hb->stop_cv.wait_for(lock, std::chrono::seconds(1), [hb] { return hb->stop; });
    }
  });
}

ProcessGroup::~ProcessGroup() {
  if (heartbeat_) {
    {
      std::lock_guard<std::mutex> lock(heartbeat_->mu);
      heartbeat_->stop = true;
    }
    heartbeat_->stop_cv.notify_all();
    heartbeat_->thread.join();
  }
  // A broken group's backend may have threads blocked on a dead peer: kept, not destroyed.
  if (backend_ && failure_ && failure_->broken) detail::keep_for_good(std::move(backend_));
}

std::string ProcessGroup::roll_call() {
  if (!store_ || size_ == 1) return "";
  auto list = [this](const std::vector<int>& ranks) {
    std::string text;
    for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + describe_rank(ranks[i]);
    return text;
  };
  try {
    // A rank that saw a failure says so first: it may exit before the others look.
    const std::string failed = "shardopt/failed/";
    store_->set(failed + std::to_string(rank_), std::vector<uint8_t>{1});
    const detail::RankWatch w = detail::watch_ranks(*store_, size_, rank_, failed, /*flag_counts_as_known=*/false);
    std::vector<int> exited, hung, silent, failed_too;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || w.beat[r]) continue;
      (w.flagged[r] ? failed_too : w.hung[r] ? hung : w.exited[r] ? exited : silent).push_back(r);
    }
    std::string text;
    if (!exited.empty()) text = list(exited) + " stopped answering (its process on this machine exited)";
    if (!hung.empty()) {
      text += (text.empty() ? "" : "; ") + list(hung) + " stopped answering (no heartbeat for " +
              std::to_string(detail::kHungTimeout.count()) + " s while the others waited on it: stopped or hung)";
    }
    if (!silent.empty()) {
      text += (text.empty() ? "" : "; ") + list(silent) + " stopped answering (no heartbeat for " +
              std::to_string(detail::kHeartbeatTimeout.count()) + " s: exited, killed or hung)";
    }
    if (!failed_too.empty()) {
      text += (text.empty() ? "" : "; ") + list(failed_too) + " saw a failure too and stopped";
    }
    return text;
  } catch (const std::exception&) {
    if (store_served_by_launcher()) {
      return "the rendezvous store, which the launcher serves, cannot be reached: the launcher exited or was killed";
    }
    return "rank 0 (which serves the rendezvous store) cannot be reached: it exited or was killed";
  }
}

void ProcessGroup::check_in(CommStats::Kind kind, int64_t bytes, int root) {
  ++sequence_;
  if (!check_desync_ || size_ == 1) return;
  const auto seq = static_cast<int64_t>(sequence_);
  const int64_t fingerprint = (static_cast<int64_t>(kind) * 1000003 + bytes) * 131 + root;
  at::Tensor t = at::tensor({seq, -seq, fingerprint, -fingerprint}, at::kLong);
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  opts.timeout = timeout_;
  const std::string what = label(std::string("desync check before ") + CommStats::name(kind) + " #" + std::to_string(seq));
  // Watched like the collective it checks: a rank that dies here breaks the group as there
  // (Note [Failure watch]), so a job that goes on after a death recovers from it.
  PendingWork check(start(CommStats::kAllreduce, [&] { return backend_->allreduce(ts, opts); }), what, rank_, timeout_,
                    [this] { return roll_call(); });
  check.set_failure_watch(failure_);
  check.wait();
  const int64_t* v = t.data_ptr<int64_t>();
  if (v[0] == -v[1] && v[2] == -v[3]) return;
  // Out of step: every rank says what it called (one more small collective, matched on every rank).
  at::Tensor mine = at::tensor({seq, static_cast<int64_t>(kind), bytes, static_cast<int64_t>(root)}, at::kLong);
  std::vector<at::Tensor> all;
  for (int r = 0; r < size_; ++r) all.push_back(at::empty_like(mine));
  std::vector<std::vector<at::Tensor>> out{all};
  std::vector<at::Tensor> in{mine};
  c10d::AllgatherOptions gather_opts;
  gather_opts.timeout = timeout_;
  PendingWork report(start(CommStats::kAllgather, [&] { return backend_->allgather(out, in, gather_opts); }),
                     "desync report", rank_, timeout_);
  report.set_failure_watch(failure_);
  report.wait();
  std::string calls;
  for (int r = 0; r < size_; ++r) {
    const int64_t* c = out[0][r].data_ptr<int64_t>();
    calls += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + " called " +
             CommStats::name(static_cast<CommStats::Kind>(c[1])) + " #" + std::to_string(c[0]) + " of " +
             std::to_string(c[2]) + " bytes" + (c[3] >= 0 ? " with root " + std::to_string(c[3]) : "");
  }
  SHARDOPT_CHECK(false, "ranks are out of step at collective #", seq, " (", *CommPhase::current() ? CommPhase::current() : "no phase",
                 " on rank ", rank_, "): ", calls, ". Every rank must call the same collectives in the same order");
}

}  // namespace shardopt

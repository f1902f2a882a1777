// The failure watch a group can be put under (Note [Failure watch]; a job that goes on after a
// rank dies turns it on: detail::GroupRecovery, in csrc/comm/group_recovery.cpp).
#include <shardopt/comm/process_group.h>
#include <shardopt/check.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/failure_watch.h"
#include "comm/heartbeat.h"

#include <mutex>
#include <string>
#include <vector>

namespace shardopt {

// Note [Failure watch]
// A dead peer fails the collectives that talk to it directly (its connections close), but a rank
// waiting on a live peer that is itself stuck on the dead one waits until the timeout: Gloo's
// ring, and the point-to-point reductions, pass data along. A job that goes on after a death
// cannot wait minutes for every survivor to notice. Under a failure watch:
// - the first failure a rank sees (a collective that could not start or failed) marks its group
//   broken and sets one key in the group's store;
// - every rank's heartbeat thread, which already talks to the store once a second, checks that
//   key and marks its own group broken when it is there;
// - a broken group ends its waits: a Gloo collective's wait runs in slices of 100 ms and gives up
//   between them; any other work (a Gloo send or receive, whose wait cannot time out without
//   failing the whole context; an NCCL work) is aborted, which wakes its waiter; a collective
//   started on a broken group fails at once.
// A sub-group (ProcessGroup::split: hierarchical sharding's blocks and replica groups) shares its
// parent's watch, so a failure seen in a block breaks the whole group; and a broken group's
// backend is kept for the life of the process rather than destroyed with the group (destroying
// it waits for threads that may be blocked on the dead peer until the timeout).
// So every rank of the group leaves whatever phase it is in within about a second of the first
// failure, and whoever watches the group (the job's recovery) takes it from there. The
// roll call that names dead ranks in an error is skipped: the watcher makes its own, on every
// survivor alike.

namespace detail {

bool waits_in_slices(const c10d::Work& work) {
  return dynamic_cast<const c10d::ProcessGroupGloo::AsyncWork*>(&work) != nullptr;
}

void GroupFailure::mark(const std::string& phase, const std::string& cause) {
  bool announce = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (phase_.empty()) phase_ = phase.empty() ? "no phase" : phase;
    if (cause_.empty() && !told_) cause_ = cause;
    announce = !announced_ && !told_;
    announced_ = true;
  }
  broken = true;
  abort_waits();
  if (announce && store) {
    try {
      store->set(kBrokenKey, std::vector<uint8_t>{1});
    } catch (const std::exception&) {
      // The store is gone too: recovery will say so.
    }
  }
}

void GroupFailure::told() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    told_ = true;
  }
  broken = true;
  abort_waits();
}

std::string GroupFailure::phase() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_;
}

std::string GroupFailure::cause() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cause_;
}

void GroupFailure::waiting(const c10::intrusive_ptr<c10d::Work>& work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_.push_back(work);
  }
  if (broken) abort_waits();  // broken since the caller looked: abort_waits() may have run before the push
}

void GroupFailure::done(const c10::intrusive_ptr<c10d::Work>& work) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), work), waiting_.end());
}

void GroupFailure::wait_watched(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  waiting(work);
  bool completed = false;
  try {
    completed = work->wait(timeout);
  } catch (...) {
    done(work);
    throw;
  }
  done(work);
  TORCH_CHECK(completed, broken ? "aborted: a rank saw a failure" : "not completed");
}

void GroupFailure::abort_waits() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& work : waiting_) {
    try {
      work->abort();
    } catch (const std::exception&) {
      // A kind of work that cannot be aborted: its sliced wait ends instead.
    }
    aborted_.push_back(work);
  }
  waiting_.clear();
}

}  // namespace detail

namespace detail {
// Kept until the process exits (never destroyed, so exit does not wait either).
void keep_for_good(c10::intrusive_ptr<c10d::Backend> backend) {
  static std::mutex mu;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(backend));
}
}  // namespace detail

}  // namespace shardopt

// The failure watch a resilient run puts on its group, and what recovery does with a broken group:
// abandon it, and make a new one of the survivors.
#include <shardopt/comm/process_group.h>
#include <shardopt/check.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/failure_watch.h"
#include "comm/heartbeat.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace shardopt {

// Note [Failure watch]
// A dead peer fails the collectives that talk to it directly (its connections close), but a rank
// waiting on a live peer that is itself stuck on the dead one waits until the timeout: Gloo's
// ring, and the point-to-point reductions, pass data along. A resilient run cannot wait minutes
// for every survivor to notice. Under a failure watch:
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
// failure, and recovery (shardopt/resilience/resilient.h) takes it from there. The roll call
// that names dead ranks in an error is skipped: recovery makes its own, on every survivor alike.

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

void ProcessGroup::watch_failures() {
  failure_->store = store_;
  failure_->watching = true;
}

bool ProcessGroup::broken() const { return failure_->broken; }

std::string ProcessGroup::failure_phase() const { return failure_->phase(); }

std::string ProcessGroup::failure_cause() const { return failure_->cause(); }

void ProcessGroup::mark_broken(const std::string& why) { failure_->mark(why, ""); }

namespace detail {
// Kept until the process exits (never destroyed, so exit does not wait either).
void keep_for_good(c10::intrusive_ptr<c10d::Backend> backend) {
  static std::mutex mu;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(backend));
}
}  // namespace detail

void ProcessGroup::abandon() {
  failure_->broken = true;
  if (heartbeat_) {
    {
      std::lock_guard<std::mutex> lock(heartbeat_->mu);
      heartbeat_->stop = true;
    }
    heartbeat_->stop_cv.notify_all();
    heartbeat_->thread.join();
    heartbeat_.reset();
  }
  if (backend_) detail::keep_for_good(std::move(backend_));
}

std::shared_ptr<ProcessGroup> ProcessGroup::regroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::vector<int>& members) {
  SHARDOPT_CHECK(store && make_backend_, "ProcessGroup::regroup needs a group made by init_process_group");
  int mine = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    SHARDOPT_CHECK(members[i] >= 0 && members[i] < size_, "ProcessGroup::regroup: rank ", members[i],
                   " is outside [0, ", size_, ")");
    if (members[i] == rank_) mine = static_cast<int>(i);
  }
  SHARDOPT_CHECK(mine >= 0, "ProcessGroup::regroup: ", describe_rank(rank_), " is not among the members");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = make_backend_(store, mine, static_cast<int>(members.size()));
  } catch (const std::exception& e) {
    std::string list;
    for (size_t i = 0; i < members.size(); ++i) list += (i ? ", " : "") + std::to_string(global_ranks_[members[i]]);
    const std::string cause = e.what();
    SHARDOPT_CHECK(false, "global rank ", global_rank(), " could not connect to the other survivors (global ranks ",
                   list, ") within ", timeout_.count(), " ms: another rank failed during recovery? ",
                   cause.substr(0, cause.find('\n')));
  }
  return member_group(backend, members, store);
}

std::shared_ptr<ProcessGroup> ProcessGroup::form(const c10::intrusive_ptr<c10d::Store>& store,
                                                 const std::vector<int>& global_members) {
  SHARDOPT_CHECK(store && make_backend_, "ProcessGroup::form needs a group made by init_process_group");
  const auto it = std::find(global_members.begin(), global_members.end(), global_rank());
  SHARDOPT_CHECK(it != global_members.end(), "ProcessGroup::form: global rank ", global_rank(), " is not a member");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = make_backend_(store, static_cast<int>(it - global_members.begin()), static_cast<int>(global_members.size()));
  } catch (const std::exception& e) {
    const std::string cause = e.what();
    SHARDOPT_CHECK(false, "global rank ", global_rank(), " could not connect to the other members within ",
                   timeout_.count(), " ms: ", cause.substr(0, cause.find('\n')));
  }
  auto group = std::make_shared<ProcessGroup>(std::move(backend), timeout_);
  group->global_ranks_ = global_members;
  group->make_backend_ = make_backend_;
  group->check_desync_ = check_desync_;
  group->set_store(store);
  return group;
}

void ProcessGroup::set_joining(int global_rank, c10::intrusive_ptr<c10d::Store> store) {
  joining_ = true;
  global_ranks_ = {global_rank};
  store_ = std::move(store);
}

}  // namespace shardopt

// What surviving a dead rank does with a process group (GroupRecovery): the failure watch turned
// on, a broken group left behind, and new groups over the survivors or with a replacement.
#include "comm/group_recovery.h"

#include <shardopt/check.h>

#include "comm/failure_watch.h"
#include "comm/heartbeat.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace shardopt::detail {

void GroupRecovery::watch_failures(ProcessGroup& group) {
  group.failure_->store = group.store_;
  group.failure_->watching = true;
}

bool GroupRecovery::broken(const ProcessGroup& group) { return group.failure_->broken; }

std::string GroupRecovery::failure_phase(const ProcessGroup& group) { return group.failure_->phase(); }

std::string GroupRecovery::failure_cause(const ProcessGroup& group) { return group.failure_->cause(); }

void GroupRecovery::mark_broken(ProcessGroup& group, const std::string& why) { group.failure_->mark(why, ""); }

void GroupRecovery::abandon(ProcessGroup& group) {
  group.failure_->broken = true;
  if (auto& heartbeat = group.heartbeat_) {
    {
      std::lock_guard<std::mutex> lock(heartbeat->mu);
      heartbeat->stop = true;
    }
    heartbeat->stop_cv.notify_all();
    heartbeat->thread.join();
    heartbeat.reset();
  }
  if (group.backend_) keep_for_good(std::move(group.backend_));
}

std::shared_ptr<ProcessGroup> GroupRecovery::regroup(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int>& members) {
  SHARDOPT_CHECK(store && group.make_backend_, "ProcessGroup::regroup needs a group made by init_process_group");
  int mine = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    SHARDOPT_CHECK(members[i] >= 0 && members[i] < group.size_, "ProcessGroup::regroup: rank ", members[i],
                   " is outside [0, ", group.size_, ")");
    if (members[i] == group.rank_) mine = static_cast<int>(i);
  }
  SHARDOPT_CHECK(mine >= 0, "ProcessGroup::regroup: ", group.describe_rank(group.rank_), " is not among the members");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group.make_backend_(store, mine, static_cast<int>(members.size()));
  } catch (const std::exception& e) {
    std::string list;
    for (size_t i = 0; i < members.size(); ++i) list += (i ? ", " : "") + std::to_string(group.global_ranks_[members[i]]);
    const std::string cause = e.what();
    SHARDOPT_CHECK(false, "global rank ", group.global_rank(), " could not connect to the other survivors (global ranks ",
                   list, ") within ", group.timeout_.count(), " ms: another rank failed during recovery? ",
                   cause.substr(0, cause.find('\n')));
  }
  return group.member_group(backend, members, store);
}

std::shared_ptr<ProcessGroup> GroupRecovery::form(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                                  const std::vector<int>& global_members) {
  SHARDOPT_CHECK(store && group.make_backend_, "ProcessGroup::form needs a group made by init_process_group");
  const auto it = std::find(global_members.begin(), global_members.end(), group.global_rank());
  SHARDOPT_CHECK(it != global_members.end(), "ProcessGroup::form: global rank ", group.global_rank(), " is not a member");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group.make_backend_(store, static_cast<int>(it - global_members.begin()), static_cast<int>(global_members.size()));
  } catch (const std::exception& e) {
    const std::string cause = e.what();
    SHARDOPT_CHECK(false, "global rank ", group.global_rank(), " could not connect to the other members within ",
                   group.timeout_.count(), " ms: ", cause.substr(0, cause.find('\n')));
  }
  auto formed = std::make_shared<ProcessGroup>(std::move(backend), group.timeout_);
  formed->global_ranks_ = global_members;
  formed->make_backend_ = group.make_backend_;
  formed->check_desync_ = group.check_desync_;
  formed->set_store(store);
  return formed;
}

}  // namespace shardopt::detail

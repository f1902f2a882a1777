// Sub-groups: ProcessGroup::split and how a sub-group names its ranks.
#include <shardopt/comm/process_group.h>
#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <string>
#include <vector>

namespace shardopt {

std::string ProcessGroup::describe_sub() const {
  std::string t = "of global ranks [";
  for (size_t i = 0; i < global_ranks_.size(); ++i) t += (i ? ", " : "") + std::to_string(global_ranks_[i]);
  return t + "] (this is global rank " + std::to_string(global_ranks_[rank_]) + ")";
}

std::string ProcessGroup::describe_rank(int r) const {
  const bool sub = r >= 0 && r < size_ && global_ranks_[r] != r;
  return "rank " + std::to_string(r) + (sub ? " (global rank " + std::to_string(global_ranks_[r]) + ")" : "");
}

// Note [Sub-groups]
// Every rank of the parent agrees on the member list first (an all-gather of the lists, so that
// a rank with another list is named rather than left waiting), then the members build a backend
// of the parent's kind over the parent's store under a prefix of their own ("shardopt/split/N/"),
// so that sub-groups never share keys with the parent or each other.
std::shared_ptr<ProcessGroup> ProcessGroup::split(const std::vector<int>& ranks) {
  SHARDOPT_CHECK(store_ && make_backend_, "ProcessGroup::split needs a group made by init_process_group");
  std::vector<int64_t> mine{splits_};
  mine.insert(mine.end(), ranks.begin(), ranks.end());
  const auto all = allgather_ints(mine);
  auto text = [](const std::vector<int64_t>& v) {
    std::string t = "[";
    for (size_t i = 1; i < v.size(); ++i) t += (i > 1 ? ", " : "") + std::to_string(v[i]);
    return t + "]";
  };
  for (int r = 0; r < size_; ++r) {
    if (all[r] == all[0]) continue;
    std::string lists;
    for (int q = 0; q < size_; ++q) lists += (q ? "; " : "") + describe_rank(q) + ": " + text(all[q]);
    SHARDOPT_CHECK(false, "ProcessGroup::split: the ranks passed different member lists (or called split a different ",
                   "number of times): ", lists);
  }
  SHARDOPT_CHECK(!ranks.empty(), "ProcessGroup::split needs at least one rank");
  std::vector<bool> seen(size_, false);
  int mine_in_new = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    SHARDOPT_CHECK(r >= 0 && r < size_, "ProcessGroup::split: rank ", r, " is outside [0, ", size_, ")");
    SHARDOPT_CHECK(!seen[r], "ProcessGroup::split: rank ", r, " is listed twice");
    seen[r] = true;
    if (r == rank_) mine_in_new = static_cast<int>(i);
  }
  const int index = splits_++;
  if (mine_in_new < 0) return nullptr;
  auto store = c10::make_intrusive<c10d::PrefixStore>("shardopt/split/" + std::to_string(index) + "/", store_);
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = make_backend_(store, mine_in_new, static_cast<int>(ranks.size()));
  } catch (const std::exception& e) {
    SHARDOPT_CHECK(false, "ProcessGroup::split: ", describe_rank(rank_), " could not connect to the other members of ",
                   text(mine), " within ", timeout_.count(), " ms: ", e.what());
  }
  // A sub-group fails with its parent: one watch (Note [Failure watch]).
  return member_group(backend, ranks, store, failure_);
}

std::shared_ptr<ProcessGroup> ProcessGroup::member_group(c10::intrusive_ptr<c10d::Backend> backend,
                                                         const std::vector<int>& members,
                                                         const c10::intrusive_ptr<c10d::Store>& store,
                                                         std::shared_ptr<detail::GroupFailure> failure) const {
  auto group = std::make_shared<ProcessGroup>(std::move(backend), timeout_);
  if (failure) group->failure_ = std::move(failure);
  group->global_ranks_.clear();
  for (int r : members) group->global_ranks_.push_back(global_ranks_[r]);
  group->make_backend_ = make_backend_;
  group->check_desync_ = check_desync_;
  group->set_store(store);
  return group;
}

}  // namespace shardopt

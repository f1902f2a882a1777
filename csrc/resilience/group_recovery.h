// GroupRecovery: what surviving a dead rank needs of a ProcessGroup beyond its collectives. The
// failure watch (Note [Failure watch] in csrc/comm/failure_watch.cpp), leaving a broken group,
// and new groups over the ranks that are left or that join. Resilient (resilient.cpp,
// replacement.cpp) is its only user; the process group keeps these private, so the
// communication layer's public face is collectives and groups only.
#pragma once

#include <shardopt/comm/process_group.h>

#include <memory>
#include <string>
#include <vector>

namespace shardopt::detail {

struct GroupRecovery {
  // From here on, a failed collective marks `group` broken, and every rank's collectives on it
  // end within about a second of any rank's failure.
  static void watch_failures(ProcessGroup& group) { group.watch_failures(); }
  static bool broken(const ProcessGroup& group) { return group.broken(); }
  // Where this rank first saw the group fail, and the error of the first collective that failed
  // here ("" for either when it did not, or was told by another rank).
  static std::string failure_phase(const ProcessGroup& group) { return group.failure_phase(); }
  static std::string failure_cause(const ProcessGroup& group) { return group.failure_cause(); }
  // Marks `group` broken here and tells the other ranks.
  static void mark_broken(ProcessGroup& group, const std::string& why) { group.mark_broken(why); }
  // Stops `group` for good without waiting for what is in flight.
  static void abandon(ProcessGroup& group) { group.abandon(); }
  // The survivors' group: the listed ranks of `group` over `store` (not collective over `group`).
  static std::shared_ptr<ProcessGroup> regroup(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                               const std::vector<int>& members) {
    return group.regroup(store, members);
  }
  // The group of the listed global ranks, a replacement among them, over `store`.
  static std::shared_ptr<ProcessGroup> form(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<int>& global_members) {
    return group.form(store, global_members);
  }
};

}  // namespace shardopt::detail

// GroupRecovery: what surviving a dead rank needs of a ProcessGroup beyond its collectives. The
// failure watch (Note [Failure watch] in csrc/comm/failure_watch.cpp), leaving a broken group,
// and new groups over the ranks that are left or that join (group_recovery.cpp). Resilient
// (csrc/resilience/resilient.cpp, replacement.cpp) is its only user. It belongs to the
// communication layer and works on the process group's private state as its friend, so the
// group's public face stays collectives and groups only.
#pragma once

#include <shardopt/comm/process_group.h>

#include <memory>
#include <string>
#include <vector>

namespace shardopt::detail {

struct GroupRecovery {
  // From here on, a failed collective marks `group` broken, and every rank's collectives on it
  // end within about a second of any rank's failure (Note [Failure watch]).
  static void watch_failures(ProcessGroup& group);
  static bool broken(const ProcessGroup& group);
  // Where this rank first saw the group fail ("backward (gradient reductions)"), and the error of
  // the first collective that failed here ("" for either when it did not, or was told by another
  // rank).
  static std::string failure_phase(const ProcessGroup& group);
  static std::string failure_cause(const ProcessGroup& group);
  // Marks `group` broken here and tells the other ranks (as a failed collective would).
  static void mark_broken(ProcessGroup& group, const std::string& why);
  // Stops `group` for good without waiting for what is in flight: its heartbeat stops, and its
  // backend, whose threads may still be blocked on a dead peer until the timeout, is kept for the
  // life of the process rather than destroyed (destroying it would wait for them).
  static void abandon(ProcessGroup& group);
  // Not collective over `group`, which may be broken: the listed ranks of it (this rank among
  // them) make a new group of the same kind over `store`, in which rank i is members[i]; it keeps
  // the group's timeout, desync check and global ranks.
  static std::shared_ptr<ProcessGroup> regroup(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                               const std::vector<int>& members);
  // Not collective over `group`: the processes with the listed global ranks (ascending; this one
  // among them) make a new group of its kind over `store`, rank i being the i-th. Used when a
  // replacement joins a resilient run.
  static std::shared_ptr<ProcessGroup> form(ProcessGroup& group, const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<int>& global_members);
};

}  // namespace shardopt::detail

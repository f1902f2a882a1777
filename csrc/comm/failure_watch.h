// A group's failure watch (Note [Failure watch] in failure_watch.cpp). Internal: the group, its
// pending work and its heartbeat thread share it.
#pragma once

#include <shardopt/comm/process_group.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace shardopt::detail {

// The key a rank sets in its group's store when it sees the group fail.
inline constexpr const char* kBrokenKey = "shardopt/broken";

// Whether a wait on `work` may be cut into slices with timeouts: a Gloo collective's may (its wait
// only watches a flag); a Gloo send's or receive's may not (a timed-out wait fails the whole
// context), nor an unknown kind's.
bool waits_in_slices(const c10d::Work& work);

// Keeps a backend for the life of the process (never destroyed): a broken group's threads may be
// blocked on a dead peer until the timeout, and destroying the backend waits for them.
void keep_for_good(c10::intrusive_ptr<c10d::Backend> backend);

struct GroupFailure {
  std::atomic<bool> watching{false};
  std::atomic<bool> broken{false};
  // Waits on the group in progress: while there is one, the heartbeat thread watches the other
  // ranks' heartbeats (Note [A silent rank breaks the group] in liveness.cpp).
  std::atomic<int> waits{0};
  c10::intrusive_ptr<c10d::Store> store;

  // Marks the group broken; the first time on this rank, records `phase` and tells the other ranks
  // through the store. Aborts the sends and receives being waited for.
  void mark(const std::string& phase, const std::string& cause);
  // Told through the store that another rank saw a failure.
  void told();
  std::string phase() const;
  std::string cause() const;  // the first failure this rank saw itself ("" if it was told)

  // Waits at most `timeout` for a send or receive, registered meanwhile so that a failure seen
  // anywhere aborts it (a collective's wait is sliced instead: Gloo's point-to-point waits cannot
  // time out without failing the whole context); an error when it did not complete.
  void wait_watched(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout);

 private:
  void waiting(const c10::intrusive_ptr<c10d::Work>& work);
  void done(const c10::intrusive_ptr<c10d::Work>& work);
  void abort_waits();
  mutable std::mutex mu_;
  std::string phase_, cause_;
  bool announced_ = false, told_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> waiting_;
  std::vector<c10::intrusive_ptr<c10d::Work>> aborted_;  // kept: Gloo's transport may still refer to them
};

}  // namespace shardopt::detail

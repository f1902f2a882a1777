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

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shardopt {

// Note [Roll call]
// A collective fails quickly when a peer's process is gone (its connections close) and after
// the timeout when a peer is stuck; a survivor whose own collective involves only live peers may
// notice only later. Each rank's group keeps a heartbeat in the rendezvous store (a counter it
// bumps once a second from a thread of its own, whatever the rank is doing), and a rank whose
// collective failed watches every counter for 3 s: the ranks whose counter did not move are
// named. Under a plain env:// rendezvous the store is served by rank 0's process, so when it
// cannot be reached at all, rank 0 is the one gone; under a launcher that serves it (torchrun,
// `shardopt train -n N`: shardopt/comm/store_server.h) any rank can die and be named.

namespace {
std::string heartbeat_key(int rank) { return "shardopt/heartbeat/" + std::to_string(rank); }

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
}  // namespace

void ProcessGroup::set_store(c10::intrusive_ptr<c10d::Store> store) {
  store_ = std::move(store);
  if (!store_ || size_ == 1 || heartbeat_) return;
  heartbeat_ = std::make_unique<Heartbeat>();
  heartbeat_->thread = std::thread([store = store_, key = heartbeat_key(rank_), hb = heartbeat_.get(),
                                    failure = failure_] {
    std::unique_lock<std::mutex> lock(hb->mu);
    while (!hb->stop) {
      try {
        store->add(key, 1);
        // Note [Failure watch]: another rank saw this group fail.
        // (A sub-group shares its parent's watch, whose key is in the parent's store.)
        if (failure->watching && !failure->broken && (failure->store ? failure->store : store)->check({detail::kBrokenKey})) {
          failure->told();
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
    store_->set("shardopt/failed/" + std::to_string(rank_), std::vector<uint8_t>{1});
    const std::vector<int64_t> before = heartbeat_counts(*store_, size_);
    std::this_thread::sleep_for(std::chrono::seconds(3));
    const std::vector<int64_t> after = heartbeat_counts(*store_, size_);
    std::vector<int> gone, failed_too;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || after[r] != before[r]) continue;
      (store_->check({"shardopt/failed/" + std::to_string(r)}) ? failed_too : gone).push_back(r);
    }
    std::string text;
    if (!gone.empty()) text = list(gone) + " stopped answering (no heartbeat for 3 s: exited, killed or hung)";
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
  PendingWork(start(CommStats::kAllreduce, [&] { return backend_->allreduce(ts, opts); }), what, rank_, timeout_,
              [this] { return roll_call(); })
      .wait();
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
  PendingWork(start(CommStats::kAllgather, [&] { return backend_->allgather(out, in, gather_opts); }), "desync report",
              rank_, timeout_)
      .wait();
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

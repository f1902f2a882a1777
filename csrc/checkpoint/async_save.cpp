// save_checkpoint_async: the snapshot, the background writer and its coordination through the
// store (shardopt/checkpoint/async_save.h).
#include <shardopt/checkpoint/async_save.h>
#include <shardopt/check.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "checkpoint/snapshot.h"

#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace shardopt {

namespace detail {

// One save in flight: its writer thread and, once the thread has finished, this rank's result.
struct AsyncSave {
  const OSS* optimizer = nullptr;  // the registry's key
  ProcessGroup* group = nullptr;   // the group wait() agrees over
  std::string path;
  std::thread writer;
  std::atomic<bool> finished{false};
  std::atomic<bool> cancelled{false};  // the writer stops waiting on the others (an exception unwinds)
  std::atomic<bool> orphaned{false};   // its group is gone before the ranks agreed (orphan_pending_save)
  std::atomic<bool> reported{false};   // an orphan's failure was reported
  std::string error;     // this rank's failure ("" when none), written before `finished`
  bool settled = false;  // every rank agreed on the result (wait(), or a later save or load)
  std::mutex join_mu;

  void join() {
    std::lock_guard<std::mutex> lock(join_mu);
    if (writer.joinable()) writer.join();
  }
  ~AsyncSave() { join(); }
};

namespace {

// The save in flight (or finished and not yet agreed on) per optimizer.
std::mutex registry_mu;
std::map<const OSS*, std::shared_ptr<AsyncSave>>& registry() {
  static auto* saves = new std::map<const OSS*, std::shared_ptr<AsyncSave>>();
  return *saves;
}

// A failed save whose group is gone before the ranks agreed on its result (Resilient replaced
// it after a rank failed): this rank reports its own failure alone, rather than not at all.
void warn_alone(const AsyncSave& save) {
  if (save.error.empty()) return;
  TORCH_WARN("shardopt: the background save of checkpoint '", save.path, "' failed on this rank: ", save.error,
             " (its group was replaced before the ranks agreed on the result: this rank reports it alone)");
}

// Collective: joins this rank's writer and agrees on the result, once. `group` is the group of
// the optimizer asking: a save left by an optimizer of another group (one since destroyed, whose
// address a new one took) is only joined, without a collective on a group that may be gone.
void settle(const std::shared_ptr<AsyncSave>& save, const ProcessGroup* group) {
  save->join();
  if (save->settled) return;
  save->settled = true;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry().find(save->optimizer);
    if (it != registry().end() && it->second == save) registry().erase(it);
  }
  if (group != save->group) {
    warn_alone(*save);
    return;
  }
  CommPhase phase("saving a checkpoint (the background write)");
  agree_on_failure(*save->group, save->error, "saving", save->path);
}

// Waits until `key` is in the store, polling (a store's wait() holds its client's lock for the
// whole wait, which would stall this rank's heartbeat); false at the deadline or when cancelled.
bool poll_for(c10d::Store& store, const std::string& key, std::chrono::milliseconds timeout,
              const std::atomic<bool>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!store.check({key})) {
    if (cancelled || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

// Note [The background writer]
// Each rank's writer writes its part (a sharded save), then sets "<id>/part/<rank>" in the store
// to "ok" or to its error. Rank 0's writer waits for every rank's key (within the group's
// timeout), writes the main file when every part is in, and sets "<id>/main" to "ok" or to what
// went wrong. Every other writer waits for that key. The keys do not outlive the save: rank 0
// deletes the part keys once it has set "<id>/main", and the last writer to read "<id>/main"
// deletes it. Once the main file is in, each writer removes the previous saves' parts; if it is not, each removes its own new part, which nothing names. No
// collective of the training group is called: the training loop may be in one meanwhile. Rank 0
// commits only when it sees every part (Note [A folder every rank sees]); when it does not, every
// writer reports rank 0's reason.
std::string write_in_background(const CheckpointSnapshot& snap, const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                int world, std::chrono::milliseconds timeout, const std::atomic<bool>& cancelled) {
  std::string error;
  try {
    write_parts(snap);
  } catch (const std::exception& e) {
    error = strip_prefix(e.what());
  }
  const std::string base = "shardopt/checkpoint/" + std::to_string(snap.id) + "/";
  bool committed = false, known_uncommitted = false;
  try {
    store->set(base + "part/" + std::to_string(rank), bytes(error.empty() ? "ok" : error));
    if (rank == 0) {
      std::string parts;  // why the main file cannot be written
      for (int r = 0; r < world && parts.empty(); ++r) {
        const std::string key = base + "part/" + std::to_string(r);
        if (!poll_for(*store, key, timeout, cancelled)) {
          parts = "rank " + std::to_string(r) + " did not write its part of the checkpoint within " +
                  std::to_string(timeout.count()) + " ms";
          break;
        }
        const std::string v = text(store->get(key));
        if (v != "ok") parts = "rank " + std::to_string(r) + " could not write its part: " + v;
      }
      if (parts.empty()) parts = unseen_parts(snap);  // Note [A folder every rank sees]
      if (parts.empty()) {
        try {
          write_checkpoint_file(snap.path, snap.main);
          committed = true;
        } catch (const std::exception& e) {
          parts = strip_prefix(e.what());
        }
      }
      if (error.empty() && !committed) error = parts;
      known_uncommitted = !committed;
      store->set(base + "main", bytes(committed ? "ok" : parts));
      // Every part key was read; "main" goes once every other writer has read it.
      for (int r = 0; r < world; ++r) store->deleteKey(base + "part/" + std::to_string(r));
      if (world == 1) store->deleteKey(base + "main");
    } else if (poll_for(*store, base + "main", timeout, cancelled)) {
      const std::string main = text(store->get(base + "main"));
      committed = main == "ok";
      known_uncommitted = !committed;
      // Rank 0's reason is every rank's: each names what kept the save from committing.
      if (!committed && error.empty()) error = "saving checkpoint '" + snap.path + "' failed on rank 0: " + main;
      if (store->add(base + "read", 1) == world - 1) {
        store->deleteKey(base + "main");
        store->deleteKey(base + "read");
      }
    } else if (error.empty()) {
      error = "checkpoint '" + snap.path + "': rank 0 did not write the main file within " +
              std::to_string(timeout.count()) + " ms";
    }
  } catch (const std::exception& e) {  // the store itself failed
    if (error.empty()) error = "checkpoint '" + snap.path + "': the rendezvous store failed: " + strip_prefix(e.what());
  }
  if (committed) {
    remove_stale_parts(snap, snap.sharded ? snap.id : -1);
  } else if (known_uncommitted) {
    unlink_parts(snap);  // no main file names them
  }
  // (Unsure whether rank 0 committed, the part stays: the main file may name it. The next
  // committed save removes it.)
  return error;
}

}  // namespace

// Saves whose group went before they were settled, kept until their writers finish (a writer
// may still wait on the store for the others: recovery does not wait for it).
std::vector<std::shared_ptr<AsyncSave>>& orphans() {
  static auto* saves = new std::vector<std::shared_ptr<AsyncSave>>();
  return *saves;
}

// An orphan's failure, once, by whichever comes last: orphan_pending_save or its writer.
void report_orphan(AsyncSave& save) {
  if (save.orphaned.load() && save.finished.load() && !save.reported.exchange(true)) warn_alone(save);
}

void orphan_pending_save(const OSS& optimizer) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& left = orphans();
  for (size_t i = 0; i < left.size();) {  // those whose writers are done
    if (left[i]->finished.load()) {
      left[i]->join();
      left[i] = left.back();
      left.pop_back();
    } else {
      ++i;
    }
  }
  auto it = registry().find(&optimizer);
  if (it == registry().end()) return;
  std::shared_ptr<AsyncSave> save = it->second;
  registry().erase(it);
  if (save->settled) return;
  save->settled = true;
  save->orphaned.store(true);
  report_orphan(*save);
  left.push_back(std::move(save));
}

void settle_pending_save(OSS& optimizer) {
  std::shared_ptr<AsyncSave> save;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry().find(&optimizer);
    if (it != registry().end()) save = it->second;
  }
  if (save) settle(save, &optimizer.global_group());
}

}  // namespace detail

PendingCheckpoint::PendingCheckpoint(std::shared_ptr<detail::AsyncSave> save) : save_(std::move(save)) {}

PendingCheckpoint& PendingCheckpoint::operator=(PendingCheckpoint&& other) noexcept {
  if (this != &other) {
    release();
    save_ = std::move(other.save_);
  }
  return *this;
}

PendingCheckpoint::~PendingCheckpoint() { release(); }

// Local: the writer is joined; an unsettled result stays in the registry for the next save or
// load on the optimizer to report.
// (Dropped while an exception unwinds, as when the loop failed: the writer stops waiting on the
// other ranks, which may be gone, instead of holding the error back for the timeout.)
void PendingCheckpoint::release() {
  if (save_) {
    if (std::uncaught_exceptions() > 0) save_->cancelled = true;
    save_->join();
  }
  save_.reset();
}

void PendingCheckpoint::wait() {
  if (save_) detail::settle(save_, save_->group);
}

bool PendingCheckpoint::done() const { return !save_ || save_->finished.load(); }

const std::string& PendingCheckpoint::path() const {
  static const std::string none;
  return save_ ? save_->path : none;
}

namespace {

PendingCheckpoint save_async(const std::string& path, torch::nn::Module& module, OSS& optimizer, const ShardedDDP* ddp,
                             const TrainingState& state, const CheckpointOptions& options) {
  detail::settle_pending_save(optimizer);  // at most one in flight
  ProcessGroup& group = optimizer.global_group();
  SHARDOPT_CHECK(group.store() || group.size() == 1, "save_checkpoint_async('", path,
                 "'): the writers coordinate through the group's rendezvous store, and this group has none; use "
                 "save_checkpoint");
  detail::CheckpointSnapshot snap;
  {
    CommPhase phase("saving a checkpoint (snapshot)");
    snap = detail::take_snapshot(path, module, optimizer, ddp, state, options, /*own_copies=*/true);
  }
  auto save = std::make_shared<detail::AsyncSave>();
  save->optimizer = &optimizer;
  save->group = &group;
  save->path = path;
  {
    std::lock_guard<std::mutex> lock(detail::registry_mu);
    detail::registry()[&optimizer] = save;
  }
  detail::AsyncSave* s = save.get();
  save->writer = std::thread([s, snap = std::move(snap), store = group.store(), rank = group.rank(),
                              world = group.size(), timeout = group.timeout()] {
    if (store) {
      s->error = detail::write_in_background(snap, store, rank, world, timeout, s->cancelled);
    } else {  // a world of one without a store: nobody to wait for
      try {
        detail::write_parts(snap);
        write_checkpoint_file(snap.path, snap.main);
        detail::remove_stale_parts(snap, snap.sharded ? snap.id : -1);
      } catch (const std::exception& e) {
        detail::unlink_parts(snap);
        s->error = detail::strip_prefix(e.what());
      }
    }
    s->finished.store(true);
    detail::report_orphan(*s);
  });
  return PendingCheckpoint(std::move(save));
}

}  // namespace

PendingCheckpoint save_checkpoint_async(const std::string& path, torch::nn::Module& module, OSS& optimizer,
                                        const TrainingState& state, CheckpointOptions options) {
  return save_async(path, module, optimizer, nullptr, state, options);
}

PendingCheckpoint save_checkpoint_async(const std::string& path, ShardedDDP& ddp, OSS& optimizer,
                                        const TrainingState& state, CheckpointOptions options) {
  detail::check_ddp_saves(path, ddp, optimizer);
  return save_async(path, *ddp.module(), optimizer, &ddp, state, options);
}

}  // namespace shardopt

// Saving a checkpoint without stopping training.
//
//   shardopt::PendingCheckpoint pending =
//       shardopt::save_checkpoint_async(dir + "/last.ckpt", *model, opt, state);  // every rank
//   ... training goes on while the files are written ...
//   pending.wait();   // every rank: the files are on disk, or every rank throws
//
// save_checkpoint_async is collective, like save_checkpoint: every rank calls it at the same
// step. It takes what the checkpoint holds (the same collectives as save_checkpoint), copies every
// tensor of it (into pinned host memory for a CUDA tensor), and returns; a thread of this rank then
// writes its files, in the same format and with the same atomic commit as save_checkpoint (each
// file renamed into place, a sharded save's main file last). The file holds the state at the
// call, bit for bit, whatever training does meanwhile.
//
// The writers coordinate through the group's rendezvous store, never through a collective of the
// training group: each rank's writer says in the store when its part is written (or why it
// failed); rank 0's writer then writes the main file, and says so; every writer waits for that
// (within the group's timeout) before it removes the previous save's parts.
//
// - At most one save is in flight per optimizer: a second save_checkpoint_async (or a
//   save_checkpoint) first finishes the one before, and throws on every rank if it failed.
// - load_checkpoint with a save in flight finishes the save first, then loads.
// - wait() is collective: it joins this rank's writer, then every rank learns whether any rank's
//   write failed (one all-reduce). done() is local and never blocks.
// - The destructor of a PendingCheckpoint that was not waited for joins this rank's writer (local:
//   no collective) and leaves its result to the next save or load on the same optimizer, which
//   reports a failure on every rank.
// - A kill or SIGTERM (a preemption) while a save is in flight loses that save only: its files are
//   either not renamed into place or not named by a main file, and the previous checkpoint stays
//   loadable.
#pragma once

#include <shardopt/checkpoint/checkpoint.h>

#include <memory>
#include <string>

namespace shardopt {

namespace detail {
struct AsyncSave;
}

class PendingCheckpoint {
 public:
  PendingCheckpoint() = default;
  explicit PendingCheckpoint(std::shared_ptr<detail::AsyncSave> save);
  PendingCheckpoint(PendingCheckpoint&&) noexcept = default;
  PendingCheckpoint& operator=(PendingCheckpoint&& other) noexcept;
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;
  ~PendingCheckpoint();

  // Collective: returns once every rank's files are on disk; throws on every rank (naming the
  // file and the rank) if any rank's write failed. A second call returns at once.
  void wait();
  // Local: this rank's writer has finished, either way.
  bool done() const;
  // The checkpoint's path ("" for a default-constructed one).
  const std::string& path() const;

 private:
  void release();
  std::shared_ptr<detail::AsyncSave> save_;
};

// Saves as save_checkpoint does, writing in the background (see above). Collective.
PendingCheckpoint save_checkpoint_async(const std::string& path, torch::nn::Module& module, OSS& optimizer,
                                        const TrainingState& state, CheckpointOptions options = {});
// The same for a ShardedDDP's module, with its error-feedback residuals (as save_checkpoint's
// ShardedDDP form).
PendingCheckpoint save_checkpoint_async(const std::string& path, ShardedDDP& ddp, OSS& optimizer,
                                        const TrainingState& state, CheckpointOptions options = {});

}  // namespace shardopt

// What a save writes, taken at one moment, and the steps save_checkpoint and
// save_checkpoint_async share. Internal.
#pragma once

#include <shardopt/checkpoint/checkpoint.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::detail {

struct CheckpointSnapshot {
  std::string path;
  int64_t id = 0;            // Note [Parts carry their save's id]
  bool sharded = false;
  // This rank's files of a sharded save, beside the main file: its part of the optimizer state
  // (on the ranks of the shard group) and its error-feedback residuals (a ShardedDDP's with
  // error feedback, every rank: Note [Error feedback in checkpoints]).
  struct Part {
    std::string path;
    c10::IValue value;
  };
  std::vector<Part> parts;
  bool writes_main = false;  // rank 0
  c10::IValue main;          // the main file's payload, on rank 0
  // Who wrote it: this rank, the optimizer parts' world (the shard group's size) and the
  // residuals' world (the global group's size). Note [Each rank removes its own parts].
  int rank = 0, shard_world = 1, world = 1;
  bool feedback = false;  // every rank wrote residuals
};

// The parts of a sharded save (every rank's, as named in its main file) that this rank cannot
// see, as one sentence; empty when it sees them all (Note [A folder every rank sees]).
std::string unseen_parts(const CheckpointSnapshot& snap);

// Collective over optimizer.global_group(): everything the save writes, as it is now, with the
// error-feedback residuals of `ddp` (may be null). With `own_copies`, every tensor in it is a
// copy of its own (in pinned host memory for a CUDA tensor), so that training may change the
// originals while the files are written.
CheckpointSnapshot take_snapshot(const std::string& path, torch::nn::Module& module, OSS& optimizer,
                                 const ShardedDDP* ddp, const TrainingState& state, const CheckpointOptions& options,
                                 bool own_copies);

// Throws unless `optimizer` is one of those `ddp` reduces gradients for (save_checkpoint's
// ShardedDDP forms).
void check_ddp_saves(const std::string& path, const ShardedDDP& ddp, const OSS& optimizer);

// Writes this rank's parts; removes them (errors ignored: nothing names them).
void write_parts(const CheckpointSnapshot& snap);
void unlink_parts(const CheckpointSnapshot& snap);

// After `snap` committed: removes the part files beside `snap.path` of earlier saves that this
// rank may remove (Note [Each rank removes its own parts]): those not of save `keep_id` (all for
// -1) under the names this rank writes, and on rank 0 those under names no rank of this save
// writes (other world sizes, parts without an id).
void remove_stale_parts(const CheckpointSnapshot& snap, int64_t keep_id);

// Collective: every rank learns whether any rank failed; the failing rank's own message is thrown
// there, the others name it.
void agree_on_failure(ProcessGroup& group, const std::string& error, const std::string& what, const std::string& path);

// An exception's message without the "shardopt: " prefix and the backtrace.
std::string strip_prefix(const std::string& message);

// Local: `optimizer` is about to be replaced with its group (Resilient lost a rank). Joins its
// save in flight, if any; an unsettled failure is a warning on this rank (nobody is left to agree
// on it), and the save is forgotten.
void orphan_pending_save(const OSS& optimizer);

// Collective: finishes the asynchronous save still in flight for `optimizer`, if any (every rank
// has one or none alike): waits for this rank's writer and throws on every rank if any rank's
// write failed. save_checkpoint, save_checkpoint_async and load_checkpoint call it first.
void settle_pending_save(OSS& optimizer);

}  // namespace shardopt::detail

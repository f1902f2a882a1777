// What a save writes, taken at one moment, and the steps save_checkpoint and
// save_checkpoint_async share. Internal.
#pragma once

#include <shardopt/checkpoint/checkpoint.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>

namespace shardopt::detail {

struct CheckpointSnapshot {
  std::string path;
  int64_t id = 0;            // Note [Parts carry their save's id]
  bool sharded = false;
  std::string part_path;     // this rank's part of a sharded save ("" when it writes none)
  c10::IValue part;          // its payload
  bool writes_main = false;  // rank 0
  c10::IValue main;          // the main file's payload, on rank 0
};

// Collective over optimizer.global_group(): everything the save writes, as it is now. With
// `own_copies`, every tensor in it is a copy of its own (in pinned host memory for a CUDA
// tensor), so that training may change the originals while the files are written.
CheckpointSnapshot take_snapshot(const std::string& path, torch::nn::Module& module, OSS& optimizer,
                                 const TrainingState& state, const CheckpointOptions& options, bool own_copies);

// Removes the part files beside `path` whose save is not `keep_id` (all of them for -1).
void remove_parts_except(const std::string& path, int64_t keep_id);

// Collective: every rank learns whether any rank failed; the failing rank's own message is thrown
// there, the others name it.
void agree_on_failure(ProcessGroup& group, const std::string& error, const std::string& what, const std::string& path);

// An exception's message without the "shardopt: " prefix and the backtrace.
std::string strip_prefix(const std::string& message);

// Collective: finishes the asynchronous save still in flight for `optimizer`, if any (every rank
// has one or none alike): waits for this rank's writer and throws on every rank if any rank's
// write failed. save_checkpoint, save_checkpoint_async and load_checkpoint call it first.
void settle_pending_save(OSS& optimizer);

}  // namespace shardopt::detail

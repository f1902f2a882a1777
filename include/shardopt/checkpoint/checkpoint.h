// Checkpoints: one collective call saves or restores a whole training run's state.
//
//   shardopt::TrainingState state{step, epoch, sampler.state(next_step)};
//   shardopt::save_checkpoint(dir + "/last.ckpt", *model, opt, state);   // every rank
//   ...
//   shardopt::TrainingState resumed = shardopt::load_checkpoint(dir + "/last.ckpt", *model, opt);
//   sampler.restore(*resumed.sampler);
//
// A checkpoint holds the module's parameters and buffers (by name), which parameters were
// trainable (the freeze state), the optimizer state, each rank's CPU random-number state, and
// the TrainingState. The optimizer state is either consolidated (PyTorch's layout, the one
// torch.optim loads in Python) or kept as one file per rank beside the main file (nothing is
// gathered on one rank); both load on any world size.
//
// File format (version kCheckpointFormatVersion): the 8 bytes "SHRDCKPT", the format version and
// a reserved word (uint32 each, little-endian), the payload length (uint64) and its CRC-32
// (uint32), then the payload, written by torch::pickle_save (a dict; tools/read_checkpoint.py
// reads it in Python). Every file is written atomically: to a temporary file in the same folder,
// fsync'ed, renamed over the target, and the folder fsync'ed, so a kill at any moment leaves
// either the previous file or the new one; missing folders are made first. A sharded save's
// parts carry the save's id in their names and the main file is written last, as the commit,
// naming that id; the previous save's parts are removed only after it (Note [Parts carry their
// save's id] in csrc/checkpoint/checkpoint.cpp): a kill at any moment, between the parts and the
// main file too, leaves the previous checkpoint loadable. A missing, truncated, corrupted or
// wrong-version file is an error that names the file, on every rank.
#pragma once

#include <shardopt/data/sampler.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include <torch/csrc/api/include/torch/nn/module.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace shardopt {

constexpr uint32_t kCheckpointFormatVersion = 1;

enum class OptimizerStateLayout {
  kConsolidated,  // gathered on rank 0, one shard at a time, into the main file
  kSharded,       // each rank writes its own part to "<path>.optim-<rank>-of-<world>.<id>"
};

struct CheckpointOptions {
  TORCH_ARG(OptimizerStateLayout, optimizer_state) = OptimizerStateLayout::kConsolidated;
};

// Where a training run is, besides its module and optimizer.
struct TrainingState {
  int64_t step = 0;   // optimizer steps taken
  int64_t epoch = 0;  // the epoch the next step belongs to
  std::optional<SamplerState> sampler;
  std::map<std::string, double> scalars;  // anything else the loop keeps (a schedule's position, ...)
};

// Saves `module`, `optimizer` and `state` to `path`. Collective: every rank of the optimizer's
// group calls it; rank 0 writes the main file. Every rank throws if any rank failed.
void save_checkpoint(const std::string& path, torch::nn::Module& module, OSS& optimizer, const TrainingState& state,
                     CheckpointOptions options = {});

// The same for a ShardedDDP's module (ddp.module()) and one of its optimizers. A sharded save
// also writes each rank's error-feedback residuals (ShardedDDPOptions::error_feedback), to
// "<path>.feedback-<rank>-of-<world>.<id>", so that a run resumed at the same world size is the
// straight one bit for bit; a consolidated save carries none (Note [Error feedback in
// checkpoints] in csrc/ddp/error_feedback_state.cpp).
void save_checkpoint(const std::string& path, ShardedDDP& ddp, OSS& optimizer, const TrainingState& state,
                     CheckpointOptions options = {});

// Restores what save_checkpoint saved, on any world size: parameters and buffers (copied in
// place, by name), requires_grad flags, optimizer state, this rank's random-number state (rank
// 0's when the world size differs), and returns the TrainingState. Collective; every rank throws
// if any rank failed, naming the file.
TrainingState load_checkpoint(const std::string& path, torch::nn::Module& module, OSS& optimizer);

// The same for a ShardedDDP's module, restoring its error-feedback residuals too where the
// checkpoint holds them for this world size; otherwise they start at zero, and rank 0 warns once
// saying why (a consolidated checkpoint, another world size, a save without them).
TrainingState load_checkpoint(const std::string& path, ShardedDDP& ddp, OSS& optimizer);

// Reads one checkpoint file and checks its header, version and checksum; returns its payload.
// Local.
torch::IValue read_checkpoint_file(const std::string& path);

// The same checks on bytes held in memory (`path` names them in errors), and the bytes a file
// of `payload` holds (header, checksum, payload).
torch::IValue parse_checkpoint(const std::vector<char>& bytes, const std::string& path);
std::vector<char> checkpoint_bytes(const torch::IValue& payload);

// Writes `payload` to `path` in the checkpoint format, atomically. Local.
void write_checkpoint_file(const std::string& path, const torch::IValue& payload);

}  // namespace shardopt

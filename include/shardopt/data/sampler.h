// BalancedSampler: which samples each rank trains on, step by step, in lockstep.
//
// Synchronous data parallelism hangs when one rank has a batch more than another: the fast rank
// waits at a collective the slow one never reaches. This sampler makes that impossible. For a
// given (dataset, seed, epoch) there is one global sequence of sample indices; step t of the
// epoch uses positions [t*G, (t+1)*G) of it, with G = world_size * batch_size (the global batch
// size), and rank r takes the slice [t*G + r*batch_size, t*G + (r+1)*batch_size). Hence:
//
//   - every rank gets exactly steps_per_epoch() batches of exactly batch_size entries;
//   - the global batch of step t depends on G, not on how G is split into ranks, and equals
//     batch t of a single-process sampler with batch_size G;
//   - batch(t) is a pure function of (dataset, options, epoch, world size, rank, t): any step can
//     be computed directly, in O(batch_size), on any rank, with no communication.
//
//   shardopt::BalancedSampler sampler(dataset.size(), rank, world_size,
//                                     shardopt::SamplerOptions(32).seed(7));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (int64_t t = 0; t < sampler.steps_per_epoch(); ++t) {
//       shardopt::Batch b = sampler.batch(t);
//       // loss = sum over i of real[i] * loss(sample indices[i]), divided by b.global_real
//     }
//   }
//
// The tail of an epoch (N not a multiple of G):
//   - Tail::kPad (default): the last global step is filled up with padding entries. A padding
//     entry carries a valid index (a real sample from the end of this epoch's sequence, so a
//     loader can fetch something and a chunked reader needs nothing new) with real == 0; it is
//     never a silent duplicate. Batch::global_real counts the real entries of the whole global
//     step, so `sum(real * loss) / global_real` (summed over ranks) is the exact mean.
//   - Tail::kDrop: the incomplete last global step is dropped (fewer than G samples per epoch);
//     which samples are dropped changes with the epoch.
//
// Shuffling is a keyed bijection of [0, N) (a Feistel network with cycle-walking, keyed from the
// seed and the epoch by SplitMix64): nothing N-sized is ever materialised, construction time and
// memory do not depend on N, and the order is identical on every compiler, standard library
// and rank. For chunked datasets (files, row groups) see SamplerOptions::chunk_sizes; chunked
// mode keeps memory proportional to the number of chunks. docs/sampler.md describes the
// construction; shardopt/data_sampler.h adapts the sampler to torch::data.
#pragma once

#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <vector>

namespace shardopt {

class ProcessGroup;

enum class Tail { kPad, kDrop };

// One rank's share of one global step.
struct Batch {
  std::vector<int64_t> indices;  // batch_size entries, each in [0, dataset_size)
  std::vector<uint8_t> real;     // 1: a sample of this step; 0: padding (weight it by zero)
  int64_t global_real = 0;       // real entries of this step over all ranks (1..G)
};

struct SamplerOptions {
  /* implicit */ SamplerOptions(int64_t batch_size) : batch_size_(batch_size) {}

  // Entries per rank per step (> 0); the same on every rank.
  TORCH_ARG(int64_t, batch_size);
  // false: the sequence is 0, 1, ..., N-1 in every epoch.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(Tail, tail) = Tail::kPad;
  // Empty: the dataset is N plain indices. Otherwise the dataset is stored in chunks (files, row
  // groups) of these sizes, in storage order: chunk c holds the indices
  // [sum of sizes before c, that + chunk_sizes[c]); every size > 0, and they sum to N.
  // Each epoch visits the chunks in a shuffled order and shuffles rows only within windows of
  // `window_chunks` consecutive (in visit order) chunks, so a reader that loads a chunk at its
  // first use and frees it after its last use never holds more than `window_chunks` chunks.
  TORCH_ARG(std::vector<int64_t>, chunk_sizes);
  // Chunks per shuffle window (>= 1; used with chunk_sizes): larger mixes better and needs more
  // resident chunks.
  TORCH_ARG(int64_t, window_chunks) = 1;
};

// "Resume at step next_step of epoch epoch". Plain data: store the fields in a checkpoint and
// hand them back to restore(). restore() rejects a state from another dataset or other options
// (by fingerprint), from another global batch size, or in a format version it does not know.
struct SamplerState {
  static constexpr int64_t kVersion = 1;

  int64_t version = kVersion;
  // Hash of the dataset (size, chunk sizes) and of the options that shape the sequence
  // (shuffle, seed, tail, window_chunks). Not of world_size / batch_size: a state may be
  // restored on another world size as long as G = world_size * batch_size is unchanged.
  uint64_t fingerprint = 0;
  int64_t dataset_size = 0;
  int64_t global_batch_size = 0;
  int64_t epoch = 0;
  int64_t next_step = 0;  // in [0, steps_per_epoch()]

  // The six fields as integers (version, fingerprint, dataset_size, global_batch_size, epoch,
  // next_step), for formats that store integers, and back.
  std::array<int64_t, 6> to_fields() const;
  static SamplerState from_fields(const std::array<int64_t, 6>& fields);
};

class BalancedSampler {
 public:
  // rank in [0, world_size); dataset_size >= 0 (at most 2^62).
  BalancedSampler(int64_t dataset_size, int rank, int world_size, SamplerOptions options);
  // Takes rank and world size from `group` and checks that every rank passed the same
  // dataset_size and options; on any difference, every rank throws, naming the field.
  // Collective: every rank of the group must call it.
  BalancedSampler(int64_t dataset_size, const ProcessGroup& group, SamplerOptions options);

  // The same on every rank: ceil(N / G) with Tail::kPad, floor(N / G) with Tail::kDrop.
  int64_t steps_per_epoch() const;
  // Selects the epoch's order (epoch >= 0). O(number of chunks); O(1) for plain data.
  void set_epoch(int64_t epoch);
  // This rank's batch of step `step` (in [0, steps_per_epoch())) of the current epoch.
  // O(batch_size) (times log(number of chunks) for chunked data), for any step.
  Batch batch(int64_t step) const;
  // The state that resumes the current epoch at `next_step` (in [0, steps_per_epoch()]).
  SamplerState state(int64_t next_step) const;
  // Sets the epoch from `state`; afterwards batch(t) for t >= state.next_step returns what the
  // sampler that produced the state would have returned, also when this sampler has another
  // world size and batch size with the same product.
  void restore(const SamplerState& state);

  int64_t epoch() const { return epoch_; }
  int64_t dataset_size() const { return dataset_size_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const SamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
  SamplerOptions options_;
  int64_t global_batch_ = 0;
  int64_t steps_ = 0;
  uint64_t fingerprint_ = 0;
  // Chunked data only: first index of each chunk in storage order (size C + 1).
  std::vector<int64_t> chunk_begin_;

  // Set by set_epoch.
  int64_t epoch_ = 0;
  uint64_t epoch_key_ = 0;
  // Chunked data only: the chunks in visit order, and the first sequence position of each
  // (size C + 1). Window w covers visit slots [w * window_chunks, (w + 1) * window_chunks).
  std::vector<int64_t> visit_chunk_;
  std::vector<int64_t> visit_begin_;
  int64_t last_window_begin_ = 0;  // first position of the last window (plain data: 0)

  struct Cursor;  // resolves runs of positions to indices (csrc/data/sampler.cpp)
};

}  // namespace shardopt

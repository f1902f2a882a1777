// A tiny MLP written with plain tensor ops, deterministic on every rank, and per-rank data.
#pragma once

#include <ATen/ATen.h>
#include <shardopt/comm/process_group.h>

#include <vector>

namespace shardopt::testing {

// Parameters of x[B,5] -> tanh(x W1^T + b1)[B,8] -> (h W2^T + b2)[B,3] -> * s[3]: the same
// values on every rank for the same seed.
std::vector<at::Tensor> make_params(uint64_t seed = 7);
std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params);

struct Data {
  at::Tensor x, y;
};
// Samples [first, first + count) of step `step`'s global batch: a pure function of the indices,
// so any split over ranks sees the same global batch.
Data global_data(int64_t step, int64_t first, int64_t count);
// This rank's share of a global batch of `per_rank * world` samples.
Data rank_data(int64_t step, int rank, int per_rank);

// The model's output; without `use_scale` the last parameter gets no gradient.
at::Tensor output(const std::vector<at::Tensor>& params, const at::Tensor& x, bool use_scale = true);

// A model whose one tensor holds over 90% of the elements: x[B,5] -> tanh(x A)[B,80] ->
// tanh(0.1 h D)[B,80] -> h C + b [B,3], with A [5,80], D [80,80] (6400 of 7043), C [80,3], b [3].
std::vector<at::Tensor> make_dominant_params(uint64_t seed = 11);
at::Tensor dominant_output(const std::vector<at::Tensor>& params, const at::Tensor& x);

// Sum of squared errors over the batch, divided by `divisor`.
at::Tensor loss(const std::vector<at::Tensor>& params, const Data& data, double divisor, bool use_scale = true);
// The same for an output computed elsewhere.
at::Tensor loss_of(const at::Tensor& out, const Data& data, double divisor);

// Averages (or sums) each defined gradient over the ranks: the all-reduce data-parallel reference.
void allreduce_grads(const std::vector<at::Tensor>& params, ProcessGroup& group, bool average = true);

// Sets each tensor of `params` (a module's parameters, say) to randn * scale from a generator of
// its own seeded with `seed`: the same values on every rank, whichever thread draws first (ranks
// that are threads share ATen's global generator, so manual_seed there gives no such promise).
void fill_seeded(const std::vector<at::Tensor>& params, uint64_t seed, double scale = 0.3);
// randn of `sizes` from a generator of its own seeded with `seed`.
at::Tensor seeded_randn(std::vector<int64_t> sizes, uint64_t seed);

// max |a - b| / max(max |b|, tiny): the relative difference of two tensors.
double rel_diff(const at::Tensor& a, const at::Tensor& b);

// True when every rank holds bitwise the same values in `params`.
bool same_on_all_ranks(const std::vector<at::Tensor>& params, ProcessGroup& group);

// Rank 0's `bytes` on every rank (a pickled state dict, say). Collective.
std::vector<char> broadcast_bytes(const std::vector<char>& bytes, ProcessGroup& group);

// True when every rank's `t` differs from every other rank's.
bool differs_across_ranks(const at::Tensor& t, ProcessGroup& group);
// Every rank's copy of `mine` (contiguous), in rank order.
std::vector<at::Tensor> everyones(ProcessGroup& group, const at::Tensor& mine);

}  // namespace shardopt::testing

// GradSlabs: the memory of the gradient buckets a rank owns in one optimizer's layout (Note
// [Gradient slab] in grad_slabs.cpp). Internal to ShardedDDP, which keeps one per optimizer.
#pragma once

#include <shardopt/optim/flat_layout.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardopt::detail {

class GradSlabs {
 public:
  // Follows a new layout (`layout` outlives the next reset) of the shard of `rank`: the memory of
  // its buckets is carved anew when a backward first asks for it. Gradients that are views of the
  // old memory keep it alive until they are cleared.
  void reset(const FlatLayout& layout, int rank);

  // The memory of layout bucket `bucket`, in which this rank holds a piece (FlatLayout::
  // holds_piece_of): its gradients, then one count per
  // piece of the ranks that had a gradient for it, in `options` (the dtype gradients are reduced
  // in). Kept between backward passes: after a reduction the owner's gradients are views of it. At
  // the first request after a layout, every bucket of the group this rank owns is carved out of
  // the group's slab (one allocation), each with a storage of its own. ShardedDDP replaces a
  // bucket's memory where a backward had to reduce elsewhere.
  at::Tensor& bucket_memory(size_t bucket, const at::TensorOptions& options);
  // The slab of layout group `group`; undefined before its buckets were asked for.
  at::Tensor slab(size_t group) const;
  // Bytes of all slabs.
  int64_t bytes() const;

 private:
  void carve(size_t group, const at::TensorOptions& options);

  const FlatLayout* layout_ = nullptr;
  int rank_ = 0;
  std::vector<at::Tensor> slabs_;          // per layout group, once its buckets were asked for
  std::vector<at::Tensor> bucket_memory_;  // per layout bucket this rank owns
};

}  // namespace shardopt::detail

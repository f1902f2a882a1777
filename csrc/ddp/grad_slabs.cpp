// The memory of the gradient buckets a rank owns, one slab per layout group (GradSlabs).
#include "ddp/grad_slabs.h"

#include <shardopt/optim/placement.h>

#include <ATen/ATen.h>

#include <utility>

namespace shardopt::detail {

// Note [Gradient slab]
// The gradients a rank owns live in the memory of its buckets: a reduction to the owner leaves them
// there, and the next backward reuses that memory (or accumulates into it, Note [Gradients as bucket
// views] in csrc/ddp/bucket_views.cpp). ShardedDDP owns it (a GradSlabs per optimizer), one slab per
// layout group: the buckets this rank owns, in layout order, each its gradients (the bucket's range of
// the shard, gaps included; a row bucket's: this rank's row, where that row holds a piece) followed
// by one count per piece, each starting at a multiple of 16 elements.
// It is allocated once per layout, when a backward first asks for one of its buckets, not once per
// bucket and backward. Each bucket is a view of the slab with a storage of its own (its data pointer
// keeps the slab alive), so that the executor can still tell, per bucket, whether any tensor besides
// the gradients it knows refers to that memory. Where one does (gradients left uncleared, a view the
// user keeps), that backward reduces in memory of its own, which ShardedDDP keeps for the bucket from
// then on; its slab range is not written while anything refers to it, and the slab lives as long as
// anything does. A new layout forgets the slab: gradients set to none free it, and gradients zeroed in
// place move into the new slab at the next backward (set_data: the same tensors, Note [Gradients as
// bucket views]). Gradients kept in it otherwise (left uncleared, or zeroed in a bucket that also
// holds a split piece) keep it alive until they are cleared.

namespace {

// A tensor of `numel` elements over `slab`'s memory from element `offset` on, with a storage of
// its own that keeps `slab` alive.
at::Tensor carve_out(const at::Tensor& slab, int64_t offset, int64_t numel) {
  const auto itemsize = static_cast<int64_t>(slab.element_size());
  void* data = static_cast<char*>(slab.data_ptr()) + offset * itemsize;
  c10::DataPtr memory(data, new at::Tensor(slab), [](void* keep) { delete static_cast<at::Tensor*>(keep); },
                      slab.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(numel * itemsize), std::move(memory),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, slab.options()).set_(std::move(storage), 0, {numel}, {1});
}

}  // namespace

void GradSlabs::reset(const FlatLayout& layout, int rank) {
  layout_ = &layout;
  rank_ = rank;
  slabs_.assign(layout.groups().size(), at::Tensor());
  bucket_memory_.assign(layout.buckets().size(), at::Tensor());
}

at::Tensor& GradSlabs::bucket_memory(size_t bucket, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(layout_ != nullptr, "GradSlabs used before reset()");
  const auto& buckets = layout_->buckets();
  TORCH_INTERNAL_ASSERT(bucket < buckets.size(), "bucket ", bucket, " of ", buckets.size());
  const size_t group = buckets[bucket].group;
  if (!slabs_[group].defined()) carve(group, options);
  // (carve gives memory to exactly the buckets this rank holds a piece of)
  TORCH_INTERNAL_ASSERT(bucket_memory_[bucket].defined(), "bucket ", bucket, " of ", buckets.size(),
                        " is not owned by rank ", rank_);
  return bucket_memory_[bucket];
}

void GradSlabs::carve(size_t group, const at::TensorOptions& options) {
  const auto& buckets = layout_->buckets();
  std::vector<std::pair<size_t, int64_t>> offsets;  // (bucket, first element in the slab)
  int64_t total = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].group != group || !layout_->holds_piece_of(b, rank_)) continue;
    offsets.emplace_back(b, total);
    total += bucket_memory_numel(buckets[b]);
  }
  slabs_[group] = at::empty({total}, options);
  for (const auto& [b, offset] : offsets) {
    bucket_memory_[b] = carve_out(slabs_[group], offset, buckets[b].numel() + buckets[b].owned_pieces());
  }
}

at::Tensor GradSlabs::slab(size_t group) const {
  return group < slabs_.size() ? slabs_[group] : at::Tensor();
}

int64_t GradSlabs::bytes() const {
  int64_t total = 0;
  for (const auto& s : slabs_) total += s.defined() ? static_cast<int64_t>(s.nbytes()) : 0;
  return total;
}

}  // namespace shardopt::detail

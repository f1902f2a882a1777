// The store's gradients: the reduced gradients of the split ranges this rank owns, the memory of
// the gradient buckets it owns, and which gradients the last zero_grad(false) zeroed.
#include "optim/shard_store.h"

#include <shardopt/optim/placement.h>

#include <ATen/ATen.h>

namespace shardopt::detail {

// Note [Owned gradients]
// A rank steps the ranges it owns with the reduced gradient of each. For a whole parameter that
// is the parameter's own .grad, where DDP leaves it and where user code (clipping, a hook, a
// gradient accumulated across backward passes) sees it. The range of a split parameter has no
// tensor of the user's to carry it: ShardedDDP hands its reduced gradient to the store, keyed by
// (parameter, range) as the layout names it, and OSS's step reads it from there. So neither class
// writes into the other's tensors, and no gradient is set aside and put back around the step.
// The gradients follow their ranges when state moves to new owners (migrate_holdings), and are
// forgotten for ranges this rank no longer holds.

const at::Tensor& ShardStore::grad(size_t param, Range range) const {
  static const at::Tensor none;
  auto it = grads_.find({param, range.begin, range.end});
  return it == grads_.end() ? none : it->second;
}

void ShardStore::set_grad(size_t param, Range range, at::Tensor grad) {
  if (grad.defined()) {
    grads_[{param, range.begin, range.end}] = std::move(grad);
  } else {
    grads_.erase({param, range.begin, range.end});
  }
}

void ShardStore::for_each_grad(const std::function<void(at::Tensor&)>& fn) {
  for (auto& [key, g] : grads_) fn(g);
}

void ShardStore::retain_grads(const std::vector<std::vector<Holding>>& holdings, int rank) {
  for (auto it = grads_.begin(); it != grads_.end();) {
    const auto& [param, begin, end] = it->first;
    bool held = false;
    if (param < holdings.size()) {
      for (const Holding& h : holdings[param]) held |= h.rank == rank && h.in_param == Range{begin, end};
    }
    it = held ? std::next(it) : grads_.erase(it);
  }
}

int64_t ShardStore::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& [key, g] : grads_) bytes += static_cast<int64_t>(g.nbytes());
  return bytes;
}

void ShardStore::note_zeroed(const at::Tensor& grad) {
  zeroed_.insert_or_assign(grad.unsafeGetTensorImpl(),
                           Zeroed{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(grad.getIntrusivePtr()),
                                  static_cast<int64_t>(grad._version())});
}

bool ShardStore::zeroed(const at::Tensor& grad) const {
  if (!grad.defined()) return false;
  auto it = zeroed_.find(grad.unsafeGetTensorImpl());
  return it != zeroed_.end() && !it->second.grad.expired() &&
         it->second.grad._unsafe_get_target() == grad.unsafeGetTensorImpl() &&
         static_cast<int64_t>(grad._version()) == it->second.version;
}

// Note [Gradient slab]
// The gradients a rank owns live in the memory of its buckets: a reduction to the owner leaves
// them there, and the next backward reuses that memory (or accumulates into it, Note [Gradients
// as bucket views] in csrc/ddp/bucket_views.cpp). The store owns it, one slab per layout group: the
// buckets this rank owns, in layout order, each its gradients (the bucket's range of the shard,
// gaps included; a row bucket's: this rank's row) followed by one count per piece, each starting
// at a multiple of 16 elements.
// It is allocated once per layout, when a backward first asks for one of its buckets, not once
// per bucket and backward. Each bucket is a view of the slab with a storage of its own (its data
// pointer keeps the slab alive), so that the executor can still tell, per bucket, whether any
// tensor besides the gradients it knows refers to that memory. Where one does (gradients left
// uncleared, a view the user keeps), that backward reduces in memory of its own, which the store
// keeps for the bucket from then on; its slab range is not written while anything refers to it,
// and the slab lives as long as anything does. A new layout forgets the slab: gradients set to
// none free it, and gradients zeroed in place move into the new slab at the next backward
// (set_data: the same tensors, Note [Gradients as bucket views]). Gradients kept in it otherwise
// (left uncleared, or zeroed in a bucket that also holds a split piece) keep it alive until they
// are cleared.

namespace {

// A tensor of `numel` elements over `slab`'s memory from element `offset` on, with a storage of
// its own that keeps `slab` alive.
at::Tensor carve(const at::Tensor& slab, int64_t offset, int64_t numel) {
  const auto itemsize = static_cast<int64_t>(slab.element_size());
  void* data = static_cast<char*>(slab.data_ptr()) + offset * itemsize;
  c10::DataPtr memory(data, new at::Tensor(slab), [](void* keep) { delete static_cast<at::Tensor*>(keep); },
                      slab.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(numel * itemsize), std::move(memory),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, slab.options()).set_(std::move(storage), 0, {numel}, {1});
}

}  // namespace

at::Tensor& ShardStore::bucket_memory(size_t bucket, const at::TensorOptions& options) {
  const auto& buckets = layout_.buckets();
  TORCH_INTERNAL_ASSERT(bucket < buckets.size() && (buckets[bucket].rows() || buckets[bucket].owner == group_->rank()), "bucket ", bucket,
                        " of ", buckets.size(), " is not owned by rank ", group_->rank());
  if (bucket_memory_.size() != buckets.size()) bucket_memory_.assign(buckets.size(), at::Tensor());
  if (grad_slabs_.size() != layout_.groups().size()) grad_slabs_.assign(layout_.groups().size(), at::Tensor());
  const size_t group = buckets[bucket].group;
  if (!grad_slabs_[group].defined()) carve_grad_slab(group, options);
  return bucket_memory_[bucket];
}

void ShardStore::carve_grad_slab(size_t group, const at::TensorOptions& options) {
  const auto& buckets = layout_.buckets();
  std::vector<std::pair<size_t, int64_t>> offsets;  // (bucket, first element in the slab)
  int64_t total = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].group != group || (!buckets[b].rows() && buckets[b].owner != group_->rank())) continue;
    offsets.emplace_back(b, total);
    total += bucket_memory_numel(buckets[b]);
  }
  grad_slabs_[group] = at::empty({total}, options);
  for (const auto& [b, offset] : offsets) {
    bucket_memory_[b] = carve(grad_slabs_[group], offset, buckets[b].numel() + buckets[b].owned_pieces());
  }
}

at::Tensor ShardStore::grad_slab(size_t group) const {
  return group < grad_slabs_.size() ? grad_slabs_[group] : at::Tensor();
}

}  // namespace shardopt::detail

// The store's gradients: the reduced gradients of the split ranges this rank owns, and which
// gradients the last zero_grad(false) zeroed.
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

}  // namespace shardopt::detail

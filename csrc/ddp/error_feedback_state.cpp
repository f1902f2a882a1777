#include "ddp/error_feedback_state.h"

#include "ddp/executor.h"

#include <ATen/Functions.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace shardopt {

// Note [Error feedback in checkpoints]
// The residuals (Note [Error feedback] in reduction.cpp) are this rank's alone: what rounding
// dropped from its own contributions. A sharded checkpoint taken through save_checkpoint's
// ShardedDDP form writes them to one file per rank ("<path>.feedback-<rank>-of-<world>.<id>",
// beside the optimizer's parts, committed by the same main file), with the layout they follow:
// every bucket's owner, size and row stride, and every piece in it (its parameter, its range of
// that parameter, its place in the bucket). load_checkpoint's ShardedDDP form restores them
// where the world size is the one they were saved at; the first reduction takes them if its
// buckets have that layout (the same trainable set, partition and bucket sizes: a resumed run
// has them), so a resumed run is the straight one bit for bit. Anything else starts the residuals
// at zero, as a new layout does: a consolidated checkpoint or another world size (load_checkpoint
// says which, once, on rank 0), other bucket sizes or another trainable set (the first reduction
// says so, on rank 0), and a checkpoint
// without residuals loaded into a run with error feedback (one saved without it, or by the
// module-and-optimizer form). A run without error feedback ignores the residuals a checkpoint
// holds; resuming with another gradient wire is not refused, and keeps the residuals (they
// remain what rounding dropped, and the new wire's rounding feeds back from there).

at::Tensor ShardedDDP::residual_layout() const {
  std::vector<int64_t> facts{group_->size(), group_->rank(), static_cast<int64_t>(buckets_.size())};
  for (const Bucket& b : buckets_) {
    facts.insert(facts.end(), {static_cast<int64_t>(b.index), b.owner, b.numel, b.stride,
                               static_cast<int64_t>(b.entries.size())});
    for (size_t e : b.entries) {
      const Entry& entry = entries_[e];
      const auto module_position = module_index_.at(hooked_[entry.hooked].param.unsafeGetTensorImpl());
      facts.insert(facts.end(), {static_cast<int64_t>(module_position), entry.in_param.begin, entry.in_param.end,
                                 entry.offset});
    }
  }
  return at::tensor(facts, at::kLong);
}

void ShardedDDP::adopt_restored_residuals() {
  RestoredResiduals restored = std::move(*restored_residuals_);
  restored_residuals_.reset();
  const at::Tensor layout = residual_layout();
  if (!(restored.layout.sizes() == layout.sizes() && restored.layout.equal(layout))) {
    if (global_->rank() == 0) {
      TORCH_WARN("shardopt: the error-feedback residuals the checkpoint holds were saved for other buckets (another "
                 "trainable set, partition or bucket size): they start at zero");
    }
    return;
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const at::Tensor& r = restored.residuals[i];
    if (r.numel() > 0) buckets_[i].residual = r.to(buckets_[i].options.device(), at::kBFloat16).contiguous();
  }
}

namespace detail {

bool ErrorFeedbackState::reduces_for(const ShardedDDP& ddp, const OSS& optimizer) {
  return std::find(ddp.optimizers_.begin(), ddp.optimizers_.end(), &optimizer) != ddp.optimizers_.end();
}

c10::IValue ErrorFeedbackState::save(const ShardedDDP& ddp) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  c10::List<at::Tensor> residuals;
  if (ddp.restored_residuals_) {  // restored and not taken yet: kept as they came
    d.insert("layout", ddp.restored_residuals_->layout);
    for (const at::Tensor& r : ddp.restored_residuals_->residuals) residuals.push_back(r);
  } else {
    d.insert("layout", ddp.residual_layout());
    for (const auto& b : ddp.buckets_) {
      residuals.push_back(b.residual.defined() ? b.residual : at::empty({0}, at::kBFloat16));
    }
  }
  d.insert("residuals", residuals);
  return d;
}

void ErrorFeedbackState::restore(ShardedDDP& ddp, const c10::IValue& saved) {
  for (auto& b : ddp.buckets_) b.residual = at::Tensor();
  ddp.restored_residuals_.reset();
  if (saved.isNone()) return;
  const auto d = saved.toGenericDict();
  ShardedDDP::RestoredResiduals restored;
  restored.layout = d.at("layout").toTensor();
  for (const auto& r : d.at("residuals").toListRef()) restored.residuals.push_back(r.toTensor());
  SHARDOPT_CHECK(restored.layout.numel() >= 3 &&
                     restored.layout[2].item<int64_t>() == static_cast<int64_t>(restored.residuals.size()),
                 "the error-feedback residuals in the checkpoint do not match their layout");
  ddp.restored_residuals_ = std::move(restored);
}

}  // namespace detail
}  // namespace shardopt

// OSS's step: the trainable set agreed and laid out, the state settled, the owned shard stepped
// with its gradients (the fused step, or the wrapped optimizer's), the gradient scaler's unscale
// folded in, and every rank's copy made current.
#include <shardopt/optim/oss.h>
#include <shardopt/optim/muon.h>
#include <shardopt/check.h>

#include <shardopt/comm/agree.h>

#include "cuda/kernels_adapter.h"
#include "optim/fused_step_mixed.h"
#include "optim/master_weights.h"
#include "optim/options_agreement.h"
#include "optim/shard_store.h"
#include "optim/state_slabs.h"
#include "optim/trainable.h"

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace shardopt {

void OSS::sync_options_to_local() {
  SHARDOPT_CHECK(param_groups_.size() == group_sizes_.size(),
              "OSS param groups changed after construction (", group_sizes_.size(), " -> ",
              param_groups_.size(), "); add_param_group is not supported, build a new OSS");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    SHARDOPT_CHECK(param_groups_[g].params().size() == group_sizes_[g], "OSS param group ", g,
                " changed size after construction (", group_sizes_[g], " -> ", param_groups_[g].params().size(),
                " parameters)");
    units_[unit_of_group_[g]].local->param_groups()[local_group_of_[g]].set_options(param_groups_[g].options().clone());
  }
}

bool OSS::steps(size_t param) const {
  return store_->trainable()[param] != 0 && params_[param].requires_grad();
}

std::vector<detail::GroupOptions> OSS::group_options() const {
  std::vector<detail::GroupOptions> out;
  for (size_t g = 0; g < std::min(param_groups_.size(), unit_of_group_.size()); ++g) {
    const Unit& unit = units_[unit_of_group_[g]];
    detail::GroupOptions o;
    if (unit.codec) {
      o.optimizer = unit.codec->name;
      for (const auto& item : unit.codec->encode_options(param_groups_[g].options())) {
        o.options.emplace_back(item.key().toStringRef(), detail::option_text(item.value()));
      }
    } else {
      o.optimizer = unit.class_name;
    }
    out.push_back(std::move(o));
  }
  return out;
}

uint64_t OSS::options_hash() const { return detail::options_hash(group_options()); }

void OSS::check_options_alike() const { detail::check_options_alike(*global_group_, group_options()); }

std::vector<uint8_t> OSS::agreed_trainable(bool force) {
  CommPhase phase("step (trainability check)");
  auto mask = detail::trainable_mask(params_);
  const auto name = [](size_t i) { return "parameter " + std::to_string(i); };
  // The trainable set and the optimizers' options in one hash (Note [Optimizers agree across
  // ranks]); the full comparisons only when it differs, or when asked.
  if (!force) {
    Agreement agreement = detail::mask_agreement(mask, name);
    agreement.field("the optimizers' options", static_cast<int64_t>(options_hash() >> 1));
    if (agreement.agrees(*global_group_)) return mask;
  }
  detail::agree_on_mask(*global_group_, mask, /*exhaustive=*/true, name);
  check_options_alike();
  return mask;
}

void OSS::refresh_trainable() {
  auto agreed = agreed_trainable(/*force=*/global_group_->size() > 1);
  // Under a ShardedDDP, its forward (or its refresh_trainable) lays the store out: its buckets and
  // the gradients it reduced are those of the current plan until then.
  if (!store_->handed_over()) lay_out_for(agreed);
}

torch::Tensor OSS::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step_with(std::nullopt);
  return loss;
}

namespace {

// Whether the fused step takes the scaler's unscale for `optimizer`: Adam, AdamW or SGD.
bool unscales_in_step(const torch::optim::Optimizer& optimizer) {
  return detail::adam_like(optimizer) || dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr;
}

}  // namespace

bool OSS::can_unscale_in_step() const {
  return options_.fused_step() &&
         std::all_of(units_.begin(), units_.end(), [](const Unit& unit) { return unscales_in_step(*unit.local); });
}

bool OSS::step_unscaling(double inv_scale) {
  SHARDOPT_CHECK(std::isfinite(inv_scale) && inv_scale > 0, "OSS::step_unscaling: inv_scale must be finite and positive, got ",
                 inv_scale);
  SHARDOPT_CHECK(options_.fused_step(), "OSS::step_unscaling needs the fused step: OSSOptions::fused_step is off");
  SHARDOPT_CHECK(!steps_in_backward(), "OSS::step_unscaling: this OSS steps in its ShardedDDP's backward "
                 "(ShardedDDPOptions::step_in_backward), before any scale could be checked; turn step_in_backward off "
                 "to use a gradient scaler");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const Unit& unit = units_[unit_of_group_[g]];
    SHARDOPT_CHECK(unscales_in_step(*unit.local), "OSS::step_unscaling needs every optimizer of the OSS to be Adam, AdamW or "
                   "SGD under the fused step; param group ", g, "'s is ", unit.class_name,
                   " (unscale the gradients first, as ShardedGradScaler::unscale_ does)");
  }
  return step_with(inv_scale);
}

bool OSS::step_with(std::optional<double> inv_scale) {
  if (backward_step_) return finish_backward_step();  // (Note [A step in the backward])
  finish_param_sync();
  // ShardedDDP checks the set at its forward and lays the store out for it; without it, the step
  // checks, unless the user turned the check off: then the local set is taken as agreed.
  const bool checked_outside = store_->trainable_checked_outside();
  const bool check = options_.check_trainable_every_step() && !checked_outside;
  if (check) {
    lay_out_for(agreed_trainable(false));  // agreed: every rank lays out alike
  } else if (!checked_outside) {
    lay_out_for(detail::trainable_mask(params_));  // taken as agreed, unchecked
  }
  settle_state();  // the set is agreed by now: every rank moves the same ranges
  sync_options_to_local();
  // The rows the sync packs straight from the masters (Note [Syncing from the masters]).
  const detail::MasterRows from_masters =
      masters_ ? store_->master_rows(holdings_, group_->rank(), slabs_->slabs_of(detail::kMasterSlab))
               : detail::MasterRows{};
  store_->begin_step_sync();
  const bool stepped = step_shard(inv_scale, from_masters);
  if (stepped) {  // what has state now (a step the scaler skipped made none)
    auto& has_state = store_->stepped();
    for (size_t i = 0; i < params_.size(); ++i) has_state[i] |= steps(i);
  }
  store_->sync_after_step(from_masters.rows);
  place_state();  // state the wrapped optimizer's own step made joins its slab
  // The set was just agreed on, so every rank takes the same decision.
  if (check) rebalance();
  return stepped;
}

namespace {

// Sets the gradient of each tensor the wrapped optimizer steps for the length of its own step():
// OSS's tensors, which nothing else reads (Note [Owned gradients]). Cleared after, also on error.
class StepGradients {
 public:
  StepGradients(torch::optim::Optimizer& local, const detail::Gradients& grads) : local_(local) {
    for (auto& group : local_.param_groups()) {
      for (auto& t : group.params()) {
        auto it = grads.find(t.unsafeGetTensorImpl());
        t.mutable_grad() = it == grads.end() ? at::Tensor() : it->second;
      }
    }
  }
  ~StepGradients() {
    for (auto& group : local_.param_groups()) {
      for (auto& t : group.params()) t.mutable_grad() = at::Tensor();
    }
  }

 private:
  torch::optim::Optimizer& local_;
};

// Restores an optimizer's param groups as they were, however the scope ends.
class KeptGroups {
 public:
  explicit KeptGroups(torch::optim::Optimizer& local) : local_(local) {
    for (auto& g : local_.param_groups()) params_.push_back(g.params());
  }
  ~KeptGroups() {
    for (size_t g = 0; g < params_.size(); ++g) local_.param_groups()[g].params() = params_[g];
  }
  const std::vector<std::vector<at::Tensor>>& params() const { return params_; }

 private:
  torch::optim::Optimizer& local_;
  std::vector<std::vector<at::Tensor>> params_;
};

}  // namespace

// Note [8-bit state one tensor at a time]
// Muon steps each matrix on its own (its momentum, its orthogonalisation), so under kInt8 its step
// runs one matrix at a time: that matrix's momentum decoded to fp32, stepped, coded again, before
// the next. Only one matrix's fp32 momentum exists at once, not the whole unit's, which would be
// four times the codes that kInt8 keeps. The result is the same: each matrix's step reads only its
// own state and gradient. A registered optimizer may couple its tensors, so its compressible state
// is decoded for its whole unit.
namespace {

void step_one_tensor_at_a_time(detail::StateSlabs& slabs, torch::optim::Optimizer& local,
                               const detail::OptimizerCodec& codec, const detail::Gradients& grads) {
  KeptGroups kept(local);
  for (size_t g = 0; g < kept.params().size(); ++g) {
    for (const at::Tensor& p : kept.params()[g]) {
      for (auto& group : local.param_groups()) group.params().clear();
      local.param_groups()[g].params().push_back(p);
      const std::unordered_set<const void*> only{p.unsafeGetTensorImpl()};
      slabs.widen(local, codec, &only);
      {
        StepGradients with(local, grads);
        local.step();
      }
      slabs.adopt(local, codec);
    }
  }
}

}  // namespace

// A parameter steps only if it is trainable and laid out as such: one unfrozen after the layout was
// made (under ShardedDDP, between forward and step) had no reduced gradient and is not synced yet,
// so it waits for the next step; a frozen one does not move, even if it still holds a gradient from
// before it was frozen. A range of a parameter takes its part of the parameter's full gradient when
// there is one, else the reduced gradient handed to the store. Under mixed precision the stepped
// tensor is the fp32 master and takes its gradient upcast; on CUDA with the fused step, Adam/AdamW
// masters take it as reduced and write their parameter's range themselves (kernels/'s mixed
// step): no upcast copy, no write-back pass.
bool OSS::step_shard(std::optional<double> inv_scale, const detail::MasterRows& from_masters) {
  detail::FusedStepInputs in;
  in.allocate = [this](const at::Tensor& t, const char* kind) { return slabs_->fresh_slot(t, kind); };
  if (options_.state_format() == StateFormat::kInt8) {
    in.scales = [this](const at::Tensor& codes) { return slabs_->scales_of(codes); };
  }
  std::vector<std::pair<size_t, const detail::Holding*>> stepped;
  // Per optimizer: whether its masters may take the mixed CUDA kernel (Adam and AdamW).
  std::vector<uint8_t> mixed_kernel(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) mixed_kernel[u] = mixed_kernel_for(u);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!steps(i)) continue;
    const bool mixed_kernel_here = mixed_kernel[unit_of_group_[group_of_[i]]] != 0;
    for (const auto& h : holdings_[i]) {
      if (h.rank == group_->rank() && add_step_input(in, i, h, mixed_kernel_here)) stepped.emplace_back(i, &h);
    }
  }
  // Each optimizer steps fused where it can (Adam, AdamW and SGD), else with its own step().
  fused_.assign(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    fused_[u] = options_.fused_step() && detail::fused_step_unsupported(*units_[u].local, in).empty();
  }
  // Only an Adam or AdamW gives its masters to the mixed kernel; one that cannot step fused (a
  // tensor the fused step does not fit) makes every master step upcast, fused where it can.
  bool upcast = false;
  for (size_t u = 0; u < units_.size(); ++u) upcast |= mixed_kernel[u] && !fused_[u];
  if (!in.copies.empty() && upcast) {
    for (const auto& [i, h] : stepped) {
      const auto* key = h->tensor.unsafeGetTensorImpl();
      if (in.copies.erase(key) != 0) in.grads[key] = in.grads[key].to(at::kFloat);
    }
    for (size_t u = 0; u < units_.size(); ++u) {
      fused_[u] = options_.fused_step() && detail::fused_step_unsupported(*units_[u].local, in).empty();
    }
  }
  stepped_fused_ = std::all_of(fused_.begin(), fused_.end(), [](uint8_t f) { return f != 0; });
  // 8-bit state of an optimizer the fused step does not take (Muon, a registered one that marks
  // its state compressible): its own step runs on the state decoded to fp32, coded again after it.
  auto decoded_step = [&](size_t u) {
    return options_.state_format() == StateFormat::kInt8 && !units_[u].fused_kind && units_[u].codec &&
           !units_[u].codec->compressible.empty();
  };
  if (options_.state_format() != StateFormat::kFloat32 && !stepped_fused_) {
    for (size_t u = 0; u < units_.size(); ++u) {
      SHARDOPT_CHECK(fused_[u] || decoded_step(u), "OSSOptions::state_format(", state_format_name(options_.state_format()), ") on rank ",
                     group_->rank(), ": the fused step, which keeps the state in that format, cannot step ",
                     units_[u].class_name, " now: ", detail::fused_step_unsupported(*units_[u].local, in));
    }
  }
  if (inv_scale && !scale_in_step(in, *inv_scale)) return false;
  fused_segments_ = 0;
  if (stepped_fused_ && group_->size() > 1) return step_by_bucket(in, stepped, from_masters);
  const int64_t began = timeline::now_us();
  struct Recorded {  // the whole shard's step on the timeline, however it ends
    int64_t began;
    int rank;
    ~Recorded() { timeline::record(timeline::Lane::kStep, "step", rank, began, timeline::now_us()); }
  } recorded{began, group_->rank()};
  for (size_t u = 0; u < units_.size(); ++u) {
    if (fused_[u]) {
      const detail::FusedStepResult result = detail::fused_step(*units_[u].local, in);
      fused_segments_ += result.segments;
      if (!result.stepped) return false;  // the found-inf flag: the same for every optimizer
    } else if (decoded_step(u) && dynamic_cast<Muon*>(units_[u].local.get())) {
      step_one_tensor_at_a_time(*slabs_, *units_[u].local, *units_[u].codec, in.grads);  // (Note [8-bit state one tensor at a time])
    } else if (decoded_step(u)) {
      slabs_->widen(*units_[u].local, *units_[u].codec);
      {
        StepGradients with(*units_[u].local, in.grads);
        units_[u].local->step();
      }
      slabs_->adopt(*units_[u].local, *units_[u].codec);
    } else {
      StepGradients with(*units_[u].local, in.grads);
      units_[u].local->step();
    }
  }
  if (masters_) {
    for (const auto& [i, h] : stepped) write_back_master(i, *h, in, from_masters);
  }
  return true;
}

bool OSS::mixed_kernel_for(size_t unit) const {
  return mixed_ && options_.fused_step() && detail::cuda_kernels_built() && detail::adam_like(*units_[unit].local);
}

bool OSS::add_step_input(detail::FusedStepInputs& in, size_t i, const detail::Holding& h, bool mixed_kernel_here) const {
  at::Tensor grad = holding_grad(i, h);
  if (!grad.defined()) return false;
  if (mixed_kernel_here && h.tensor.is_cuda() && grad.is_contiguous() && params_[i].is_contiguous()) {
    in.copies[h.tensor.unsafeGetTensorImpl()] = params_[i].detach().view(-1).narrow(0, h.in_param.begin, h.in_param.size());
  } else if (grad.scalar_type() != h.tensor.scalar_type()) {
    grad = grad.to(h.tensor.scalar_type());
  }
  in.grads[h.tensor.unsafeGetTensorImpl()] = std::move(grad);
  return true;
}

// A stepped master's parameter range, unless the mixed kernel wrote it (`in.copies`) or the sync
// packs it from the master (Note [Syncing from the masters]).
void OSS::write_back_master(size_t i, const detail::Holding& h, const detail::FusedStepInputs& in,
                            const detail::MasterRows& from_masters) {
  const auto* key = h.tensor.unsafeGetTensorImpl();
  if (in.copies.count(key) == 0 && from_masters.covered.count(key) == 0) detail::write_back(params_[i], h.tensor, h.in_param);
}

// Note [A step per bucket]
// Where every optimizer of the OSS steps fused (Adam, AdamW, SGD) and there is a sync to start
// (more than one rank), it steps its holdings bucket by bucket, in the order the parameter sync
// sends the buckets (the last first: the next forward needs the first layers first,
// Note [Overlapped parameter sync]), and starts each bucket's sync
// (a row bucket's all-gather; a bucket of whole parameters' broadcast from its owner) as soon as
// the holdings in it are stepped, while it steps the next: the sync no longer waits for the
// whole step. Every rank starts every bucket, in that order, whether it holds anything in it or
// not. A holding that lies in several buckets is stepped before the first of them goes. Under
// ParamSync::kAllgather, buffers of whole parameters go in one all-gather each: their holdings
// are stepped last and go with the rest of the sync after the step (ShardStore::sync_after_step).
// The fused step updates each element from its own state and gradient alone, so which call
// steps it does not change a bit; only the segments (Note [Adjacent tensors in one pass]) end at
// the buckets' edges. A step the gradient scaler skips is skipped at the first bucket, on every
// rank, before any of them went.
namespace {

// For each layout bucket, the indices into `stepped` of the holdings stepped before that bucket's
// sync starts; one list more, last, for those in no bucket that syncs on its own (a bucket of
// whole parameters goes on its own under `broadcast`, else with its flat buffer).
std::vector<std::vector<size_t>> holdings_by_bucket(const FlatLayout& layout,
                                                    const std::vector<std::pair<size_t, const detail::Holding*>>& stepped,
                                                    int rank, bool broadcast) {
  const auto& buckets = layout.buckets();
  std::vector<std::vector<size_t>> out(buckets.size() + 1);
  for (size_t s = 0; s < stepped.size(); ++s) {
    const auto& [i, h] = stepped[s];
    int64_t first = -1;  // the highest bucket index: the sync sends it first
    for (size_t k : layout.pieces_of(i)) {
      const Piece& piece = layout.pieces()[k];
      if (piece.owner != rank || piece.bucket < 0 || !(broadcast || buckets[piece.bucket].rows())) continue;
      if (piece.in_param.end <= h->in_param.begin || h->in_param.end <= piece.in_param.begin) continue;
      first = std::max(first, piece.bucket);
    }
    out[first < 0 ? buckets.size() : static_cast<size_t>(first)].push_back(s);
  }
  return out;
}

}  // namespace

bool OSS::step_by_bucket(const detail::FusedStepInputs& in,
                         const std::vector<std::pair<size_t, const detail::Holding*>>& stepped,
                         const detail::MasterRows& from_masters) {
  const FlatLayout& layout = store_->layout();
  const bool broadcast = options_.sync() == ParamSync::kBroadcast;
  const auto by_bucket = holdings_by_bucket(layout, stepped, group_->rank(), broadcast);
  const size_t rest = layout.buckets().size();
  auto step_these = [&](const std::vector<size_t>& these) {
    if (these.empty()) return true;
    detail::FusedStepInputs part;
    part.allocate = in.allocate;
    part.scales = in.scales;
    part.inv_scale = in.inv_scale;
    part.found_inf = in.found_inf;
    for (size_t s : these) {
      const auto* key = stepped[s].second->tensor.unsafeGetTensorImpl();
      part.grads.emplace(key, in.grads.at(key));
      if (auto it = in.copies.find(key); it != in.copies.end()) part.copies.emplace(key, it->second);
    }
    for (size_t u = 0; u < units_.size(); ++u) {
      const detail::FusedStepResult result = detail::fused_step(*units_[u].local, part);
      fused_segments_ += result.segments;
      if (!result.stepped) return false;  // the found-inf flag: the same for every optimizer and bucket
    }
    if (masters_) {
      for (size_t s : these) write_back_master(stepped[s].first, *stepped[s].second, part, from_masters);
    }
    return true;
  };
  bucket_steps_.clear();
  for (size_t k = rest; k-- > 0;) {
    if (!(broadcast || layout.buckets()[k].rows())) continue;
    const int64_t began = timeline::now_us();
    if (!step_these(by_bucket[k])) return false;
    timeline::record(timeline::Lane::kStep, "bucket " + std::to_string(k) + " step", group_->rank(), began, timeline::now_us());
    bucket_steps_.emplace_back('s', static_cast<int64_t>(k));
    store_->start_bucket_sync(k, from_masters.rows);
    if (store_->param_sync_in_flight()) bucket_steps_.emplace_back('g', static_cast<int64_t>(k));
  }
  return step_these(by_bucket[rest]);
}

// The gradient scaler's step (ShardedGradScaler::step without unscale_()): every rank checks the
// gradients it steps, all ranks agree on the flag, and the fused step unscales as it reads them
// and skips on the flag (Note [Unscaling in the step]). A step that cannot take the scale (the
// wrapped optimizer's own, or tensors the fused step does not fit) gets its gradients unscaled in
// place first, once the flag is known. Collective. Returns false when the step is skipped.
bool OSS::scale_in_step(detail::FusedStepInputs& in, double inv_scale) {
  CommPhase phase("gradient scaler (found-inf check)");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& [key, g] : in.grads) grads.push_back(g);
  const at::Device device = params_.empty() ? at::Device(at::kCPU) : params_.front().device();
  at::Tensor found = detail::found_non_finite(grads, device);
  // On a backend that takes the device's tensors (NCCL for CUDA), the flag never leaves it.
  if (global_group_->size() > 1) {
    if (found.is_cuda() && global_group_->backend() != "nccl") {
      at::Tensor host = found.to(at::kCPU);
      global_group_->allreduce(host, Reduction::kMax);
      found = host.to(device);
    } else {
      global_group_->allreduce(found, Reduction::kMax);
    }
  }
  if (stepped_fused_) {
    in.inv_scale = at::full({1}, inv_scale, found.options());
    in.found_inf = found;
    bool fits = true;
    for (const auto& unit : units_) fits &= detail::fused_step_unsupported(*unit.local, in).empty();
    if (fits) return true;
    stepped_fused_ = false;
    in.inv_scale = in.found_inf = at::Tensor();
  }
  if (found.item<float>() != 0) return false;
  for (auto& [key, g] : in.grads) g.mul_(inv_scale);
  return true;
}

}  // namespace shardopt

#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/comm/agree.h>
#include <shardopt/check.h>

#include "ddp/executor.h"
#include "optim/oss_for_ddp.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/nn/modules/embedding.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>

namespace shardopt {

namespace {

// Runs after AccumulateGrad has accumulated a parameter's gradient.
class GradReadyHook : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  void operator()(const torch::autograd::Variable&) override { fn_(); }

 private:
  std::function<void()> fn_;
};

}  // namespace

// ---- NoSync ------------------------------------------------------------------------------------

NoSync::NoSync(ShardedDDP& ddp) : ddp_(&ddp) {
  SHARDOPT_CHECK(!ddp.no_sync_, "no_sync() is already active on this ShardedDDP");
  ddp.no_sync_ = true;
}
NoSync::NoSync(NoSync&& other) noexcept : ddp_(other.ddp_) {
  other.ddp_ = nullptr;
}
NoSync::~NoSync() {
  if (ddp_) ddp_->no_sync_ = false;
}

NoSync ShardedDDP::no_sync() {
  return NoSync(*this);
}

// ---- construction --------------------------------------------------------------------------------

ShardedDDP::ShardedDDP(std::shared_ptr<torch::nn::Module> module, std::vector<OSS*> optimizers,
                       ShardedDDPOptions options, std::shared_ptr<torch::nn::AnyModule> callable)
    : module_(std::move(module)), callable_(std::move(callable)), optimizers_(std::move(optimizers)), options_(options) {
  SHARDOPT_CHECK(module_, "ShardedDDP needs a module, got null");
  check_optimizers();
  group_ = std::shared_ptr<ProcessGroup>(&optimizers_[0]->process_group(), [](ProcessGroup*) {});
  global_ = &optimizers_[0]->global_group();
  replica_ = detail::OssForDdp::replica_group(*optimizers_[0]);
  if (options_.step_in_backward() && group_->size() > 1) {
    std::vector<int> ranks(static_cast<size_t>(group_->size()));
    std::iota(ranks.begin(), ranks.end(), 0);
    reduce_group_ = group_->split(ranks);
  }
  collect_params();
  for (size_t m = 0; m < params_.size(); ++m) module_index_[params_[m].unsafeGetTensorImpl()] = m;
  refresh_owners();
  if (options_.sync_models_at_startup() && global_->size() > 1) {
    at::NoGradGuard no_grad;
    for (auto& p : params_) {
      at::Tensor data = p.detach();
      global_->broadcast(data, 0);
    }
    for (auto& b : module_->buffers()) global_->broadcast(b, 0);
  }
  auto mask = detail::trainable_mask(params_);
  detail::agree_on_mask(*global_, mask, /*exhaustive=*/true, [this](size_t i) { return name(i); });
  // What this ShardedDDP takes over from each optimizer's step, in one call: forward() checks the
  // trainable set (the step need not check it again), the buckets' cuts, and the overlapped sync.
  detail::HandOver hand_over;
  hand_over.checks_trainable = options_.auto_refresh_trainable();
  hand_over.overlap_param_sync = options_.overlap_param_sync();
  hand_over.step_in_backward = options_.step_in_backward();
  for (OSS* opt : optimizers_) {
    hand_over.bucket_bytes = options_.bucket_bytes_for(opt->global_group().size());
    stores_.push_back(&detail::OssForDdp::hand_over(*opt, hand_over));
  }
  for (size_t k = 0; k < optimizers_.size(); ++k) grad_slabs_.push_back(std::make_unique<detail::GradSlabs>());
  lay_out(mask);
  build();
}

void ShardedDDP::check_optimizers() {
  SHARDOPT_CHECK(!optimizers_.empty(), "ShardedDDP needs at least one OSS optimizer");
  SHARDOPT_CHECK(options_.reduce_bucket_bytes() >= 0, "reduce_bucket_bytes must be >= 0, got ",
                 options_.reduce_bucket_bytes());
  SHARDOPT_CHECK(options_.bucket_bytes_per_rank() >= 0, "bucket_bytes_per_rank must be >= 0, got ",
                 options_.bucket_bytes_per_rank());
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    SHARDOPT_CHECK(optimizers_[k], "ShardedDDP optimizer ", k, " is null");
    SHARDOPT_CHECK(&optimizers_[k]->global_group() == &optimizers_[0]->global_group() &&
                       optimizers_[k]->process_group().size() == optimizers_[0]->process_group().size(),
                   "ShardedDDP optimizers 0 and ", k, " use different process groups or shard_group_size");
  }
  for (OSS* opt : optimizers_) {
    const auto& mp = opt->options().mixed_precision();
    if (mp.enabled() && !input_dtype_) input_dtype_ = mp.param_dtype();
  }
  // The wire, agreed before any collective of the gradients: a rank on another wire would pair
  // transfers of other sizes with everyone's.
  const Wire wire = options_.gradient_wire();
  ProcessGroup& global = optimizers_[0]->global_group();
  // With step_in_backward, why this rank cannot step in the backward: 0 it can, 1 hierarchical
  // sharding, 2 auto_refresh_trainable off, 3 + k optimizer k does not take the fused step.
  int64_t cannot_step_in_backward = 0;
  if (options_.step_in_backward()) {
    if (detail::OssForDdp::replica_group(*optimizers_[0])) cannot_step_in_backward = 1;
    if (!options_.auto_refresh_trainable()) cannot_step_in_backward = 2;
    for (size_t k = 0; k < optimizers_.size() && cannot_step_in_backward == 0; ++k) {
      if (!optimizers_[k]->can_unscale_in_step()) cannot_step_in_backward = 3 + static_cast<int64_t>(k);
    }
  }
  const auto all = global.allgather_ints({static_cast<int64_t>(wire), int64_t{options_.error_feedback()},
                                          int64_t{options_.step_in_backward()}, cannot_step_in_backward});
  for (size_t r = 0; r < all.size(); ++r) {
    const int64_t why = all[r][3];
    SHARDOPT_CHECK(why != 1, "ShardedDDPOptions::step_in_backward with hierarchical sharding (OSSOptions::shard_group_size) "
                   "on ", global.describe_rank(static_cast<int>(r)), ": not supported, the step would wait for the "
                   "all-reduce across blocks; turn one of them off");
    SHARDOPT_CHECK(why != 2, "ShardedDDPOptions::step_in_backward needs auto_refresh_trainable on (", 
                   global.describe_rank(static_cast<int>(r)), " has it off): the step in the backward follows the "
                   "trainable set the forward agreed");
    SHARDOPT_CHECK(why < 3, "ShardedDDPOptions::step_in_backward needs every optimizer to take the fused step (Adam, AdamW "
                   "or SGD, with OSSOptions::fused_step on); on ", global.describe_rank(static_cast<int>(r)),
                   " optimizer ", why - 3, " does not");
  }
  for (size_t r = 1; r < all.size(); ++r) {
    SHARDOPT_CHECK(all[r][2] == all[0][2], "ShardedDDPOptions::step_in_backward differs between ranks: ",
                   global.describe_rank(0), " has ", all[0][2] ? "true" : "false", ", ",
                   global.describe_rank(static_cast<int>(r)), " has ", all[r][2] ? "true" : "false");
    SHARDOPT_CHECK(all[r][0] == all[0][0], "ShardedDDPOptions::gradient_wire differs between ranks: ",
                   global.describe_rank(0), " has ", wire_name(static_cast<Wire>(all[0][0])), ", ",
                   global.describe_rank(static_cast<int>(r)), " has ", wire_name(static_cast<Wire>(all[r][0])));
    SHARDOPT_CHECK(all[r][1] == all[0][1], "ShardedDDPOptions::error_feedback differs between ranks: ",
                   global.describe_rank(0), " has ", all[0][1] ? "true" : "false", ", ",
                   global.describe_rank(static_cast<int>(r)), " has ", all[r][1] ? "true" : "false");
  }
  SHARDOPT_CHECK(!options_.error_feedback() || wire != Wire::kExact, "ShardedDDPOptions::error_feedback(true) needs a "
                 "compressed gradient_wire (Wire::kBFloat16 or Wire::kInt8): the exact wire drops nothing to feed back");
  for (OSS* opt : optimizers_) {  // the optimizers' mixed precision is agreed between the ranks
    const auto& mp = opt->options().mixed_precision();
    SHARDOPT_CHECK(!(wire == Wire::kBFloat16 && mp.enabled() && mp.reduce_or_param_dtype() == at::kHalf),
                   "ShardedDDPOptions::gradient_wire(Wire::kBFloat16) with gradients reduced in Half "
                   "(MixedPrecision::reduce_dtype): rounding them to bf16 would lose precision without saving a "
                   "byte; use Wire::kExact, or reduce_dtype(kFloat)");
  }
}

namespace {

// Module positions of the parameters whose gradients are sparse: the weights of Embedding and
// EmbeddingBag modules made with sparse(true).
std::vector<int64_t> sparse_gradient_positions(const torch::nn::Module& module) {
  std::unordered_map<const void*, bool> sparse;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(m.get()); e && e->options.sparse()) {
      sparse[e->weight.unsafeGetTensorImpl()] = true;
    }
    if (const auto* e = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(m.get()); e && e->options.sparse()) {
      sparse[e->weight.unsafeGetTensorImpl()] = true;
    }
  }
  std::vector<int64_t> positions;
  int64_t position = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (sparse.count(p.unsafeGetTensorImpl())) positions.push_back(position);
    ++position;
  }
  return positions;
}

}  // namespace

void ShardedDDP::collect_params() {
  std::unordered_map<const void*, std::pair<size_t, size_t>> place;  // -> (optimizer, position)
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    const auto& ps = detail::OssForDdp::params(*optimizers_[k]);
    for (size_t i = 0; i < ps.size(); ++i) {
      auto [it, fresh] = place.emplace(ps[i].unsafeGetTensorImpl(), std::make_pair(k, i));
      SHARDOPT_CHECK(fresh, "ShardedDDP: parameter ", i, " of optimizer ", k, " is also parameter ", it->second.second,
                     " of optimizer ", it->second.first, "; give each parameter to one OSS only");
    }
  }
  std::unordered_map<const void*, size_t> ignored;  // -> position in ignored_parameters
  for (size_t i = 0; i < options_.ignored_parameters().size(); ++i) {
    ignored.emplace(options_.ignored_parameters()[i].unsafeGetTensorImpl(), i);
  }
  std::vector<int64_t> ignored_positions;  // module positions of the ignored parameters
  std::vector<std::string> all_names;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    auto it = place.find(impl);
    all_names.push_back(item.key());
    if (ignored.count(impl)) {
      SHARDOPT_CHECK(it == place.end(), "parameter '", item.key(), "' is in ignored_parameters and also in OSS ",
                     it->second.first, "; pass OSS only the parameters it should shard");
      ignored_positions.push_back(static_cast<int64_t>(all_names.size()) - 1);
      ignored.erase(impl);
      continue;
    }
    SHARDOPT_CHECK(it != place.end(), "parameter '", item.key(),
                   "' of the module is in none of the OSS optimizers given to ShardedDDP (list it in "
                   "ShardedDDPOptions::ignored_parameters to keep it out of ShardedDDP)");
    names_.push_back(item.key());
    params_.push_back(item.value());
    place_.push_back(it->second);
  }
  SHARDOPT_CHECK(ignored.empty(), "ShardedDDP: ignored parameter ", ignored.empty() ? 0 : ignored.begin()->second,
                 " (of ignored_parameters) is not a parameter of the module");
  const std::vector<int64_t> sparse = sparse_gradient_positions(*module_);
  Agreement("ShardedDDP")
      .field("the ignored parameters (module positions)", ignored_positions)
      .field("the parameters with sparse gradients (module positions)", sparse)
      .hint("every rank must pass the same module and ignored_parameters")
      .check(*global_);
  // Every rank has the same list now: all of them stop here alike.
  SHARDOPT_CHECK(sparse.empty(), "ShardedDDP: parameter '", sparse.empty() ? "" : all_names.at(sparse[0]),
                 "' gets sparse gradients (an Embedding or EmbeddingBag made with sparse(true)); ShardedDDP reduces "
                 "dense gradients and OSS keeps dense state: make it with sparse(false), or list it in "
                 "ShardedDDPOptions::ignored_parameters and keep it out of OSS");
  SHARDOPT_CHECK(!params_.empty(), "ShardedDDP: the module has no parameters");
}

void ShardedDDP::refresh_owners() {
  owner_.clear();
  for (const auto& [k, i] : place_) owner_.push_back(optimizers_[k]->owner(detail::OssForDdp::params(*optimizers_[k])[i]));
}

std::vector<uint8_t> ShardedDDP::mask_for(size_t k, const std::vector<uint8_t>& mask) const {
  // Parameters outside the module: their flags as they are now (they are not in the agreed mask).
  std::vector<uint8_t> flags = detail::trainable_mask(detail::OssForDdp::params(*optimizers_[k]));
  for (size_t m = 0; m < params_.size(); ++m) {
    if (place_[m].first == k) flags[place_[m].second] = mask[m];
  }
  return flags;
}

void ShardedDDP::lay_out(const std::vector<uint8_t>& mask) {
  for (size_t k = 0; k < optimizers_.size(); ++k) detail::OssForDdp::lay_out_for(*optimizers_[k], mask_for(k, mask));
}

bool ShardedDDP::built_trainable(size_t m) const {
  const auto& [k, i] = place_[m];
  return built_plans_[k]->trainable[i] != 0;
}

std::vector<uint8_t> ShardedDDP::built_mask() const {
  std::vector<uint8_t> mask(params_.size());
  for (size_t m = 0; m < params_.size(); ++m) mask[m] = built_trainable(m);
  return mask;
}

// After an agreed change of the trainable set, each optimizer may re-partition (Note [Rebalance
// after a freeze]), which lays its buffers out again for the new owners. Each optimizer knows
// whether its set changed since its partition was decided: otherwise this costs nothing.
void ShardedDDP::follow_partition() {
  for (OSS* opt : optimizers_) detail::OssForDdp::rebalance(*opt);
}

// Rebuilds the buckets when any optimizer has a new layout (its trainable set, owners or bucket
// cuts changed, by this ShardedDDP or by the optimizer's own step): its layout version moved
// since build().
void ShardedDDP::follow_layouts() {
  bool changed = false;
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    changed |= stores_[k]->plan_version() != built_plans_[k]->version;
  }
  if (!changed) return;
  const std::vector<int> before = owner_;
  refresh_owners();
  bool owners_changed = false;  // a re-partition (split ranges are cut anew, never re-partitioned)
  for (size_t m = 0; m < owner_.size(); ++m) {
    owners_changed |= detail::OssForDdp::kept_whole(*optimizers_[place_[m].first], place_[m].second) && owner_[m] != before[m];
  }
  build();
  // A re-partition gave each moved gradient to its new owner; the old one lets go of it, unless
  // it is a local gradient still waiting to be reduced (no_sync).
  if (owners_changed && phase_ != Phase::kAccumulating) {
    for (size_t m = 0; m < params_.size(); ++m) {
      if (owner_[m] != group_->rank()) params_[m].mutable_grad().reset();
    }
  }
}

ShardedDDP::~ShardedDDP() {
  remove_hooks();
  // The optimizers go on alone: their steps check the trainable set and sync in full again.
  for (detail::ShardStore* store : stores_) {
    try {
      store->take_back();
    } catch (const std::exception&) {
      // A failed sync was the last thing these optimizers did; not for a destructor to raise.
    }
  }
}

void ShardedDDP::remove_hooks() {
  for (auto& h : hooked_) {
    if (torch::autograd::impl::post_acc_grad_hooks(h.param)) {
      torch::autograd::impl::set_post_acc_grad_hooks(h.param, nullptr);
    }
    h.param.remove_hook(h.pre_hook);
  }
  hooked_.clear();
}

// Note [Bucket order]
// Gloo (and NCCL) need every rank to issue collectives in the same order. The buckets are those
// of each optimizer's FlatLayout: trainable parameters in reverse order (roughly the order
// backward produces their gradients), one open bucket per (owner, device, dtype), closed before
// it would pass reduce_bucket_bytes. With several optimizers, their buckets are merged by the
// latest module position each holds. They are launched strictly in that order: a bucket that
// fills early waits for the ones before it. Every rank computes the same layouts from the same
// parameters, so the order is identical everywhere, whatever order the hooks fire in.
namespace {

// A layout bucket of one optimizer, with the latest module position it holds (-1: none).
struct BucketSource {
  size_t optimizer, bucket;
  int64_t position;
};

}  // namespace

void ShardedDDP::build() {
  remove_hooks();
  entries_.clear();
  buckets_.clear();
  hooked_index_.clear();
  next_launch_ = 0;
  next_step_ = 0;
  // The current plans; a new layout's owned buckets are carved anew at the next backward.
  built_plans_.resize(stores_.size());
  for (size_t k = 0; k < stores_.size(); ++k) {
    if (built_plans_[k] == stores_[k]->plan_ptr()) continue;
    built_plans_[k] = stores_[k]->plan_ptr();
    grad_slabs_[k]->reset(built_plans_[k]->layout, group_->rank());
  }
  std::vector<BucketSource> sources;
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    const auto& layout = built_plans_[k]->layout;
    const auto& ps = detail::OssForDdp::params(*optimizers_[k]);
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      int64_t position = -1;
      for (size_t piece : layout.buckets()[b].pieces) {
        auto it = module_index_.find(ps[layout.pieces()[piece].param].unsafeGetTensorImpl());
        if (it != module_index_.end()) position = std::max(position, static_cast<int64_t>(it->second));
      }
      sources.push_back({k, b, position});
    }
  }
  if (optimizers_.size() > 1) {
    std::stable_sort(sources.begin(), sources.end(),
                     [](const BucketSource& a, const BucketSource& b) { return a.position > b.position; });
  }
  for (const auto& src : sources) add_bucket(src.optimizer, src.bucket);
  for (size_t h = 0; h < hooked_.size(); ++h) {
    torch::autograd::impl::set_post_acc_grad_hooks(hooked_[h].param,
                                                   std::make_unique<GradReadyHook>([this, h] { on_grad_ready(h); }));
    hooked_[h].pre_hook = hooked_[h].param.register_hook([this, h](const at::Tensor&) { before_accumulation(h); });
  }
  has_split_pieces_ = std::any_of(entries_.begin(), entries_.end(), [](const Entry& e) { return !e.whole; });
  ++rebuilds_;
}

void ShardedDDP::add_bucket(size_t k_opt, size_t index) {
  OSS& optimizer = *optimizers_[k_opt];
  const auto& layout = built_plans_[k_opt]->layout;
  const auto& ps = detail::OssForDdp::params(optimizer);
  const FlatBucket& lb = layout.buckets()[index];
  const FlatGroup& group = layout.groups()[lb.group];
  const int rank = group_->rank();
  Bucket b;
  b.optimizer = &optimizer;
  b.optimizer_index = k_opt;
  b.store = stores_[k_opt];
  b.slabs = grad_slabs_[k_opt].get();
  b.index = index;
  b.owner = lb.owner;
  b.numel = lb.numel();
  // One owner: the gradients then one flag per entry. A row bucket: one such row per rank, each
  // with room for the most pieces a row holds.
  b.stride = b.numel + lb.owned_pieces();
  b.row_used = lb.row_used;
  // Mixed precision reduces in reduce_dtype: an fp32 bucket upcasts each gradient as it is copied in.
  const auto& mp = optimizer.options().mixed_precision();
  b.options = at::TensorOptions().dtype(mp.enabled() ? mp.reduce_or_param_dtype() : group.dtype).device(group.device);
  std::vector<int64_t> in_row(static_cast<size_t>(layout.world_size()), 0);  // pieces placed per row so far
  for (size_t k = 0; k < lb.pieces.size(); ++k) {
    const size_t piece_index = lb.pieces[k];
    const Piece& piece = layout.pieces()[piece_index];
    const at::Tensor& param = ps[piece.param];
    auto [it, fresh] = hooked_index_.try_emplace(param.unsafeGetTensorImpl(), hooked_.size());
    if (fresh) hooked_.push_back(Hooked{param, {}});
    hooked_[it->second].entries.push_back(entries_.size());
    Entry e;
    e.hooked = it->second;
    e.in_param = piece.in_param;
    e.whole = piece.in_param.begin == 0 && piece.in_param.size() == param.numel();
    // A whole parameter's reduced gradient is the parameter's own, as under DDP (under mixed
    // precision the tensor OSS steps is its master, which takes the gradient at the step).
    e.owned = piece.owner == rank;
    if (e.owned && e.whole) e.whole_param = param;
    if (e.owned && !e.whole) e.store = b.store;
    e.param = piece.param;
    e.shape = {piece.in_param.size()};
    e.bucket = buckets_.size();
    // Where its row begins in the reduce buffer (0 with one owner), and its slot in the row: up
    // to the next piece of the same row, or the row's end.
    const int64_t row = b.rows() ? piece.owner * b.stride : 0;
    const bool last_in_row =
        k + 1 == lb.pieces.size() || layout.pieces()[lb.pieces[k + 1]].owner != piece.owner;
    const int64_t next = last_in_row ? b.numel : layout.pieces()[lb.pieces[k + 1]].in_bucket.begin;
    const int64_t nth = in_row[static_cast<size_t>(piece.owner)]++;
    if (nth == 0 && piece.in_bucket.begin > 0) b.zero_fill = true;  // a gap at the row's start
    e.offset = row + piece.in_bucket.begin;
    e.out_offset = piece.in_bucket.begin;
    e.numel = piece.in_bucket.size();
    e.slot_end = row + next;
    e.flag = row + b.numel + nth;
    TORCH_INTERNAL_ASSERT(e.offset >= row && e.offset + e.numel <= e.slot_end && e.slot_end <= row + b.numel,
                          "gradient slot [", e.offset, ", ", e.slot_end, ") outside its row of ", b.numel);
    if (e.owned) b.owned.push_back(entries_.size());
    b.entries.push_back(entries_.size());
    entries_.push_back(std::move(e));
  }
  if (b.rows()) {
    for (int64_t n : in_row) b.zero_fill = b.zero_fill || n == 0;  // a row with nothing in it
  }
  b.pending = b.entries.size();
  buckets_.push_back(std::move(b));
}

// ---- forward ------------------------------------------------------------------------------------

void ShardedDDP::pre_forward(bool finish_sync) {
  CommPhase phase("forward (trainability check, buffers)");
  // A backward that raised after its first gradient left its buckets half reduced: going on would
  // pair this rank's next collectives with the wrong ones elsewhere.
  SHARDOPT_CHECK(phase_ != Phase::kReducing, "the last backward on this rank raised an error after gradients had started to "
                 "reduce; ShardedDDP's reductions are incomplete and it cannot go on (start again from a "
                 "checkpoint)");
  drop_bucket_views();  // a backward that ended early took its decision along
  if (options_.auto_refresh_trainable()) {
    await_mask_check();  // from here on the built mask is known to be the same on every rank
    follow_partition();
    auto mask = detail::trainable_mask(params_);
    SHARDOPT_CHECK(phase_ != Phase::kAccumulating || mask == built_mask(), "the trainable set changed while "
                   "no_sync() gradients are waiting to be reduced; call reduce() (or run a backward outside no_sync) "
                   "first");
    lay_out(mask);  // no-op unless a trainable set changed (the module's or an optimizer's other parameters)
    follow_layouts();
    start_mask_check();
  } else {
    follow_layouts();  // each OSS checks, lays out and re-partitions in its step
  }
  if (options_.broadcast_buffers() && global_->size() > 1) {
    at::NoGradGuard no_grad;
    for (auto& b : module_->buffers()) global_->broadcast(b, 0);
  }
  if (finish_sync) finish_param_sync();
}

void ShardedDDP::wait_param_sync(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    auto it = module_index_.find(p.unsafeGetTensorImpl());
    if (it == module_index_.end()) continue;  // not one of ours (ignored, or another module's)
    const auto& [k, i] = place_[it->second];
    detail::OssForDdp::finish_param_sync(*optimizers_[k], i);
  }
}

void ShardedDDP::finish_param_sync() {
  for (OSS* opt : optimizers_) opt->finish_param_sync();
}

// Note [Overlapped trainability check]
// Each forward() starts an all-reduce of (h, -h) under MAX, h a hash of the trainable mask the
// buckets were built for; max(h) == -max(-h) exactly when all ranks agree. Backward waits for it
// before its first reduction, so the check costs no time beside the forward; on disagreement
// every rank, at the same point, all-gathers the masks and raises an error naming the parameter.
void ShardedDDP::start_mask_check() {
  CommPhase phase("forward (trainability check)");
  if (global_->size() == 1) return;
  // With the optimizers' options (Note [Optimizers agree across ranks] in csrc/optim/options_agreement.cpp).
  uint64_t h = detail::mask_agreement(built_mask(), [this](size_t i) { return name(i); }).hash();
  for (const OSS* opt : optimizers_) h = (h ^ detail::OssForDdp::options_hash(*opt)) * 1099511628211ull;
  const auto v = static_cast<int64_t>(h >> 1);
  mask_check_buffer_ = at::tensor({v, -v}, at::kLong);
  mask_check_ = global_->allreduce_async(mask_check_buffer_, Reduction::kMax);
}

void ShardedDDP::await_mask_check() {
  if (!mask_check_.valid()) return;
  mask_check_.wait();
  const int64_t* check = mask_check_buffer_.data_ptr<int64_t>();
  if (check[0] == -check[1]) return;
  // The buckets are still those the check was started for: they are built again only after it.
  detail::agree_on_mask(*global_, built_mask(), /*exhaustive=*/true, [this](size_t i) { return name(i); });
  for (const OSS* opt : optimizers_) detail::OssForDdp::check_options_alike(*opt);
}

void ShardedDDP::refresh_trainable() {
  await_mask_check();
  SHARDOPT_CHECK(phase_ != Phase::kAccumulating, "refresh_trainable() while no_sync() gradients are waiting to be "
              "reduced; call reduce() (or run a backward outside no_sync) first");
  auto mask = detail::trainable_mask(params_);
  detail::agree_on_mask(*global_, mask, /*exhaustive=*/false, [this](size_t i) { return name(i); });
  lay_out(mask);
  follow_partition();
  follow_layouts();
}

void ShardedDDP::zero_grad(bool set_to_none) {
  if (phase_ != Phase::kReducing) drop_bucket_views();
  // Every module parameter ShardedDDP handles is in one of the optimizers, which clear the
  // owners' pieces too and note what they zeroed (Note [Gradients as bucket views]).
  for (OSS* opt : optimizers_) opt->zero_grad(set_to_none);
}

std::string ShardedDDP::name(size_t param) const {
  return "parameter '" + names_[param] + "'";
}

size_t ShardedDDP::num_buckets() const {
  return buckets_.size();
}

int64_t ShardedDDP::local_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : params_) {
    if (p.grad().defined()) bytes += static_cast<int64_t>(p.grad().nbytes());
  }
  for (const auto& e : entries_) {  // pieces of split parameters this rank owns
    if (!e.whole && e.owned && e.grad().defined()) bytes += static_cast<int64_t>(e.grad().nbytes());
  }
  return bytes;
}

int64_t ShardedDDP::error_feedback_bytes() const {
  int64_t bytes = 0;
  for (const Bucket& b : buckets_) bytes += b.residual.defined() ? static_cast<int64_t>(b.residual.nbytes()) : 0;
  return bytes;
}

int64_t ShardedDDP::local_bucket_bytes() const {
  int64_t bytes = 0;
  for (const auto& slabs : grad_slabs_) bytes += slabs->bytes();
  return bytes;
}

}  // namespace shardopt

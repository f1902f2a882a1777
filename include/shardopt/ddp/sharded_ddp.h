// ShardedDDP: gradient sharding (ZeRO stage 2) on top of OSS.
//
// During backward, a hook after each parameter's gradient accumulation copies the gradient into
// its bucket (bucket_bytes_for(): at least reduce_bucket_bytes, growing with the world size). The
// buckets are those of each OSS's FlatLayout (shardopt/optim/flat_layout.h), the map that also
// places the parameters. A split optimizer's buckets are row buckets (Note [Row buckets]): one row
// per rank, and a full bucket is reduce-scattered, each rank receiving the sum of its row. A
// bucket of whole parameters is a range of its owner's shard, reduced to that owner. Either starts
// at once, in an order identical on every rank (Note [Bucket order]), overlapping the rest of
// backward. The end of backward flushes the remaining buckets and waits. Afterwards a rank holds
// gradients only for what it owns; OSS::step() then updates the owned shard and makes every copy
// current (one all-gather per row bucket).
//
//   auto group = shardopt::init_process_group();
//   shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::Adam>(...), group);
//   shardopt::ShardedDDP ddp(model, opt);
//   auto loss = loss_fn(ddp.forward(x), y);   // forward() notices freezing/unfreezing
//   loss.backward();                          // gradients reduced to their owners
//   opt.step();
//
// Trainability: with auto_refresh_trainable, every forward() rebuilds buckets and hooks when the
// local trainable set changed, and starts a 16-byte all-reduce that checks all ranks have the
// same set; backward waits for it before its first reduction (the check overlaps the forward),
// and ranks that disagree all get an error naming the parameter. Once the new set is agreed
// on (at the next forward()), each OSS may re-partition to balance the trainable work (see
// OSSOptions::rebalance) and the buckets follow the new owners; a frozen parameter's optimizer
// state is kept for when it is unfrozen.
//
// Mixed precision (OSSOptions::mixed_precision): gradients are reduced in its reduce_dtype, and
// forward() casts floating-point tensor arguments to its param_dtype.
//
// forward() calls the module's own forward: through torch::nn::AnyModule for a (non-template)
// forward method, directly for a torch::nn::Sequential (any arguments), and as Tensor(Tensor) for
// another module whose forward is a template that takes one tensor. For any other module
// forward() is an error naming pre_forward(): call pre_forward() and then the module.
#pragma once

#include <shardopt/check.h>
#include <shardopt/comm/process_group.h>
#include <shardopt/comm/wire.h>
#include <shardopt/optim/oss.h>

#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/detail/static.h>
#include <torch/csrc/api/include/torch/nn/modules/container/any.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace shardopt {

enum class GradScaling {
  kMean,           // divide the summed gradient by the world size, like DDP
  kSum,            // keep the sum over ranks
  kGlobalSamples,  // divide by set_global_samples(): each rank's loss is a sum over its real samples
};

struct ShardedDDPOptions {
  // Buckets hold up to bucket_bytes_for(world size) bytes of gradients: the larger of
  // reduce_bucket_bytes and bucket_bytes_per_rank times the data-parallel world size (the whole
  // group, also under hierarchical sharding), so that the collectives per step stay few as the
  // world grows (Megatron-Core's rule is max(40M, 1M x data-parallel size) elements).
  // reduce_bucket_bytes 0: one bucket per parameter (whole parameters) or per group (row buckets).
  int64_t bucket_bytes_for(int world_size) const {
    if (reduce_bucket_bytes_ == 0) return 0;
    return std::max(reduce_bucket_bytes_, bucket_bytes_per_rank_ * world_size);
  }
  TORCH_ARG(int64_t, reduce_bucket_bytes) = 8 << 20;
  TORCH_ARG(int64_t, bucket_bytes_per_rank) = 1 << 20;
  TORCH_ARG(bool, auto_refresh_trainable) = true;
  TORCH_ARG(bool, broadcast_buffers) = true;
  TORCH_ARG(bool, sync_models_at_startup) = true;
  TORCH_ARG(GradScaling, grad_scaling) = GradScaling::kMean;
  // Parameters of the module ShardedDDP leaves to the user (a row-sharded embedding table with
  // its own exchange, say): never reduced, bucketed, freed, synced at start-up or checked for
  // trainability; their gradients stay this rank's local ones. They must not be in any of its
  // OSS optimizers, and every rank must list the same module parameters.
  TORCH_ARG(std::vector<at::Tensor>, ignored_parameters) = {};
  // The parameter sync after OSS::step() runs beside the next forward (Note [Overlapped
  // parameter sync] in csrc/optim/param_buffers.cpp): forward() of a Sequential waits before each child
  // for that child's parameters only; other modules wait in pre_forward(), or, after
  // pre_forward(false), where their forward calls wait_param_sync(params). Parameters read
  // between step() and the next forward need
  // finish_param_sync() first. Off by default.
  TORCH_ARG(bool, overlap_param_sync) = false;
  // Gradients zeroed in place (OSS's or ShardedDDP's zero_grad(false)) stay where the last
  // reduction left them, in their owner's bucket, and the next backward accumulates into them
  // there: no copy into the bucket, no second bucket, for the gradients this rank owns (Note
  // [Gradients as bucket views] in csrc/ddp/bucket_views.cpp). Other clearing styles copy, as
  // without it; results are the same either way.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  // How each rank's gradients travel to their owners (Note [Gradient wire] in
  // csrc/comm/wire.cpp): kExact (as they are, the default) or kBFloat16 (rounded to bf16, summed
  // in fp32 by the owner on Gloo, half the bytes) or kInt8 (blocks of 256 with an fp32 scale each,
  // dequantised and summed in fp32 by the owner, about a quarter of the bytes: Note [Int8 wire];
  // on NCCL through one all-to-all or gather per bucket). Every rank must pass the same.
  TORCH_ARG(Wire, gradient_wire) = Wire::kExact;
  // With a compressed gradient_wire: each rank keeps what rounding dropped from its own
  // contribution to every bucket (a bf16 residual per element it sends, outside the 1/W of
  // local_grad_bytes(): error_feedback_bytes()) and adds it to the next reduction's contribution,
  // so over many steps the rounding errors cancel instead of adding up (Note [Error feedback] in
  // csrc/ddp/reduction.cpp). Needs a compressed wire; every rank must pass the same.
  TORCH_ARG(bool, error_feedback) = false;
  // The optimizer in the backward: each bucket's optimizer step runs during the backward, as soon
  // as that bucket's reduction has completed, and its parameter sync starts at once, so the
  // syncs travel beside the rest of the backward (Note [A step in the backward] in
  // csrc/ddp/step_in_backward.cpp). OSS::step() after the backward then only finishes the sync;
  // the parameters equal those of the step after the backward, bit for bit. Nothing may need the
  // whole gradient before the step: OSS::clip_grad_norm and ShardedGradScaler are refused, and
  // edits of the gradients between backward and step come too late. Each backward outside no_sync()
  // steps once, with its own gradients and what no_sync() accumulated before it; a gradient left
  // uncleared since the last step is replaced, not added to, and a second backward before step()
  // is refused. Needs every optimizer to take the fused step (Adam, AdamW or SGD) and no
  // shard_group_size; the reductions then go on a group of their own, split from the optimizers'.
  // Every rank must pass the same. Off by default.
  TORCH_ARG(bool, step_in_backward) = false;
};

class ShardedDDP;
namespace detail {
struct ErrorFeedbackState;  // checkpoints' access to the residuals (csrc/ddp/error_feedback_state.h)
class GradSlabs;            // the memory of the owned buckets (csrc/ddp/grad_slabs.h)
}

// While alive, backward accumulates gradients locally (no communication).
class NoSync {
 public:
  explicit NoSync(ShardedDDP& ddp);
  ~NoSync();
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  NoSync(NoSync&& other) noexcept;

 private:
  ShardedDDP* ddp_;
};

class ShardedDDP {
 public:
  template <class M>
  ShardedDDP(std::shared_ptr<M> module, OSS& optimizer, ShardedDDPOptions options = {})
      : ShardedDDP(module, std::vector<OSS*>{&optimizer}, options) {}

  // A module holder (torch::nn::Sequential, Linear, a TORCH_MODULE of the user's): its module.
  template <class M>
  ShardedDDP(const torch::nn::ModuleHolder<M>& module, OSS& optimizer, ShardedDDPOptions options = {})
      : ShardedDDP(module.ptr(), optimizer, options) {}
  template <class M>
  ShardedDDP(const torch::nn::ModuleHolder<M>& module, std::vector<OSS*> optimizers, ShardedDDPOptions options = {})
      : ShardedDDP(module.ptr(), std::move(optimizers), options) {}

  template <class M>
  ShardedDDP(std::shared_ptr<M> module, std::vector<OSS*> optimizers, ShardedDDPOptions options = {})
      : ShardedDDP(std::static_pointer_cast<torch::nn::Module>(module), std::move(optimizers), options,
                   make_any(module)) {}

  ShardedDDP(std::shared_ptr<torch::nn::Module> module, std::vector<OSS*> optimizers, ShardedDDPOptions options,
             std::shared_ptr<torch::nn::AnyModule> callable);
  ~ShardedDDP();
  ShardedDDP(const ShardedDDP&) = delete;
  ShardedDDP& operator=(const ShardedDDP&) = delete;

  template <class R = torch::Tensor, class... Args>
  R forward(Args&&... args) {
    if (!callable_) {
      // Sequential's forward is a template, which AnyModule cannot hold: call it directly.
      if (auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_)) {
        if (!options_.overlap_param_sync() || sequential->is_empty()) {
          pre_forward();
          return sequential->forward<R>(cast_input(std::forward<Args>(args))...);
        }
        // Sequential::forward, child by child, each after its own parameters arrived.
        pre_forward(/*finish_sync=*/false);
        auto it = sequential->begin();
        wait_param_sync(it->ptr()->parameters());
        torch::nn::AnyValue value = it->any_forward(cast_input(std::forward<Args>(args))...);
        for (++it; it != sequential->end(); ++it) {
          wait_param_sync(it->ptr()->parameters());
          value = it->any_forward(std::move(value));
        }
        finish_param_sync();  // parameters of no child (registered on the Sequential itself)
        if (auto* result = value.try_get<R>()) return std::move(*result);
        SHARDOPT_CHECK(false, "ShardedDDP::forward: the Sequential's last module returned another type than the one "
                       "asked for");
      }
    }
    SHARDOPT_CHECK(callable_, "ShardedDDP::forward needs a module with a (non-template) forward() method, a "
                   "Sequential, or a template forward that takes one tensor; for this module call pre_forward() "
                   "and then the module yourself");
    pre_forward();
    return callable_->forward<R>(cast_input(std::forward<Args>(args))...);
  }

  // What forward() does before calling the module: trainability check (and rebuild), buffer
  // broadcast, and (overlap_param_sync) waiting for the whole parameter sync, unless
  // `finish_sync` is false: then the module's forward calls wait_param_sync() before using each
  // part of its parameters. Collective.
  void pre_forward(bool finish_sync = true);
  // overlap_param_sync: waits for the sync of these parameters only (a module's forward calls it
  // before using them), or of all parameters. Local.
  void wait_param_sync(const std::vector<at::Tensor>& params);
  void finish_param_sync();
  void zero_grad(bool set_to_none = true);
  // Agrees across ranks on the trainable set and rebuilds buckets and hooks. Collective.
  void refresh_trainable();
  NoSync no_sync();
  // Reduces what no_sync() accumulated, now. Collective.
  void reduce();
  // For kGlobalSamples: the number of real samples in this global step, before backward.
  void set_global_samples(int64_t real_samples);
  std::shared_ptr<torch::nn::Module> module() const { return module_; }

  // ---- introspection ----
  // Bytes of gradients this rank holds now.
  int64_t local_grad_bytes() const;
  // Bytes of the gradient memory this rank keeps between backward passes: one slab per layout
  // group, carved into the buckets it owns (their gradients, one count per piece, alignment).
  int64_t local_bucket_bytes() const;
  // Bytes of reduce scratch this rank keeps between backward passes for the next one: at most
  // four buckets' worth, whatever the model's size (Note [Reduce scratch] in
  // csrc/ddp/reduce_scratch.cpp).
  int64_t reduce_scratch_bytes() const;
  size_t num_buckets() const;
  int64_t rebuild_count() const { return rebuilds_; }
  // Bytes of error feedback's residuals this rank keeps (0 without error_feedback, or before the
  // first reduction).
  int64_t error_feedback_bytes() const;

 private:
  friend class NoSync;
  friend struct testing::Introspection;
  friend struct detail::ErrorFeedbackState;
  struct Entry;
  struct Bucket;
  struct Hooked;

  // Calls a module whose forward is a template with one tensor, for AnyModule (which holds only
  // modules with a non-template forward). Holds the module without registering it: the
  // parameters stay the wrapped module's.
  template <class M>
  struct TensorForward : torch::nn::Module {
    explicit TensorForward(std::shared_ptr<M> m) : module(std::move(m)) {}
    at::Tensor forward(at::Tensor x) { return module->forward(std::move(x)); }
    std::shared_ptr<M> module;
  };
  template <class M, class = void>
  struct ForwardsTensor : std::false_type {};
  template <class M>
  struct ForwardsTensor<M, std::void_t<decltype(at::Tensor(std::declval<M&>().forward(std::declval<at::Tensor>())))>>
      : std::true_type {};

  template <class M>
  static std::shared_ptr<torch::nn::AnyModule> make_any(const std::shared_ptr<M>& module) {
    if constexpr (torch::detail::has_forward<M>::value) {
      return std::make_shared<torch::nn::AnyModule>(module);
    } else if constexpr (!std::is_base_of_v<torch::nn::SequentialImpl, M> && ForwardsTensor<M>::value) {
      return std::make_shared<torch::nn::AnyModule>(std::make_shared<TensorForward<M>>(module));
    } else {
      return nullptr;
    }
  }

  // Under mixed precision, a floating-point tensor argument of forward() in param_dtype;
  // anything else as it is.
  template <class T>
  decltype(auto) cast_input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      if (input_dtype_ && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *input_dtype_) {
        return at::Tensor(arg.to(*input_dtype_));
      }
      return at::Tensor(std::forward<T>(arg));
    } else {
      return std::forward<T>(arg);
    }
  }

  // The constructor's steps: the optimizers and options; the module's parameters and where each
  // lives (ignored ones and sparse gradients checked on every rank).
  void check_optimizers();
  void collect_params();
  // Buckets, entries and hooks from the optimizers' layouts.
  void build();
  // Appends the executor's bucket and entries for bucket `index` of optimizer k's layout.
  void add_bucket(size_t k, size_t index);
  void refresh_owners();
  // The trainable flags of optimizer k's parameters: `mask`'s (module order) for the module's,
  // their own otherwise.
  std::vector<uint8_t> mask_for(size_t k, const std::vector<uint8_t>& mask) const;
  // Has every optimizer lay its buffers out for `mask` (module order).
  void lay_out(const std::vector<uint8_t>& mask);
  // The trainable set the buckets were built for (module order), read from the plans they were
  // built on: module parameter m's flag, and all of them.
  bool built_trainable(size_t m) const;
  std::vector<uint8_t> built_mask() const;
  // After an agreed change of the trainable set, each optimizer may re-partition.
  void follow_partition();
  void follow_layouts();
  void remove_hooks();
  void on_grad_ready(size_t hooked);
  void launch_ready_buckets();
  void finish_reduction();
  // Copies parameter hooked_[h]'s gradient into its slots (or zeroes them) and releases it.
  void fill_param(size_t hooked);
  void release_local_grad(Hooked& hooked, const Entry* owned);
  at::Tensor bucket_buffer(Bucket& bucket);  // allocated (or reused) at its first gradient
  at::Tensor owned_memory(Bucket& bucket);   // where the owner's reduced gradients live
  // Reduce scratch (Note [Reduce scratch] in csrc/ddp/reduce_scratch.cpp): memory for a bucket that
  // this rank sends from and receives into, taken from what earlier buckets gave back.
  at::Tensor take_scratch(Bucket& bucket, int64_t elements);
  bool recycle_oldest_launched();  // waits for it; false when no launched bucket holds scratch
  void give_back_scratch(Bucket& bucket);
  void write_flags(Bucket& bucket);          // this rank's flags, before the reduction
  // Error feedback: this rank's contribution plus the last residual, rounded to `wire`; the new
  // residual is what the rounding dropped.
  void feed_back_error(Bucket& bucket, at::ScalarType wire);
  // The buckets' layout as the residuals follow it (one number per fact), and taking the
  // residuals a checkpoint restored where it is the one they were saved for.
  at::Tensor residual_layout() const;
  void adopt_restored_residuals();
  // Sets aside an owner's gradient that the last reduction handed over (a hook of hooked_[h]).
  void before_accumulation(size_t hooked);
  // At the first gradient of a backward: which owned buckets it accumulates into in place.
  void decide_bucket_views();
  void decide_bucket_view(Bucket& bucket);
  // Forgets that decision where no reduction is under way (a backward that reduced nothing).
  void drop_bucket_views();
  bool is_handed_over(const Entry& entry) const;
  at::Tensor clearing_evidence() const;
  // Divides the owned buckets and makes them the owners' gradients.
  void hand_over_reduced();
  // The reduced gradients of one bucket's owned entries to their owners (`any` per entry: some
  // rank had a gradient for it); both hand-overs end here.
  void give_reduced(Entry& entry, const Bucket& bucket, bool any);
  // The step in the backward (step_in_backward.cpp): the optimizers' steps begun at the first
  // gradient, each completed bucket handed over and stepped (all of them, waiting, with `wait`),
  // and the steps' end once the backward's buckets are all reduced.
  void begin_backward_steps();
  void step_reduced_buckets(bool wait);
  void hand_over_bucket(Bucket& bucket);
  void end_backward_steps();
  ProcessGroup& reducer() { return reduce_group_ ? *reduce_group_ : *group_; }
  // Why the finished reduction must not be handed over, or "".
  std::string reduction_error(bool ambiguous) const;
  // Makes the buckets and entries ready for the next backward.
  void reset_executor();
  // What the owners divide reduced gradients by (grad_scaling; 1 for none).
  double grad_divisor() const;
  void start_mask_check();
  void await_mask_check();
  std::string name(size_t param) const;  // "parameter 'fc.weight'", for messages

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<torch::nn::AnyModule> callable_;
  std::vector<OSS*> optimizers_;
  std::vector<detail::ShardStore*> stores_;  // each optimizer's, from its hand_over()
  // Per optimizer: the memory of the buckets this rank owns in its layout (Note [Gradient slab]).
  std::vector<std::unique_ptr<detail::GradSlabs>> grad_slabs_;
  std::shared_ptr<ProcessGroup> group_;  // the optimizers' shard group (the whole group, or a block)
  ProcessGroup* global_ = nullptr;       // every rank: trainability checks, start-up sync, buffers
  ProcessGroup* replica_ = nullptr;      // hierarchical sharding: this rank's replicas in the other blocks
  // With step_in_backward: the group the gradients reduce on, split from group_, whose order of
  // collectives the parameter syncs started in the backward do not enter.
  std::shared_ptr<ProcessGroup> reduce_group_;
  ShardedDDPOptions options_;
  std::optional<c10::ScalarType> input_dtype_;  // mixed precision's param_dtype: forward() casts inputs to it

  std::vector<at::Tensor> params_;  // the module's parameters, in module order
  std::vector<std::string> names_;
  std::vector<std::pair<size_t, size_t>> place_;  // per module parameter: (optimizer, its position there)
  std::vector<int> owner_;          // per module parameter
  std::unordered_map<const void*, size_t> module_index_;  // TensorImpl -> position in params_
  // Per optimizer: the plan the buckets were built on (Note [Shard plan] in csrc/optim/shard_plan.h).
  std::vector<std::shared_ptr<const detail::ShardPlan>> built_plans_;
  std::vector<Hooked> hooked_;               // parameters that carry our post-accumulation hook
  std::unordered_map<const void*, size_t> hooked_index_;  // TensorImpl -> position in hooked_
  std::vector<Entry> entries_;      // trainable parameters, in bucket order
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;
  size_t next_step_ = 0;       // step_in_backward: launched buckets below it are handed over and stepped
  bool stepping_ = false;      // step_in_backward: this backward began the optimizers' steps
  std::vector<at::Tensor> scratch_;  // reduce scratch given back, kept for the next buckets
  size_t scratch_held_ = 0;          // buckets holding reduce scratch now
  size_t most_scratch_held_ = 0;     // ... at most, over this object's life
  size_t next_recycle_ = 0;          // launched buckets below it hold none
  // Where the reduction stands (Note [Reduction phases] in csrc/ddp/reduction.cpp).
  enum class Phase : uint8_t { kIdle, kAccumulating, kViews, kReducing };
  Phase phase_ = Phase::kIdle;
  int64_t copying_ = 0;         // bytes copied into buckets in this backward so far
  int64_t copied_bytes_ = 0;    // ... in the last one
  bool no_sync_ = false;  // inside no_sync(): a mode the user sets, not a phase
  int64_t global_samples_ = -1;
  PendingWork mask_check_;
  at::Tensor mask_check_buffer_;
  int64_t rebuilds_ = 0;
  bool has_split_pieces_ = false;  // some bucket holds part of a parameter
  bool uncleared_ = false;         // this backward found a handed-over gradient left exactly as it was
  bool carry_split_ = false;       // split pieces carry their last reduction over (gradients uncleared)
  // Error feedback's residuals as a checkpoint restored them, until the first reduction takes
  // them (Note [Error feedback in checkpoints] in csrc/ddp/error_feedback_state.cpp).
  struct RestoredResiduals {
    at::Tensor layout;                   // residual_layout() when they were saved
    std::vector<at::Tensor> residuals;   // per bucket (undefined: none yet)
  };
  std::optional<RestoredResiduals> restored_residuals_;
};

}  // namespace shardopt

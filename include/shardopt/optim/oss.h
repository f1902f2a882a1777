// OSS: an optimizer that shards its state across data-parallel ranks (ZeRO stage 1).
//
// Each rank keeps optimizer state only for the parameters it owns (see partition.h) and steps
// only those; after step() every rank holds identical, updated parameters. Wraps any
// torch::optim optimizer through a factory:
//
//   shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::AdamW>(
//                         torch::optim::AdamWOptions(1e-3)), group);
//   loss.backward();  allreduce the gradients (or use ShardedDDP);  opt.step();
//
// Parameters become views into flat buffers laid out by a FlatLayout (flat_layout.h): one buffer
// per (device, dtype), whose buckets are cut into one equal row per rank (element-wise
// optimizers, Note [Row buckets]) or whose shards hold whole parameters per owner, so that making
// every copy current after the step is one all-gather per row bucket, or one broadcast per owner
// shard (Note [Parameter sync]). The same layout gives ShardedDDP its gradient buckets. The parameter tensors keep their identity (set_data),
// so the user's module and hooks stay valid; moving the module to another device after
// construction is not supported. A change of the trainable set or of the owners lays the buffers
// out again.
//
// param_groups() are the global groups: option changes there (learning-rate schedulers) take
// effect at the next step(). Trainability may change at any time: a parameter whose
// requires_grad is false is not stepped (its state is kept for when it is unfrozen), every
// step() checks with one tiny collective that all ranks agree on the trainable set, and when the
// set changed so that the trainable work is lopsided, the step re-partitions and moves the
// optimizer state of the parameters that change owner (OSSOptions::rebalance).
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/comm/wire.h>
#include <shardopt/compat.h>
#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/mixed_precision.h>
#include <shardopt/optim/partition.h>
#include <shardopt/optim/placement.h>

#include <ATen/core/ivalue.h>
#include <torch/csrc/api/include/torch/types.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace shardopt {

namespace testing {
struct Introspection;
}

class OSS;
class ShardedDDP;
class ShardedGradScaler;
namespace detail {
class ShardStore;
class StateSlabs;
struct HandOver;
struct OssForDdp;
struct ShardPlan;
struct OptimizerCodec;
struct FusedStepInputs;
struct MasterRows;
struct GroupOptions;
struct StatePart;
struct BackwardStep;
// A range of one parameter's elements whose optimizer state one rank holds; `tensor` (on that
// rank only) is what the wrapped optimizer steps: the parameter itself for the whole range, a
// view of its elements otherwise.
struct Holding {
  int rank = -1;
  Range in_param;
  at::Tensor tensor;
};
}  // namespace detail

using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::optim::OptimizerParamGroup>)>;

// A factory for `Opt` with `defaults`, e.g. optimizer<torch::optim::AdamW>(AdamWOptions(1e-3)).
template <class Opt, class Options>
OptimizerFactory optimizer(Options defaults) {
  return [defaults](std::vector<torch::optim::OptimizerParamGroup> groups)
             -> std::unique_ptr<torch::optim::Optimizer> { return std::make_unique<Opt>(groups, defaults); };
}

// One optimizer of several in one OSS: its parameters and the optimizer that steps them, e.g.
//   {matrices, optimizer<shardopt::Muon>(shardopt::MuonOptions(0.02))}
// Each becomes one of OSS's param_groups(), with the factory's default options.
struct OptimizerGroup {
  std::vector<torch::Tensor> params;
  OptimizerFactory optimizer;
};

// How every rank's copy of the parameters is made current after the owners stepped.
// kBroadcast is the default; kAllgather issues one collective per flat buffer whatever the world
// size (docs/benchmarks-log.md compares them).
enum class ParamSync {
  kBroadcast,  // one broadcast per owner and flat buffer, of the owner's used elements
  kAllgather,  // one all-gather per flat buffer of its shards as equal rows (Note [Rows]: direct
               // transfers on Gloo, NCCL's all-gather on NCCL); a whole-parameter buffer's shards
               // are padded to the longest, and the padding travels too
};

// Who owns what (Note [Split parameters]).
enum class PartitionMode {
  kAuto,             // kSplit (row buckets) for element-wise optimizers (Adam, AdamW, SGD, RMSprop,
                     // Adagrad, or registered as such), unless whole parameters would leave no
                     // rank split_above_imbalance or more above its share (never, by default) and
                     // no whole-tensor optimizer (Muon) steps other parameters of the same OSS;
                     // else kWholeParameters (also for an optimizer shardopt does not know)
  kWholeParameters,  // each parameter's state on one rank (fairscale OSS, ZeroRedundancyOptimizer)
  kSplit,            // equal ranges of the element-wise optimizers' trainable elements, cut across
                     // parameter boundaries; a whole-tensor optimizer's parameters stay whole
};

// How each owner keeps its optimizer state (Note [State formats] in csrc/optim/state_slabs.cpp).
enum class StateFormat {
  kFloat32,   // as torch::optim keeps it: in the stepped tensors' dtype (the default)
  kBFloat16,  // Adam's, AdamW's and SGD's state in bf16: each step widens it to fp32, steps, and
              // rounds it back to nearest even (fp32 CPU parameters, or fp32 masters under mixed
              // precision; the fused step)
  kInt8,      // Adam's, AdamW's and SGD's state in 8-bit codes (bitsandbytes' and torchao's
              // AdamW8bit scheme): blocks of 256 consecutive elements of the whole tensor, one fp32
              // absmax each, codes from the dynamic maps (signed for the first moment and momentum,
              // unsigned for second moments); tensors under 4,096 elements keep fp32 state. Each
              // step decodes a block, steps it in fp32 and codes the new moments. The layout is
              // aligned to 256 elements so that every block has one owner: the same bits at every
              // world size (Note [8-bit state slabs] in csrc/optim/state_slabs.cpp)
};

// kInt8's blocks: elements per block (one fp32 scale each), and the fewest elements a tensor has
// for its state to be coded (smaller ones keep fp32 state).
inline constexpr int64_t kInt8StateBlock = 256;
inline constexpr int64_t kInt8StateMinNumel = 4096;

// "fp32", "bf16", "int8": the names the command-line tools take.
std::string state_format_name(StateFormat format);
// The format named `name` (one of those); throws naming the valid ones otherwise.
StateFormat parse_state_format(const std::string& name);

struct OSSOptions {
  TORCH_ARG(ParamSync, sync) = ParamSync::kBroadcast;
  TORCH_ARG(PartitionMode, partition) = PartitionMode::kAuto;
  // kAuto keeps whole parameters only when the best whole-parameter partition of the trainable
  // bytes leaves the busiest rank less than this above 1/world (Note [Split parameters]); 0, the
  // default: element-wise optimizers always get row buckets.
  TORCH_ARG(double, split_above_imbalance) = 0.0;
  // Check at every step() that all ranks agree on the trainable set (one 16-byte all-reduce).
  // Under a ShardedDDP with auto_refresh_trainable, its forward() checks instead, and the step
  // does not check again.
  TORCH_ARG(bool, check_trainable_every_step) = true;
  // After the trainable set changes, re-partition when the trainable work on some rank is more
  // than `rebalance_threshold` above the mean, moving optimizer state to the new owners (Note
  // [Rebalance after a freeze]). Needs one of the optimizers state_dict() supports.
  TORCH_ARG(bool, rebalance) = true;
  // Steps Adam, AdamW and SGD with the fused step (shardopt/optim/fused_step.h): one pass over
  // each owned tensor's memory, across threads. Off: the wrapped optimizer's own step().
  TORCH_ARG(bool, fused_step) = true;
  // Hierarchical sharding: shard within consecutive blocks of this many ranks (a node's, say:
  // LOCAL_WORLD_SIZE) and keep one replica per block; 0 or the group's size: the whole group.
  // Must divide the group's size. ShardedDDP reduces gradients within the block, then all-reduces
  // each owned shard across the blocks; the parameter sync stays within the block.
  TORCH_ARG(int, shard_group_size) = 0;
  TORCH_ARG(double, rebalance_threshold) = 0.1;
  // Low-precision parameters and gradients, fp32 master weights and state on the owners only
  // (shardopt/optim/mixed_precision.h). Off by default.
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  // How the flat buffers are laid out (a ShardedDDP cuts the buckets at its reduce_bucket_bytes
  // instead).
  TORCH_ARG(LayoutOptions, layout) = {};
  // How the parameter sync after the step travels (Note [Parameter wire] in csrc/comm/wire.cpp).
  // kExact (the default): in the parameters' dtype. kBFloat16: each owner keeps an fp32 master of
  // what it owns and steps it, and every rank (the owner too) sets its fp32 parameters to the
  // master rounded to bf16, so the sync moves half the bytes and every copy stays bitwise equal;
  // as under mixed precision, every parameter takes global rank 0's values at construction. Under
  // mixed precision with bf16 parameters it changes nothing; with fp16 ones it is refused. kInt8:
  // the same with int8 blocks and fp32 scales (Note [Int8 wire]), every rank's
  // parameters the dequantised masters.
  TORCH_ARG(Wire, param_wire) = Wire::kExact;
  // The format of the optimizer state on its owner. kFloat32 (the default): as torch::optim keeps
  // it. kBFloat16 halves the state's bytes, kInt8 keeps about a quarter (codes and scales); the
  // masters under mixed precision stay fp32. The consolidated state_dict() holds fp32 state, as
  // PyTorch's optimizers load it; loading rounds (bf16) or codes (int8) it back, to the same bits.
  // Every rank must pass the same format.
  TORCH_ARG(StateFormat, state_format) = StateFormat::kFloat32;
};

// What the last re-partition did on this rank.
struct RebalanceStats {
  int64_t params_moved = 0;       // parameters whose owner changed (all ranks)
  int64_t state_bytes_sent = 0;   // optimizer-state tensor bytes this rank sent away
  int64_t state_bytes_received = 0;
  // State bytes this rank copied into its slots after the move: what it received, and state that
  // could not move inside its own slab's memory (Note [State lands in its slot]).
  int64_t state_bytes_copied = 0;
  double imbalance_before = 0.0;  // trainable-work imbalance under the old and the new partition
  double imbalance_after = 0.0;
  // Counts since construction: moves of state between ranks (either kind), and re-partitions.
  int64_t moves = 0;
  int64_t repartitions = 0;
};

class OSS : public torch::optim::Optimizer {
 public:
  OSS(std::vector<torch::Tensor> params, OptimizerFactory factory, std::shared_ptr<ProcessGroup> group,
      OSSOptions options = {});
  OSS(std::vector<torch::optim::OptimizerParamGroup> groups, OptimizerFactory factory,
      std::shared_ptr<ProcessGroup> group, OSSOptions options = {});
  // Several optimizers in one: each group's parameters are stepped by its own optimizer (Note
  // [Ownership by kind] in csrc/optim/placement.cpp), and each is one of param_groups(), in order.
  OSS(std::vector<OptimizerGroup> groups, std::shared_ptr<ProcessGroup> group, OSSOptions options = {});
  ~OSS() override;

  // Steps the owned shard with the wrapped optimizer, then makes every rank's copy current.
  // Collective.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Clears the gradients of all parameters (not only the owned ones), like the base class.
  void zero_grad(bool set_to_none = true);

  // The gradients this rank holds for trainable parameters: with `owned_only`, only the ranges
  // it owns (each element of the model on exactly one rank: what a norm or a non-finite check
  // counts); otherwise every gradient tensor it holds, each once (what clipping and unscaling
  // scale). Under mixed precision they are in param_dtype or reduce_dtype, not fp32.
  std::vector<at::Tensor> grads(bool owned_only) const;

  // Clips the gradients as if torch::nn::utils::clip_grad_norm_ saw the full gradient of all
  // trainable parameters; returns that global norm. Collective. Each rank counts the ranges it
  // owns and scales every gradient it holds. With `error_if_nonfinite`, a NaN or infinite total
  // norm is an error on every rank (naming the norm), and no gradient is scaled, as
  // torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True) does.
  double clip_grad_norm(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

  // Agrees across ranks on the trainable set now (step() also does this) and, unless a ShardedDDP
  // wraps this optimizer (its forward and refresh_trainable() do it there), lays the parameters
  // out for it. Collective; ranks that disagree all get an error naming the first differing
  // parameter.
  void refresh_trainable();

  // Streams every rank's shard to `recipient`, one shard at a time. Collective.
  void consolidate_state_dict(int recipient = 0);
  // PyTorch's layout: {"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}.
  // Only on the recipient of the last consolidate_state_dict().
  torch::IValue state_dict() const;
  // Loads a full state dict (from any world size) on this rank: every rank calls it.
  void load_state_dict(const torch::IValue& state);
  // This rank's part of the state: {"shard": [{"param", "begin", "end", "state"}, ...],
  // "param_groups", "rank", "world_size"}, each range in its parameter's elements, each state
  // tensor with storage of its own. Collective (state still owed to this rank after a re-partition
  // moves first).
  torch::IValue state_shard() { return state_shard(/*own_storage=*/true); }
  // state_shard() without a copy: each state tensor is a view of the memory this rank keeps its
  // state in (as PyTorch's Optimizer.state_dict() holds the live tensors), valid until the next
  // step(), load or re-partition; copy what you keep before then (Resilient's copies do). Collective.
  torch::IValue state_shard_view() { return state_shard(/*own_storage=*/false); }
  // Loads old state_shard() values of any world size, spread over the ranks of global_group() (as
  // after a rank died and its copies live elsewhere): each rank passes the ones it holds (`held`:
  // together they cover every parameter's state once; a rank may hold none), and every rank the
  // same `param_groups` (any of those shards' "param_groups"). Each rank receives only the ranges
  // it holds now (Note [Each rank receives its own ranges] in csrc/optim/state_migration.cpp); a
  // range covered by no shard, or by two, is an error on every rank naming the parameter. Returns
  // what this rank sent and received. Collective over global_group().
  RebalanceStats load_state_shards(const std::vector<torch::IValue>& held, const torch::IValue& param_groups);
  // The full state dict (PyTorch's layout) stitched from every rank's state_shard(), from an OSS
  // of any world size over the same parameters. Local; an incomplete set is an error.
  torch::IValue state_dict_from_shards(const std::vector<torch::IValue>& shards) const;

  // Writes the consolidated state (on the recipient); load() reads it on any world size.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Mixed precision: starts the masters of the ranges this rank owns from the parameters' current
  // values (after changing the parameters without the optimizer's state). Local.
  void refresh_master_weights();

  // ---- what a rank holds, and how it is laid out ----
  const OSSOptions& options() const { return options_; }
  // Bytes of optimizer-state tensors this rank holds.
  int64_t local_state_bytes() const;
  // Bytes of the fp32 master weights this rank holds (mixed precision; 0 otherwise).
  int64_t local_master_bytes() const;
  // What the last move of optimizer state between ranks did on this rank (a re-partition, or
  // split ranges cut again for a new trainable set), and how many there were.
  RebalanceStats last_rebalance() const;
  // The partition mode and why, the world size and the imbalance; then one line per rank: its
  // share of the whole-tensor optimizers' cost, the bytes of optimizer state it holds (by the
  // optimizers' declared state sizes), and how many parameters it holds whole and in part.
  std::string describe() const;
  // The rank (of process_group()) that holds all of `param`'s optimizer state and steps it (a
  // frozen parameter's: the rank that keeps its state for when it is unfrozen); -1 when its state
  // is split across several ranks (owners() lists them: row buckets cut element-wise optimizers'
  // parameters across owners). Follows re-partitions. An error for a tensor that is not one of
  // this OSS's parameters.
  int owner(const torch::Tensor& param) const;
  // The ranks that hold pieces of `param`'s state, in element order (one for a parameter kept
  // whole).
  std::vector<int> owners(const torch::Tensor& param) const;
  // Where each parameter lives in the flat buffers, and the gradient buckets (the planner's view:
  // layout().options().split() says whether parameters are split across owners, and
  // layout().imbalance() how far the busiest rank's trainable elements are above 1/world). The
  // reference stays valid until the next new layout (after a freeze, an unfreeze or a
  // re-partition, at a step, a ShardedDDP forward or construction, a refresh_trainable(), or a
  // loaded state dict); copy the FlatLayout to keep it longer.
  const FlatLayout& layout() const;
  // The group the state is sharded over: the whole group, or this rank's block.
  ProcessGroup& process_group() const { return *group_; }
  // The group OSS was given (every rank).
  ProcessGroup& global_group() const { return *global_group_; }
  // Note [Overlapped parameter sync]: under ShardedDDPOptions::overlap_param_sync, step()
  // starts one collective per gradient bucket (a row bucket's all-gather of its rows, a bucket of
  // whole parameters' broadcast from its owner), the buckets the forward needs first first, and
  // returns; the parameters are current once finish_param_sync() returned (every rank's copy).
  // Everything in OSS that reads or lays out the parameters finishes the sync first; user code
  // that reads parameters between step() and the next ShardedDDP forward calls it. A local wait:
  // every rank started the same collectives in step().
  void finish_param_sync();

  // The gradient scaler's step, as PyTorch's fused optimizers take torch.amp.GradScaler's scale
  // (ShardedGradScaler::step calls it; Note [Unscaling in the step]): the gradients, scaled by
  // 1 / `inv_scale`, are unscaled as the fused step reads them and stay scaled, and the step is
  // skipped on every rank when any rank finds inf or NaN in the gradients it steps. Returns whether
  // it stepped (the same on every rank). Needs can_unscale_in_step() and a finite, positive
  // `inv_scale`. Collective.
  bool step_unscaling(double inv_scale);
  // Whether step_unscaling() can take the unscale: every optimizer of this OSS is Adam, AdamW or
  // SGD under the fused step (OSSOptions::fused_step, the default). Local.
  bool can_unscale_in_step() const;

  // Whether a ShardedDDP made with ShardedDDPOptions::step_in_backward steps this optimizer in its
  // backward: step() then finishes what the backward began, and clip_grad_norm and
  // ShardedGradScaler, which need every gradient before the step, are refused. Local.
  bool steps_in_backward() const;

 private:
  friend struct testing::Introspection;
  // A ShardedDDP receives the store (the layout, the parameter buffers and the owned gradients,
  // Note [Owned gradients]) from hand_over(), once, in its constructor, and makes the calls of
  // the private side below, all through detail::OssForDdp (csrc/optim/oss_for_ddp.h).
  friend struct detail::OssForDdp;
  detail::ShardStore& hand_over(const detail::HandOver& h);
  // state_shard(); without `own_storage`, the state tensors are views of the slabs
  // (state_shard_view()).
  torch::IValue state_shard(bool own_storage);
  // step() without a closure; with `inv_scale`, step_unscaling()'s. Collective.
  bool step_with(std::optional<double> inv_scale);

  // ---- for ShardedDDP, the checkpoint and testing::Introspection ----
  // Lays the store out for a plan for `trainable` (one flag per parameter, in all_params() order)
  // with the current owners, if it differs from the current plan's set, and the holdings follow;
  // returns whether it did (Note [Shard plan]). Every rank must pass the same set: step() passes
  // the set it agreed on (or, with its check off, the local set, taken as agreed); ShardedDDP's
  // forward the module's set, which its overlapped check confirms before any gradient is reduced.
  bool lay_out_for(const std::vector<uint8_t>& trainable);
  // Re-partitions for the current plan's trainable set if that set changed since the partition
  // was last decided and the options ask for it; returns whether the partition changed.
  // Collective. step() calls it after the step when it checks the trainable set itself;
  // ShardedDDP at the forward after its check confirmed the set.
  bool rebalance();
  // All parameters, in global order (groups concatenated).
  const std::vector<torch::Tensor>& all_params() const { return params_; }
  size_t index_of(const torch::Tensor& param) const;
  // With shard_group_size, the group of this rank's replicas (the ranks at its position in every
  // block); null without blocks.
  ProcessGroup* replica_group() const { return replica_group_.get(); }
  // Whether parameter `param` (an index in all_params()) stays whole on one owner: its optimizer
  // needs whole tensors (StateKind::kWholeTensor), or parameters are not split.
  bool kept_whole(size_t param) const { return placement_.kept_whole(param); }
  // The parameter sync of one parameter (Note [Overlapped parameter sync]).
  void finish_param_sync(size_t param);

  // One wrapped optimizer over some of the global groups (all of them, or one OptimizerGroup's).
  struct Unit {
    OptimizerFactory factory;
    std::vector<size_t> groups;  // global group indices, in the local optimizer's group order
    std::unique_ptr<torch::optim::Optimizer> local;
    const detail::OptimizerCodec* codec = nullptr;  // null: a class shardopt does not know
    std::string class_name;                         // the optimizer's C++ class, demangled
    bool fused_kind = false;                        // Adam, AdamW or SGD: the fused step's
  };
  void init(std::vector<torch::optim::OptimizerParamGroup> groups, std::vector<Unit> units);
  void set_units(std::vector<Unit> units);
  // make_local(), with any rank's failure raised on every rank. Collective.
  void make_local_on_every_rank();
  // The unit that steps parameter `param`.
  Unit& unit_of(size_t param) { return units_[unit_of_group_[group_of_[param]]]; }
  const Unit& unit_of(size_t param) const { return units_[unit_of_group_[group_of_[param]]]; }
  // Whether shardopt knows the state layout of every optimizer (built in or registered).
  bool all_registered() const;
  void check_params_across_ranks();
  void check_param_wire() const;
  void check_state_format() const;
  // With shard_group_size: splits the group into blocks and replica groups; group_ becomes the block.
  void form_blocks();
  // What placement needs of each parameter: its shape, dtype, trainability (`trainable`), and its
  // optimizer's kind and cost.
  std::vector<ParamShape> param_shapes(const std::vector<uint8_t>& trainable) const;
  void make_local();
  void sync_options_to_local();
  // The trainable set now, agreed by every rank (an error naming the first parameter where two
  // differ), and the optimizers' classes and options with it (Note [Optimizers agree across
  // ranks]): one hash, compared in full when it differs or with `force`. Collective.
  std::vector<uint8_t> agreed_trainable(bool force);
  // Each global group's optimizer class and options (options_agreement.h); their hash; and their
  // full comparison across the ranks, an error naming the option on every rank (collective).
  std::vector<detail::GroupOptions> group_options() const;
  uint64_t options_hash() const;
  void check_options_alike() const;
  void set_local_groups();
  // Makes `plan` current in the store, and the holdings follow it.
  void lay_out(std::shared_ptr<const detail::ShardPlan> plan);
  // Whether the step steps parameter `param`: trainable in the plan and still now (one frozen
  // since the set was agreed is not).
  bool steps(size_t param) const;
  // Where each parameter's state lives for the current plan (the layout's pieces for a trainable
  // parameter; a frozen one keeps its holdings), after any new plan.
  void follow_plan();
  void assign_holdings();
  // Moves optimizer state (and owned gradients) from the settled holdings to the current ones.
  // Collective; a no-op when nothing moved.
  void settle_state();
  // Puts the settled state into its slabs (Note [State slabs]), with the `parts` of state that
  // settle_state() moved in slices (Note [State lands in its slot]). Local.
  // Returns the state bytes copied into the slots.
  int64_t place_state(std::vector<detail::StatePart>* parts = nullptr);
  // The saved state entries of a state dict, by parameter index (shapes checked).
  std::unordered_map<size_t, c10::impl::GenericDict> saved_entries(const c10::impl::GenericDict& dict) const;
  c10::impl::GenericList param_groups_value() const;
  void load_masters(const c10::impl::GenericDict& dict);
  // The gradient of holding h of parameter i on this rank, or undefined: a range of the
  // parameter's full gradient when it has one, else the store's (Note [Owned gradients]).
  at::Tensor holding_grad(size_t i, const detail::Holding& h) const;
  // Where a holding's own gradient is kept: the parameter's .grad for a whole parameter, the
  // store otherwise (what moves with the holding to a new owner).
  at::Tensor owned_grad(size_t i, const detail::Holding& h) const;
  void set_owned_grad(size_t i, const detail::Holding& h, at::Tensor grad);
  // Whether optimizer `unit`'s masters may take the mixed CUDA kernel (Adam and AdamW).
  bool mixed_kernel_for(size_t unit) const;
  // Adds holding h of parameter i, with its gradient, to what the fused step steps (under the
  // mixed kernel, with its parameter range to write); false where it has no gradient.
  bool add_step_input(detail::FusedStepInputs& in, size_t i, const detail::Holding& h, bool mixed_kernel_here) const;
  // Steps this rank's holdings with their gradients (the fused step, or the wrapped optimizer's),
  // and writes the masters back into the parameters, but those the sync packs from (`from_masters`);
  // false when the scaler's found-inf skipped it.
  bool step_shard(std::optional<double> inv_scale, const detail::MasterRows& from_masters);
  // Agrees on found-inf over `in`'s gradients and hands the fused step the scale, or unscales the
  // gradients in place; false when the step is skipped. Collective.
  // The fused step of `stepped` (with `in`'s gradients), bucket by bucket, each row bucket's sync
  // started once its holdings are stepped (Note [A step per bucket]). Returns whether it stepped.
  // Writes master `h` (of parameter `i`) back into its parameter where neither the mixed kernel
  // nor the sync does (Note [Syncing from the masters]).
  void write_back_master(size_t i, const detail::Holding& h, const detail::FusedStepInputs& in,
                         const detail::MasterRows& from_masters);
  bool step_by_bucket(const detail::FusedStepInputs& in,
                      const std::vector<std::pair<size_t, const detail::Holding*>>& stepped,
                      const detail::MasterRows& from_masters);
  bool scale_in_step(detail::FusedStepInputs& in, double inv_scale);
  // The step in a ShardedDDP's backward (Note [A step in the backward] in
  // csrc/optim/oss_step_in_backward.cpp): begun at the backward's first gradient (collective
  // where the state moves), bucket `bucket` of the layout reduced and handed over (its holdings
  // stepped once all their buckets are; each sync started once what it sends is stepped), and
  // ended when the backward's buckets are all reduced. step() then finishes it.
  void begin_backward_step();
  void refuse_new_layout_in_backward_step() const;
  void step_reduced_bucket(size_t bucket);
  void end_backward_step();
  bool finish_backward_step();
  // The fused step of `these` holdings with their gradients, then their masters written back.
  void step_holdings(const std::vector<std::pair<size_t, const detail::Holding*>>& these);
  void start_ready_syncs();

  std::shared_ptr<ProcessGroup> group_;
  OSSOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<size_t> group_of_;
  std::vector<size_t> group_sizes_;
  std::unordered_map<const void*, size_t> index_of_;  // TensorImpl -> position in params_
  int64_t settled_version_ = -1;        // the store's layout version when the state was last settled
  // Weights, kinds, split or whole, decided at construction (shardopt/optim/placement.h).
  Placement placement_;
  std::vector<std::vector<detail::Holding>> holdings_;  // per parameter: where its state lives now
  int64_t state_moves_ = 0;
  std::shared_ptr<ProcessGroup> global_group_, replica_group_;
  bool stepped_fused_ = false;  // every optimizer stepped fused last time
  std::vector<uint8_t> fused_;  // per optimizer: steps fused this time
  int64_t fused_segments_ = 0;  // the segments the last fused step stepped
  // The last step by bucket, in order: ('s', k) row bucket k's holdings stepped, ('g', k) its
  // sync started (Note [A step per bucket]).
  std::vector<std::pair<char, int64_t>> bucket_steps_;
  std::unique_ptr<detail::BackwardStep> backward_step_;  // from begin_backward_step() to step()
  std::vector<std::vector<detail::Holding>> settled_;   // where the state is (until settle_state())
  std::vector<Unit> units_;
  std::vector<size_t> unit_of_group_, local_group_of_;  // per global group: its unit, its index there
  // The partition, the parameter buffers and the owned gradients (a ShardedDDP receives it from
  // hand_over()).
  std::unique_ptr<detail::ShardStore> store_;
  // The slabs the local optimizers' state lives in (Note [State slabs]): OSS's alone.
  std::unique_ptr<detail::StateSlabs> slabs_;
  // The plan's trainable set changed since the partition was decided (Note [Rebalance after a
  // freeze]): the next rebalance() decides again.
  bool repartition_due_ = false;
  int64_t holdings_version_ = -1;  // the plan version the holdings follow
  int64_t partition_version_ = 0;
  RebalanceStats last_rebalance_;
  bool mixed_ = false;    // mixed precision: the parameters are in param_dtype
  bool masters_ = false;  // the holdings' tensors are fp32 masters: mixed precision, or a param_wire
  std::vector<at::Tensor> master_sources_;  // during construction: the fp32 values masters start from
  std::optional<torch::IValue> consolidated_;
  int last_recipient_ = -1;
};

}  // namespace shardopt

// ShardStore: the memory a rank's shard of the optimizer owns, addressed through the FlatLayout
// (Note [Shard store] in shard_store.cpp). Internal to shardopt; OSS composes it, and a ShardedDDP
// receives it from the one call OSS::hand_over.
//
// It holds the current plan (the trainable set, the partition and the layout: Note [Shard plan]),
// the flat parameter buffers laid out for it, and the parameter sync after the step. For each (device, dtype)
// group of the layout it holds one flat slab per kind of optimizer state ("exp_avg",
// "exp_avg_sq", "momentum_buffer", ...) and mixed precision's fp32 masters in a slab of their
// own. The state tensors torch::optim sees are
// views into the slabs, so state_dict(), checkpoints and the codecs see the same tensors as
// before, and the fused step reads each run of state from one slab. It also holds the reduced
// gradients of the split ranges this rank owns (ShardedDDP hands them over here; a whole
// parameter's gradient is its own .grad, as under DDP), and which gradients the last
// zero_grad(false) zeroed.
#pragma once

#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/oss.h>

#include "optim/codec.h"
#include "optim/shard_plan.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace shardopt::detail {

// The slab kind of mixed precision's fp32 master weights, beside the state's kinds.
inline constexpr const char* kMasterSlab = "master";

// Where one holding's state lives in its group's slabs.
struct Slot {
  size_t group = 0;
  int64_t offset = 0;  // elements into each slab of the group
  int64_t numel = 0;
  std::vector<int64_t> sizes;  // the holding tensor's shape (the state tensors' shape)
  bool kept = false;           // a frozen parameter's kept state (after the trainable region)
  bool operator==(const Slot& o) const {
    return group == o.group && offset == o.offset && numel == o.numel && sizes == o.sizes && kept == o.kept;
  }
};

// The rows of masters the parameter sync packs from (Note [Syncing from the masters] in
// param_buffers.cpp): per layout bucket this rank's row of its master slab, or undefined (empty:
// none), and the masters they hold (their TensorImpls), which the step does not write back.
struct MasterRows {
  std::vector<at::Tensor> rows;
  std::unordered_set<const void*> covered;
};

// What a ShardedDDP takes over from an OSS, in one call (OSS::hand_over): it checks the trainable
// set at every forward and has the OSS lay the store out for it (with checks_trainable, OSS's step
// leaves both to it), cuts the gradient buckets at bucket_bytes, and with overlap_param_sync leaves the
// step's parameter sync in flight for its forward.
struct HandOver {
  bool checks_trainable = false;
  bool overlap_param_sync = false;
  int64_t bucket_bytes = 0;
};

class ShardStore {
 public:
  // The store of `params` (in OSS's order; the layout makes them views into its buffers), sharded
  // over `group`, laid out with `options`, made current after a step by `sync`, on `wire`. Its
  // plans start from `partition`; `kept_whole` says, per parameter, whether it stays whole in a
  // split layout (its optimizer needs whole tensors: Note [Ownership by kind]; empty: none). Not
  // laid out yet: the first lay_out_for() does it.
  ShardStore(std::vector<at::Tensor> params, std::shared_ptr<ProcessGroup> group, LayoutOptions options,
             ParamSync sync, Wire wire, Partition partition, std::vector<uint8_t> kept_whole);

  // ---- the plan (Note [Shard plan]) ----
  const ShardPlan& plan() const { return *plan_; }
  const PlanPtr& plan_ptr() const { return plan_; }
  // The plan for `trainable` (one flag per parameter, agreed by every rank) with `partition`: the
  // next version, from the parameters' shapes and what has state to keep. Every rank that passes
  // the same set and partition gets the same plan.
  PlanPtr make_plan(std::vector<uint8_t> trainable, Partition partition) const;
  // Who owns each parameter when parameters stay whole; a split layout cuts the trainable run in
  // equal ranges instead (Note [Row buckets]).
  const Partition& partition() const { return plan_->partition; }
  const FlatLayout& layout() const { return plan_->layout; }
  // The trainable set the plan was made for.
  const std::vector<uint8_t>& trainable() const { return plan_->trainable; }
  // The plan's version: whoever built on a plan compares it to know whether it is still current.
  int64_t plan_version() const { return plan_->version; }

  // ---- what has state to keep ----
  // Parameters stepped (or loaded with state) since construction: the frozen ones among them keep
  // their state, and the layout places it (Note [Kept state]).
  std::vector<uint8_t>& stepped() { return stepped_; }
  const std::vector<uint8_t>& stepped() const { return stepped_; }

  // ---- the parameter buffers (param_buffers.cpp) ----
  // Lays the buffers out for a plan for `trainable` with the current partition, if `trainable`
  // differs from the plan's set; returns whether it did. Local: every rank must pass the same set
  // before the next collective that uses the layout.
  bool lay_out_for(const std::vector<uint8_t>& trainable);
  // Makes `plan` current (one of make_plan's): new buffers, the parameters' values copied in
  // (lay_out_params), the old buffers freed once nothing refers to them.
  void lay_out(PlanPtr plan);
  std::vector<at::Tensor>& buffers() { return buffers_; }

  // ---- what a ShardedDDP takes over, in one call (OSS::hand_over, HandOver below) ----
  void hand_over(const HandOver& h);
  // OSS alone again (the ShardedDDP is gone): its step checks the set and syncs in full. The
  // bucket cuts stay. Finishes the sync in flight.
  void take_back();
  bool trainable_checked_outside() const { return trainable_checked_outside_; }
  // Whether a ShardedDDP holds the store (between hand_over and take_back).
  bool handed_over() const { return handed_over_; }

  // ---- the parameter sync (Note [Parameter sync], Note [Overlapped parameter sync]) ----
  // Makes every rank's copy of the buffers equal to the owners', this rank's rows of row buckets
  // from `own_rows` where it holds them (master_rows). Collective.
  void sync_params(const std::vector<at::Tensor>& own_rows = {});
  // After a step: the sync above, or with overlap on (and kBroadcast), one broadcast per bucket
  // left in flight. Collective.
  void sync_after_step(const std::vector<at::Tensor>& own_rows = {});
  // The rows of this rank's masters (its `holdings`) the sync can pack from (Note [Syncing from
  // the masters]). Local.
  MasterRows master_rows(const std::vector<std::vector<Holding>>& holdings, int rank) const;
  // Waits for the broadcasts in flight: all, or those of parameter `param`'s buckets. Local.
  void finish_param_sync();
  void finish_param_sync(size_t param);
  bool param_sync_in_flight() const { return sync_in_flight_ > 0; }

  // ---- optimizer state ----
  // Places this rank's state (its slots): every holding of `rank` that is a piece of the layout's
  // trainable run at its place in the rank's shard (the same offsets as the parameter buffer), and
  // each other holding with state in `local` (a frozen parameter's kept state) after it. When the
  // slots differ from the last ones, new slabs are made as state arrives (adopt(), fresh_slot()),
  // and the old ones are freed once no state tensor refers to them.
  // `has_state(param, tensor)` says whether the optimizer of `param` holds state for `tensor`.
  void plan_slots(int rank, const std::vector<std::vector<Holding>>& holdings,
                  const std::function<bool(size_t param, const at::Tensor& tensor)>& has_state);

  // A zeroed view of `tensor`'s slot (a holding tensor: it keys the state) in the slab of `kind`,
  // shaped like it; undefined when it has no slot or the dtype or device differ from the slab's.
  at::Tensor fresh_slot(const at::Tensor& tensor, const char* kind);

  // Moves every state tensor of `local` that is not in its slot into it (one local copy each) and
  // makes the state hold the slab's view; returns the bytes copied. State without a slot stays as
  // it is.
  int64_t adopt(torch::optim::Optimizer& local, const OptimizerCodec& codec);

  // Mixed precision: moves the master of each holding of `rank` (the holding's fp32 tensor, which
  // keys its state) that has a slot into its group's master slab (kMasterSlab) at the slot, keeping
  // the tensor (set_data); returns the bytes copied. A master without a slot keeps its storage.
  int64_t adopt_masters(const std::vector<std::vector<Holding>>& holdings, int rank);

  // The slab of `kind` in `group`; undefined before any state of that kind arrived.
  at::Tensor slab(size_t group, const std::string& kind) const;
  // The slot of holding tensor `tensor`, or null.
  const Slot* slot_of(const at::Tensor& tensor) const;
  // Bytes of all slabs.
  int64_t bytes() const;

  // ---- owned gradients (Note [Owned gradients]) ----
  // The reduced gradient of range `range` of parameter `param` (in OSS's order) that this rank
  // owns; undefined when there is none.
  const at::Tensor& grad(size_t param, Range range) const;
  // Hands `grad` over as that range's gradient (undefined: forgets it).
  void set_grad(size_t param, Range range, at::Tensor grad);
  // Calls `fn` on every owned gradient, each once.
  void for_each_grad(const std::function<void(at::Tensor&)>& fn);
  void clear_grads() { grads_.clear(); }
  // Forgets the gradients of ranges `rank` no longer holds in `holdings`.
  void retain_grads(const std::vector<std::vector<Holding>>& holdings, int rank);
  int64_t grad_bytes() const;

  // Which gradients the last zero_grad(false) zeroed in place (Note [Gradients as bucket views]):
  // noted without keeping them alive, with their versions right after.
  void forget_zeroed() { zeroed_.clear(); }
  void note_zeroed(const at::Tensor& grad);
  // Whether `grad` was zeroed so and nothing has written to it since (its version unchanged).
  bool zeroed(const at::Tensor& grad) const;

 private:
  // The slab of `kind` in `group` for state like `like`, made when missing; undefined when `like`
  // does not fit the group's slabs.
  at::Tensor slab_for(size_t group, const std::string& kind, const at::Tensor& like);

  // Starts the broadcast of every bucket from its owner, in reverse bucket order.
  void start_param_sync(const std::vector<at::Tensor>& own_rows);
  // Re-cuts the gradient buckets at `bytes` (0: one per parameter); data moves only when new row
  // buckets change where a parameter lies.
  void set_bucket_bytes(int64_t bytes);

  std::vector<at::Tensor> params_;  // OSS's parameters (the same TensorImpls)
  std::shared_ptr<ProcessGroup> group_;
  LayoutOptions layout_options_;
  ParamSync sync_;
  Wire wire_;  // the parameter sync's (OSSOptions::param_wire)
  std::vector<uint8_t> kept_whole_;
  std::vector<uint8_t> stepped_;
  PlanPtr plan_;                     // never null; version 0 (no trainable set) before the first layout
  std::vector<at::Tensor> buffers_;  // one per layout group; the parameters are views of them
  bool trainable_checked_outside_ = false;
  bool handed_over_ = false;
  bool overlap_sync_ = false;
  std::vector<PendingWork> bucket_sync_;  // per layout bucket: its broadcast, while in flight (kBroadcast)
  std::vector<PendingWork> group_sync_;   // per flat buffer: its all-gather, while in flight (kAllgather)
  size_t sync_in_flight_ = 0;             // buckets not finished yet
  std::unordered_map<const void*, Slot> slots_;  // holding tensor (TensorImpl) -> slot
  std::vector<int64_t> slab_numel_;              // per group: trainable region + kept region
  std::vector<std::map<std::string, at::Tensor>> slabs_;  // per group: kind -> slab
  std::map<std::tuple<size_t, int64_t, int64_t>, at::Tensor> grads_;  // (param, begin, end) -> gradient
  struct Zeroed {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> grad;
    int64_t version;
  };
  std::unordered_map<const c10::TensorImpl*, Zeroed> zeroed_;
};

}  // namespace shardopt::detail

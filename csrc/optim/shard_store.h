// ShardStore: what a rank's shard shares with the ShardedDDP it is handed to, addressed through
// the FlatLayout. Internal to shardopt; OSS composes it, and a ShardedDDP receives it from the one
// call OSS::hand_over. The optimizer state is not here: it lives in OSS's StateSlabs
// (state_slabs.h).
//
// It holds the current plan (the trainable set, the partition and the layout: Note [Shard plan]),
// the flat parameter buffers laid out for it, and the parameter sync after the step. It also
// holds the reduced gradients of the split ranges this rank owns (ShardedDDP hands them over here;
// a whole parameter's gradient is its own .grad, as under DDP), and which gradients the last
// zero_grad(false) zeroed.
#pragma once

#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/oss.h>

#include "optim/shard_plan.h"
#include "optim/state_slabs.h"

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

// The rows of masters the parameter sync packs from (Note [Syncing from the masters] in
// param_buffers.cpp): per layout bucket this rank's row of its master slab, or undefined (empty:
// none), and the masters they hold (their TensorImpls), which the step does not write back.
struct MasterRows {
  std::vector<at::Tensor> rows;
  std::unordered_set<const void*> covered;
};

// What a ShardedDDP takes over from an OSS, in one call (OSS::hand_over): it checks the trainable
// set at every forward and has the OSS lay the store out for it (with checks_trainable, OSS's step
// leaves both to it), cuts the gradient buckets at bucket_bytes, with overlap_param_sync leaves the
// step's parameter sync in flight for its forward, and with step_in_backward steps bucket by bucket
// in its backward (Note [A step in the backward] in csrc/optim/oss_step_in_backward.cpp).
struct HandOver {
  bool checks_trainable = false;
  bool overlap_param_sync = false;
  bool step_in_backward = false;
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
  // Makes `plan` current (one of make_plan's): the buffers laid out again, the parameters moved
  // inside the old buffers where they fit, else copied into new ones (lay_out_params).
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
  // Whether that ShardedDDP steps the optimizer in its backward (ShardedDDPOptions::step_in_backward).
  bool step_in_backward() const { return step_in_backward_; }

  // ---- the parameter sync (Note [Parameter sync], Note [Overlapped parameter sync]) ----
  // Makes every rank's copy of the buffers equal to the owners', this rank's rows of row buckets
  // from `own_rows` where it holds them (master_rows). Collective.
  void sync_params(const std::vector<at::Tensor>& own_rows = {});
  // Opens a step's sync: what is in flight finished, no bucket started yet. Local.
  void begin_step_sync();
  // Starts bucket `bucket`'s sync now (a row bucket's all-gather; under ParamSync::kBroadcast a
  // bucket of whole parameters' broadcast from its owner), before the rest of the step is done
  // (Note [A step per bucket] in oss_step.cpp); sync_after_step starts the others. Every rank
  // starts the same buckets in the same order. Collective.
  void start_bucket_sync(size_t bucket, const std::vector<at::Tensor>& own_rows);
  // After a step: the sync above, or with overlap on, one collective per bucket left in flight
  // (start_param_sync); buckets start_bucket_sync started are not started again, and without
  // overlap they are waited for here. Collective.
  void sync_after_step(const std::vector<at::Tensor>& own_rows = {});
  // The rows of this rank's masters (its `holdings`, in `master_slabs`: per layout group, its
  // master slab) the sync can pack from (Note [Syncing from the masters]). Local.
  MasterRows master_rows(const std::vector<std::vector<Holding>>& holdings, int rank,
                         const std::vector<at::Tensor>& master_slabs) const;
  // Waits for the syncs in flight: all, or those of parameter `param`'s buckets. Local.
  void finish_param_sync();
  void finish_param_sync(size_t param);
  bool param_sync_in_flight() const { return sync_in_flight_ > 0; }
  // While the timeline records: marks the buckets' syncs seen complete by now (local, no wait).
  void note_completed_syncs();

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
  // Starts the sync of every bucket not started yet (start_bucket_sync), in reverse bucket order:
  // a row bucket's all-gather of its rows, a bucket of whole parameters' broadcast from its owner
  // (under kAllgather: one all-gather per flat buffer of whole parameters instead).
  void start_param_sync(const std::vector<at::Tensor>& own_rows);
  // Bucket `bucket`'s sync: its rows' all-gather, or its range broadcast from its owner.
  PendingWork start_sync_of(size_t bucket, const std::vector<at::Tensor>& own_rows);
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
  std::vector<int64_t> buffer_room_;  // the bytes each buffer's memory holds (it may hold more than the buffer)
  bool trainable_checked_outside_ = false;
  bool handed_over_ = false;
  bool overlap_sync_ = false;
  bool step_in_backward_ = false;
  std::vector<PendingWork> bucket_sync_;  // per layout bucket: its sync, while in flight
  std::vector<PendingWork> group_sync_;   // per flat buffer: its all-gather, while in flight (kAllgather)
  size_t sync_in_flight_ = 0;             // buckets not finished yet
  std::vector<uint8_t> started_;          // per layout bucket: started by start_bucket_sync this step
  bool step_sync_open_ = false;           // between begin_step_sync and sync_after_step
  std::map<std::tuple<size_t, int64_t, int64_t>, at::Tensor> grads_;  // (param, begin, end) -> gradient
  struct Zeroed {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> grad;
    int64_t version;
  };
  std::unordered_map<const c10::TensorImpl*, Zeroed> zeroed_;
};

}  // namespace shardopt::detail

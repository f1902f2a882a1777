// ShardedDDP's side of the optimizer step in the backward (ShardedDDPOptions::step_in_backward):
// each bucket handed over to its owners as soon as its reduction has completed, and its
// optimizer told, so that it steps and sends that bucket while the backward goes on.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/check.h>

#include "ddp/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace shardopt {

// Note [A step in the backward] (ShardedDDP's side; OSS's is in csrc/optim/oss_step_in_backward.cpp)
// The first gradient of a backward outside no_sync() begins each optimizer's step. After each
// gradient's launches, every launched bucket whose reduction has completed (PendingWork::completed,
// which does not wait), in launch order, is handed over (hand_over_bucket: the division, the flags,
// Entry::set_grad, as hand_over_reduced does for all of them at the end otherwise) and its OSS
// steps what it completes. At the backward's end the rest are waited for in launch order, handed
// over and stepped in the same way, and the steps end. Which buckets a rank hands over early
// depends on its own timing, but nothing collective follows from that: the reductions run on
// reducer(), a group of their own, and the optimizers start their syncs in an order the layout
// alone decides. Without accumulation across reductions (a step already took the gradient), the
// clearing evidence of Note [Accumulating across reductions] is not needed: no all-reduce of it.
void ShardedDDP::begin_backward_steps() {
  SHARDOPT_CHECK(options_.grad_scaling() != GradScaling::kGlobalSamples || global_samples_ > 0,
                 "grad_scaling kGlobalSamples needs set_global_samples(n > 0) before each backward (got ", global_samples_,
                 ")");
  for (OSS* opt : optimizers_) detail::OssForDdp::begin_backward_step(*opt);
  stepping_ = true;
}

void ShardedDDP::step_reduced_buckets(bool wait) {
  CommPhase phase("backward (gradient reductions)");
  if (timeline::recording()) {
    for (detail::ShardStore* store : stores_) store->note_completed_syncs();
  }
  while (next_step_ < next_launch_) {
    Bucket& b = buckets_[next_step_];
    if (!wait && !b.work.completed()) return;
    b.work.wait();
    hand_over_bucket(b);
    ++next_step_;
    detail::OssForDdp::step_reduced_bucket(*optimizers_[b.optimizer_index], b.index);
  }
}

void ShardedDDP::hand_over_bucket(Bucket& b) {
  if (!b.rows() && !b.owned.empty()) b.out = b.buffer;
  give_back_scratch(b);
  if (b.owned.empty()) return;
  at::NoGradGuard no_grad;
  const double divisor = grad_divisor();
  if (divisor != 1.0 && !b.divided) b.out.narrow(0, 0, b.numel).div_(divisor);
  bool all_local = true;
  for (size_t e : b.owned) all_local = all_local && entries_[e].local_grad;
  // Where this rank had every gradient, the flags are not read (no host synchronisation on a GPU).
  const at::Tensor flags =
      all_local ? at::Tensor()
                : b.out.narrow(0, b.numel, static_cast<int64_t>(b.owned.size())).to(at::kDouble).to(at::kCPU);
  for (size_t k = 0; k < b.owned.size(); ++k) {
    give_reduced(entries_[b.owned[k]], b, all_local || flags.data_ptr<double>()[k] != 0);
  }
}

void ShardedDDP::end_backward_steps() {
  if (!stepping_) begin_backward_steps();  // reduce() after no_sync(): no gradient of a backward began them
  step_reduced_buckets(/*wait=*/true);
  uncleared_ = false;
  carry_split_ = false;
  const std::string error = reduction_error(/*ambiguous=*/false);
  if (error.empty()) {
    for (OSS* opt : optimizers_) detail::OssForDdp::end_backward_step(*opt);
  }
  reset_executor();  // ready for the next backward whatever happened
  SHARDOPT_CHECK(error.empty(), error);
}

}  // namespace shardopt

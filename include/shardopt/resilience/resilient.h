// Surviving a dead rank: training goes on over the ranks that are left, without a restart.
//
// With ZeRO the optimizer state of a rank's shard exists only on that rank. A Resilient run keeps
// a second copy of every shard on another rank (a buddy copy: rank r holds rank r-1's, in host
// memory, refreshed every `refresh_every` steps) and owns the optimizer and ShardedDDP it builds,
// so that when a rank dies it can rebuild both over the survivors:
//
//   shardopt::Resilient run(group, model,
//       [&](std::shared_ptr<shardopt::ProcessGroup> g) {   // how to make the optimizer over a group
//         return std::make_unique<shardopt::OSS>(model->parameters(),
//             shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)), g);
//       },
//       [&](shardopt::OSS& opt) { return std::make_unique<shardopt::ShardedDDP>(model, opt); },
//       shardopt::ResilienceOptions().refresh_every(5));
//   for (int64_t t = 0; t < steps;) {
//     auto r = run.step(t, [&] {             // this rank's share of global step t
//       auto batch = sampler_for(run.rank(), run.world_size()).batch(t);
//       run.ddp()->forward(batch.x) ...backward();
//     });
//     if (r.recovery) std::cout << r.recovery->to_string() << "\n";
//     t = r.next_step;                       // the step after t, or the step recovery rolled back to
//   }
//
// When a collective fails in any phase (forward, backward's reductions, the step, a
// consolidation or checkpoint run through run(), a state move), every rank leaves that phase
// within about a second (Note [Failure watch]); the survivors agree through the store on who is
// gone, make a new group without them, put the parameters and every shard (the lost ones from
// their copies) back as they were at the last refresh, re-partition for the new world size, and
// step() returns which step to run next. The loop gets a Recovery to log, not an exception. It
// gets an exception (naming why) only when recovery is impossible: both copies of a shard lost,
// fewer survivors than min_world_size, no copy made yet, the store gone, or another rank failing
// during recovery.
//
// Hold the optimizer, ShardedDDP and group through this object: recovery replaces them.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace shardopt {

namespace detail {
struct FlatCopy;  // a shard's host copy (csrc/resilience/copies.h)
}
class ShardedGradScaler;
using GradScalerPtr = ShardedGradScaler*;  // (TORCH_ARG spells its type as `const T&`)

struct ResilienceOptions {
  // Buddy copies: the steps between two refreshes of the copies (>= 1). A failure rolls training
  // back to the last refresh: at most refresh_every - 1 completed steps are run again.
  TORCH_ARG(int64_t, refresh_every) = 1;
  // Fewer survivors than this end the run with an error (>= 1).
  TORCH_ARG(int, min_world_size) = 1;
  // fp16's loss scaler, whose scale and growth tracker then travel in the copies: a recovery puts
  // them back as they were at the refresh it goes back to, and a replacement receives them. Every
  // rank passes one, or none, alike (a replacement too).
  TORCH_ARG(GradScalerPtr, grad_scaler) = nullptr;
};

// One failure survived, as every survivor reports it.
struct Recovery {
  std::vector<int> lost;          // the global ranks that died
  std::string phase;              // where this rank saw the failure
  int old_world_size = 0;
  int world_size = 0;             // after recovery
  int rank = 0;                   // this rank's rank in the new group
  int global_rank = 0;            // and its global rank (as the launcher numbered it: unchanged)
  int64_t failed_step = 0;        // the step that was running
  int64_t resume_step = 0;        // the step training runs next (the last refresh)
  int64_t steps_rolled_back = 0;  // completed steps run again: failed_step - resume_step
  double seconds = 0.0;           // from leaving the failed phase to ready
  // Optimizer state (and fp32 masters) this rank received from the others: only the ranges it
  // holds in the new partition that it did not hold itself.
  int64_t state_bytes_received = 0;
  // "rank 2 died in backward (gradient reductions) at step 17; rolled back 2 steps to step 15;
  // world size 4 -> 3; recovered in 3.4 s"
  std::string to_string() const;
};

// Replacements the run took in (or refused) after a refresh of its copies.
struct Admission {
  std::vector<int> joined;           // global ranks admitted
  std::vector<std::string> refused;  // why each refused replacement was turned away
  int old_world_size = 0;
  int world_size = 0;
  int64_t step = 0;                  // the step the run goes on from, with them
  double seconds = 0.0;
  // "global rank 2 joined at step 15; world size 3 -> 4; in 0.04 s"
  std::string to_string() const;
};

struct StepResult {
  int64_t next_step = 0;               // the step to run next
  std::optional<Recovery> recovery;    // set when this step ended in a recovery instead
  std::optional<Admission> admission;  // set when replacements asked to join after this step
};

class Resilient {
 public:
  using MakeOptimizer = std::function<std::unique_ptr<OSS>(std::shared_ptr<ProcessGroup>)>;
  using MakeDDP = std::function<std::unique_ptr<ShardedDDP>(OSS&)>;

  // Collective. `module` holds the parameters the optimizer steps (their values are what a
  // recovery puts back, with its buffers); make_ddp may be empty (an OSS alone, the loop reduces
  // gradients itself). A world of 1 is refused: there is no other rank to keep a copy. On a
  // joining group (a process started to replace a lost rank: ProcessGroup::joining(), Note
  // [Closed rendezvous]) it waits to be admitted at the run's next refresh, receives the
  // parameters and the state, and the loop starts at start_step().
  Resilient(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> module, MakeOptimizer make_optimizer,
            MakeDDP make_ddp, ResilienceOptions options = {});
  ~Resilient();
  Resilient(const Resilient&) = delete;
  Resilient& operator=(const Resilient&) = delete;

  // Runs global step `step`: refreshes the copies when due, then `body` (forward and backward of
  // this rank's share of the step), then the optimizer's step. The loop runs the returned
  // next_step next.
  StepResult step(int64_t step, const std::function<void()>& body);
  // The same, for a body that steps the optimizer itself (after clipping, or through a gradient
  // scaler): `whole_step` is forward, backward and the step.
  StepResult step_by(int64_t step, const std::function<void()>& whole_step);
  // Runs other collective work (a consolidation, a checkpoint) between steps so that a rank dying
  // in it is survived too; `step` is the step the loop runs next. Returns the recovery, if any
  // (the loop then goes on at its resume_step).
  std::optional<Recovery> run(int64_t step, const std::function<void()>& work);

  // The step the loop starts at: 0, or for a replacement the step the run admitted it at.
  int64_t start_step() const { return start_step_; }
  OSS& optimizer() { return *optimizer_; }
  ShardedDDP* ddp() { return ddp_.get(); }
  ProcessGroup& group() { return *group_; }
  std::shared_ptr<ProcessGroup> group_ptr() const { return group_; }
  int rank() const;
  int world_size() const;
  const ResilienceOptions& options() const { return options_; }
  const std::vector<Recovery>& recoveries() const { return recoveries_; }
  // Called on every survivor after each recovery, before step() returns.
  void on_recovery(std::function<void(const Recovery&)> callback) { callbacks_.push_back(std::move(callback)); }

  // "buddy copies of every shard (rank r keeps rank r-1's, in host memory), refreshed every 5
  // steps; runs on while at least 1 rank is left": what start-up output says (copy_bytes() gives
  // the bytes).
  std::string describe() const;
  // The step of the last refresh (-1: none yet), and the host bytes the copies take on this rank.
  int64_t refreshed_at() const;
  int64_t copy_bytes() const;

 private:
  void refresh(int64_t step);
  StepResult run_step(int64_t step, const std::function<void()>& body, bool steps_itself);
  // Returns the optimizer-state bytes this rank received.
  int64_t install(int64_t step, const std::vector<std::pair<int64_t, const detail::FlatCopy*>>& offers);
  std::optional<Admission> admit_waiting(int64_t step);
  void join();
  c10::intrusive_ptr<c10d::Store> generation_store() const;
  Recovery recover(int64_t failed_step, const std::string& phase);
  Recovery recover_from(int64_t failed_step, const std::string& phase);
  void build();

  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<torch::nn::Module> module_;
  MakeOptimizer make_optimizer_;
  MakeDDP make_ddp_;
  ResilienceOptions options_;
  std::unique_ptr<OSS> optimizer_;
  std::unique_ptr<ShardedDDP> ddp_;
  std::vector<std::function<void(const Recovery&)>> callbacks_;
  std::vector<Recovery> recoveries_;
  bool admission_failed_ = false;  // a failure during an admission: not survived, later steps refuse
  int generation_ = 0;
  c10::intrusive_ptr<c10d::Store> base_store_;  // the rendezvous store; each generation's group lives under a prefix
  int original_world_ = 0;
  int64_t handled_requests_ = 0;  // join requests looked at so far
  int64_t start_step_ = 0;
  bool replicated_ = false;  // the optimizer has replica blocks: Note [Replica blocks]
  // Note [Buddy copies]: the copies of the last refresh and of the one before it.
  struct Copy;
  std::unique_ptr<Copy> current_, previous_;
};

}  // namespace shardopt

// One rank of the rank-death survival tests, started by tools/launch (env:// rendezvous, the store
// served by the launcher). Trains a small MLP with OSS(Adam) + ShardedDDP under shardopt::Resilient
// on a global batch of 24 samples per step that every world size splits alike; a rank is killed
// by SHARDOPT_FAULT_IN_PHASE. Each survivor then trains plain torch::optim::Adam on the same global
// batches in one process and checks that its parameters equal that reference.
//
//   survive_worker --steps T [--refresh-every N] [--freeze-at S] [--consolidate-every C]
//                  [--checkpoint-every C --dir D (each save loaded again at once)] [--min-world-size M] [--expect-recoveries K]
//                  [--expect-world W] [--refresh-every-rank-1 N] [--await-joiner-at S] [--timeout S]
//                  [--scaler-on-rank-1 1]
//                  [--shard-group-size B]
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/grad_scaler.h>
#include <shardopt/optim/oss.h>
#include <shardopt/resilience/resilient.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <csignal>
#include <unistd.h>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

using namespace shardopt;

namespace {

constexpr int64_t kGlobalBatch = 24;

struct Args {
  int64_t steps = 30, refresh_every = 1, freeze_at = -1, consolidate_every = 0, checkpoint_every = 0;
  int min_world_size = 1, expect_recoveries = -1, expect_world = -1;
  int64_t refresh_every_rank_1 = -1;  // another refresh_every on rank 1 (a bad-input test)
  int64_t await_joiner_at = -1;       // before this step, wait until a replacement has asked to join
  bool await_joiner_after = false;    // after the last step, too (its request is then pending as the run ends)
  int stop_rank = -1;                 // this global rank stops itself (SIGSTOP: hung) before --stop-at-step
  int64_t stop_at = -1;
  int64_t wake_after_s = 0;           // > 0: a child process sends the stopped rank SIGCONT after this long
  int64_t throw_at = -1;              // every rank's body throws an error of its own at this step
  int sleep_rank = -1;                // this global rank's loop sleeps (its heartbeat goes on) ...
  int64_t sleep_at = -1;              // ... at this step, for
  int64_t sleep_s = 0;                // this many seconds: a collective times out with no rank gone
  bool retry_after_error = false;     // after an error of the run, call run() once more and print what it says
  int shard_group_size = 0;           // > 0: replica blocks of this size while the world size is a multiple
  int64_t timeout_s = 20;             // the group's collective timeout
  bool scaler_on_rank_1 = false;      // only rank 1 passes a grad_scaler (a bad-input test)
  std::string optimizer = "adam";     // adam, or sgd (with momentum)
  std::string dir;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--refresh-every") a.refresh_every = std::stoll(v);
    else if (k == "--freeze-at") a.freeze_at = std::stoll(v);
    else if (k == "--consolidate-every") a.consolidate_every = std::stoll(v);
    else if (k == "--checkpoint-every") a.checkpoint_every = std::stoll(v);
    else if (k == "--refresh-every-rank-1") a.refresh_every_rank_1 = std::stoll(v);
    else if (k == "--await-joiner-at") a.await_joiner_at = std::stoll(v);
    else if (k == "--await-joiner-after-the-run") a.await_joiner_after = v == "1";
    else if (k == "--stop-rank") a.stop_rank = std::stoi(v);
    else if (k == "--stop-at-step") a.stop_at = std::stoll(v);
    else if (k == "--wake-after") a.wake_after_s = std::stoll(v);
    else if (k == "--throw-at-step") a.throw_at = std::stoll(v);
    else if (k == "--sleep-rank") a.sleep_rank = std::stoi(v);
    else if (k == "--sleep-at-step") a.sleep_at = std::stoll(v);
    else if (k == "--sleep-seconds") a.sleep_s = std::stoll(v);
    else if (k == "--retry-after-error") a.retry_after_error = v == "1";
    else if (k == "--shard-group-size") a.shard_group_size = std::stoi(v);
    else if (k == "--dir") a.dir = v;
    else if (k == "--optimizer") a.optimizer = v;
    else if (k == "--timeout") a.timeout_s = std::stoll(v);
    else if (k == "--scaler-on-rank-1") a.scaler_on_rank_1 = v == "1";
    else if (k == "--min-world-size") a.min_world_size = std::stoi(v);
    else if (k == "--expect-recoveries") a.expect_recoveries = std::stoi(v);
    else if (k == "--expect-world") a.expect_world = std::stoi(v);
    else TORCH_CHECK(false, "unknown option ", k);
  }
  return a;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32),
                               torch::nn::Tanh(), torch::nn::Linear(32, 4));
}

// Global step t's batch: the same on every rank and at every world size.
std::pair<at::Tensor, at::Tensor> global_batch(int64_t t) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + t);
  at::Tensor x = at::randn({kGlobalBatch, 8}, gen);
  at::Tensor y = at::randn({kGlobalBatch, 4}, gen);
  return {x, y};
}

// This rank's contiguous share of the global batch.
std::pair<int64_t, int64_t> share(int rank, int world) {
  return {kGlobalBatch * rank / world, kGlobalBatch * (rank + 1) / world};
}

at::Tensor loss_of(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y) {
  return (model->forward(x) - y).pow(2).sum() / static_cast<double>(kGlobalBatch);
}

void set_trainable(torch::nn::Sequential& model, int64_t t, int64_t freeze_at) {
  const bool first = freeze_at < 0 || t < freeze_at;
  for (auto& p : model[0]->parameters()) p.requires_grad_(first);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    auto group = init_process_group(InitOptions().timeout(std::chrono::seconds(args.timeout_s)));
    auto model = make_model();
    TORCH_CHECK(args.optimizer == "adam" || args.optimizer == "sgd", "--optimizer: adam or sgd, got ", args.optimizer);
    const bool sgd = args.optimizer == "sgd";
    const auto adam = torch::optim::AdamOptions(1e-2);
    const auto sgd_options = torch::optim::SGDOptions(5e-2).momentum(0.9);

    // Each rank's share of a step differs (checked once, at the start's world size).
    {
      auto [lo, hi] = share(group->rank(), group->size());
      const at::Tensor mine = global_batch(0).first.slice(0, lo, hi);
      const double checksum = mine.sum().item<double>();
      auto all = group->allgather_ints({static_cast<int64_t>(std::llround(checksum * 1e6))});
      std::set<int64_t> distinct;
      for (const auto& v : all) distinct.insert(v[0]);
      TORCH_CHECK(static_cast<int>(distinct.size()) == group->size(), "the ranks' data are not all different");
    }

    ShardedGradScaler scaler;  // passed by rank 1 alone under --scaler-on-rank-1
    Resilient run(
        group, model.ptr(),
        [&](std::shared_ptr<ProcessGroup> g) {
          const int b = args.shard_group_size;
          const bool blocks = b > 0 && g->size() > b && g->size() % b == 0;
          return std::make_unique<OSS>(model->parameters(),
                                       sgd ? optimizer<torch::optim::SGD>(sgd_options) : optimizer<torch::optim::Adam>(adam),
                                       g, OSSOptions().shard_group_size(blocks ? b : 0));
        },
        [&](OSS& opt) {
          return std::make_unique<ShardedDDP>(
              model, opt, ShardedDDPOptions().reduce_bucket_bytes(512).grad_scaling(GradScaling::kSum));
        },
        ResilienceOptions()
            .refresh_every(group->rank() == 1 && args.refresh_every_rank_1 >= 0 ? args.refresh_every_rank_1
                                                                                 : args.refresh_every)
            .min_world_size(args.min_world_size)
            .grad_scaler(args.scaler_on_rank_1 && group->rank() == 1 ? &scaler : nullptr));
    if (run.rank() == 0 && run.start_step() == 0) std::cout << "resilience: " << run.describe() << std::endl;

    if (run.start_step() > 0) {
      std::cout << "joined: global rank " << run.group().global_rank() << " at step " << run.start_step()
                << ", world size " << run.world_size() << std::endl;
    }
    // The callbacks run on every survivor before the recovery reaches the loop.
    std::optional<int64_t> called_back;
    run.on_recovery([&](const Recovery& rec) { called_back = rec.resume_step; });
    // Each survivor receives only the ranges it holds now: never more state than it holds.
    auto report = [&](const Recovery& rec) {
      TORCH_CHECK(called_back == rec.resume_step, "global rank ", run.group().global_rank(),
                  ": on_recovery's callback did not run before the recovery to step ", rec.resume_step, " returned");
      called_back.reset();
      const int64_t holds = run.optimizer().local_state_bytes() + run.optimizer().local_master_bytes();
      TORCH_CHECK(rec.state_bytes_received <= holds, "global rank ", run.group().global_rank(), " received ",
                  rec.state_bytes_received, " bytes of optimizer state in the recovery but holds ", holds);
      std::cout << "recovered: " << rec.to_string() << std::endl;
      std::cout << "state received: " << rec.state_bytes_received << " bytes, holds " << holds << std::endl;
    };
    bool awaited = false;
    for (int64_t t = run.start_step(); t < args.steps;) {
      if (t == args.await_joiner_at && !awaited) {
        // The rendezvous store (the first group's): a replacement's request is key shardopt/join/1.
        group->store()->wait({"shardopt/join/1"}, std::chrono::seconds(60));
        awaited = true;
      }
      if (group->global_rank() == args.stop_rank && t == args.stop_at) {  // hung from here on
        std::cout << "stopping at " << std::chrono::steady_clock::now().time_since_epoch().count() << std::endl;
        if (args.wake_after_s > 0 && ::fork() == 0) {  // the alarm clock: wakes the stopped parent
          std::this_thread::sleep_for(std::chrono::seconds(args.wake_after_s));
          ::kill(::getppid(), SIGCONT);
          ::_exit(0);
        }
        std::raise(SIGSTOP);
      }
      set_trainable(model, t, args.freeze_at);
      if (group->global_rank() == args.sleep_rank && t == args.sleep_at) {
        std::this_thread::sleep_for(std::chrono::seconds(args.sleep_s));
      }
      StepResult r;
      try {
        r = run.step(t, [&] {
          // Not a failure of the group: Resilient rethrows it as it was.
          if (t == args.throw_at) throw std::invalid_argument("the body's own error at step " + std::to_string(t));
          auto [x, y] = global_batch(t);
          auto [lo, hi] = share(run.rank(), run.world_size());
          run.optimizer().zero_grad();
          at::Tensor out = run.ddp()->forward(x.slice(0, lo, hi));
          ((out - y.slice(0, lo, hi)).pow(2).sum() / static_cast<double>(kGlobalBatch)).backward();
        });
      } catch (const c10::Error&) {
        if (args.retry_after_error) {  // what the run says when it is asked to go on
          try {
            run.run(t, [] {});
          } catch (const c10::Error& again) {
            std::cout << "asked again: " << again.what_without_backtrace() << std::endl;
          }
        }
        throw;
      }
      if (r.recovery) {
        report(*r.recovery);
        std::cout << "recovered at " << std::chrono::steady_clock::now().time_since_epoch().count() << std::endl;
      }
      if (r.admission) std::cout << "admission: " << r.admission->to_string() << std::endl;
      t = r.next_step;
      if (r.recovery) continue;
      if (args.consolidate_every > 0 && t % args.consolidate_every == 0) {
        if (auto rec = run.run(t, [&] { run.optimizer().consolidate_state_dict(0); })) {
          report(*rec);
          t = rec->resume_step;
        }
      }
      if (args.checkpoint_every > 0 && t % args.checkpoint_every == 0) {
        if (auto rec = run.run(t, [&] {
              TrainingState state;
              state.step = t;
              save_checkpoint(args.dir + "/step.ckpt", *model, run.optimizer(), state);
            })) {
          report(*rec);
          t = rec->resume_step;
        } else if (auto rec = run.run(t, [&] {
                     // Loads what it just saved (the same values): a death in the load is survived.
                     TORCH_CHECK(load_checkpoint(args.dir + "/step.ckpt", *model, run.optimizer()).step == t,
                                 "the checkpoint loaded is not the one saved at step ", t);
                   })) {
          report(*rec);
          t = rec->resume_step;
        }
      }
    }

    if (args.await_joiner_after) {
      std::cout << "loop done" << std::endl;
      group->store()->wait({"shardopt/join/1"}, std::chrono::seconds(60));
    }

    // The reference: one process, plain torch::optim (Adam or SGD), the whole global batch of every step.
    auto reference = make_model();
    std::unique_ptr<torch::optim::Optimizer> ref_opt;
    if (sgd) {
      ref_opt = std::make_unique<torch::optim::SGD>(reference->parameters(), sgd_options);
    } else {
      ref_opt = std::make_unique<torch::optim::Adam>(reference->parameters(), adam);
    }
    for (int64_t t = 0; t < args.steps; ++t) {
      set_trainable(reference, t, args.freeze_at);
      ref_opt->zero_grad(true);
      auto [x, y] = global_batch(t);
      loss_of(reference, x, y).backward();
      ref_opt->step();
    }
    double worst = 0.0;
    auto mine = model->parameters(), ref = reference->parameters();
    for (size_t i = 0; i < mine.size(); ++i) worst = std::max(worst, (mine[i] - ref[i]).abs().max().item<double>());
    TORCH_CHECK(worst <= 1e-5, "global rank ", run.group().global_rank(), ": parameters differ from the reference by ",
                worst, " (> 1e-5)");
    // The host copies hold at least the parameters and buffers, whatever the shards.
    int64_t model_bytes = 0;
    for (const auto& t : model->parameters()) model_bytes += t.numel() * t.element_size();
    for (const auto& t : model->buffers()) model_bytes += t.numel() * t.element_size();
    TORCH_CHECK(run.copy_bytes() >= model_bytes, "global rank ", run.group().global_rank(), ": copy_bytes() is ",
                run.copy_bytes(), ", less than the parameters and buffers it copies (", model_bytes, " bytes)");
    const int recoveries = static_cast<int>(run.recoveries().size());
    TORCH_CHECK(args.expect_recoveries < 0 || recoveries == args.expect_recoveries, "global rank ",
                run.group().global_rank(), ": expected ", args.expect_recoveries, " recoveries, got ", recoveries);
    TORCH_CHECK(args.expect_world < 0 || run.world_size() == args.expect_world, "global rank ",
                run.group().global_rank(), ": expected to end at world size ", args.expect_world, ", got ",
                run.world_size());
    std::cout << "survivor global rank " << run.group().global_rank() << " (rank " << run.rank() << " of "
              << run.world_size() << "): " << recoveries << " recoveries, parameters within " << worst
              << " of the reference" << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "survive_worker: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "survive_worker: " << e.what() << std::endl;
    return 1;
  }
}

// One rank of the multi-process tests, started by tools/launch (env:// rendezvous).
//
//   mp_worker oss_parity     OSS(Adam, SGD) vs the all-reduce reference, 10 steps
//   mp_worker ddp_parity     OSS + ShardedDDP vs the all-reduce reference, with freezing
//   mp_worker fail_rank R    rank R exits with code 3; the others wait in a collective
//   mp_worker checkpoint_writer PATH   writes checkpoints to PATH without end (no group)
//   mp_worker async_saves PATH       saves to PATH with save_checkpoint_async without end, a 32 MB
//                            buffer in the module; prints "saved K" once save K is on disk
//   mp_worker sharded_saves PATH N     N steps of the tiny net, a sharded checkpoint to PATH after
//                            each (TrainingState step k); rank 0 writes the parameters and
//                            the consolidated optimizer state it saved to PATH.params-k
//   mp_worker hello          one all-reduce; prints rank, world size, local rank
//   mp_worker rng_resume DIR save|load|load_threads   each rank's random-number state through a
//                            checkpoint (load_threads: two thread ranks in this process)
//   mp_worker hold           one all-reduce, then the group stays open until stdin closes
//   mp_worker abort_after_a_line   prints one line through C stdio, then aborts
//   mp_worker die_in PHASE R rank R kills itself with SIGKILL in PHASE at step 2
//   mp_worker soak STEPS DIR  a long run: memory, threads, descriptors and parity (tools/soak.sh)
//   mp_worker wire_bytes     bytes each rank writes to the network per step: OSS + ShardedDDP
//                            against an all-reduce of the gradients (DDP's exchange), and on
//                            bf16 and int8 wires against the formula; Muon's rows of matrices of
//                            uneven sizes against a ring all-reduce
#include <shardopt/checkpoint/async_save.h>
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <csignal>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <tuple>
#include <fstream>
#include <functional>
#include <iostream>

namespace optim = torch::optim;
using namespace shardopt;

namespace {

void oss_parity(ProcessGroup& g, std::shared_ptr<ProcessGroup> group, const char* name, OptimizerFactory factory) {
  auto ref = shardopt::testing::make_params(), mine = shardopt::testing::make_params();
  auto ref_opt = factory({optim::OptimizerParamGroup(ref)});
  OSS oss(mine, factory, group);
  for (int step = 0; step < 10; ++step) {
    auto data = shardopt::testing::rank_data(step, g.rank(), 4);
    if (step == 0) TORCH_CHECK(shardopt::testing::differs_across_ranks(data.x, g), "each rank's data must differ");
    ref_opt->zero_grad(true);
    oss.zero_grad(true);
    shardopt::testing::loss(ref, data, 4).backward();
    shardopt::testing::loss(mine, data, 4).backward();
    shardopt::testing::allreduce_grads(ref, g);
    shardopt::testing::allreduce_grads(mine, g);
    ref_opt->step();
    oss.step();
    for (size_t i = 0; i < mine.size(); ++i) {
      const double d = shardopt::testing::rel_diff(mine[i], ref[i]);
      TORCH_CHECK(d <= 1e-6, name, ": parameter ", i, " differs from the reference by ", d, " after step ", step);
    }
    TORCH_CHECK(shardopt::testing::same_on_all_ranks(mine, g), name, ": ranks diverged after step ", step);
  }
  std::cout << name << " parity ok on rank " << g.rank() << " of " << g.size() << std::endl;
}

struct Net : torch::nn::Module {
  Net() {
    auto p = shardopt::testing::make_params();
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter("p" + std::to_string(i), p[i]));
  }
  at::Tensor forward(at::Tensor x) { return shardopt::testing::output(params, x); }
  std::vector<at::Tensor> params;
};

// Background saves without end, each of a module with a 32 MB buffer holding the save's number
// (for the test that stops a process with SIGTERM while a save is written).
void async_saves(std::shared_ptr<ProcessGroup> group, const std::string& path) {
  auto net = std::make_shared<Net>();
  at::Tensor blob = net->register_buffer("blob", at::zeros({8 << 20}));
  OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  PendingCheckpoint pending;
  for (int64_t k = 1;; ++k) {
    blob.fill_(static_cast<float>(k));
    TrainingState state;
    state.step = k;
    pending = save_checkpoint_async(path, *net, oss, state);  // (finishes save k - 1 first)
    if (k > 1) std::cout << "saved " << k - 1 << std::endl;
  }
}

// One step of the tiny net and one sharded checkpoint, saved in the background and waited for
// (`async`) or not: "saved" on success; an error otherwise.
void one_sharded_save(std::shared_ptr<ProcessGroup> group, const std::string& path, bool async) {
  auto net = std::make_shared<Net>();
  OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  ShardedDDP ddp(net, oss);
  auto data = shardopt::testing::rank_data(1, group->rank(), 4);
  oss.zero_grad(true);
  shardopt::testing::loss_of(ddp.forward(data.x), data, 4 * group->size()).backward();
  oss.step();
  const auto options = CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded);
  if (async) {
    save_checkpoint_async(path, ddp, oss, TrainingState(), options).wait();
  } else {
    save_checkpoint(path, ddp, oss, TrainingState(), options);
  }
  std::cout << "saved" << std::endl;
}

// Steps of the tiny net with a sharded checkpoint after each (for the test that kills a rank
// between a save's parts and its main file).
void sharded_saves(std::shared_ptr<ProcessGroup> group, const std::string& path, int saves) {
  auto net = std::make_shared<Net>();
  OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  ShardedDDP ddp(net, oss);
  for (int k = 1; k <= saves; ++k) {
    auto data = shardopt::testing::rank_data(k, group->rank(), 4);
    oss.zero_grad(true);
    shardopt::testing::loss_of(ddp.forward(data.x), data, 4 * group->size()).backward();
    oss.step();
    oss.finish_param_sync();
    oss.consolidate_state_dict(0);
    if (group->rank() == 0) {
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
      c10::List<at::Tensor> params;
      for (const auto& p : net->params) params.push_back(p.detach().clone());
      d.insert("params", params);
      d.insert("optimizer", oss.state_dict());
      write_checkpoint_file(path + ".params-" + std::to_string(k), d);
    }
    TrainingState state;
    state.step = k;
    save_checkpoint(path, *net, oss, state, CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded));
    std::cout << "saved " << k << std::endl;
  }
}

// A checkpoint restores each rank's own random-number state. `save`: seeds 1000 + rank, draws,
// saves a checkpoint, then draws what a run that went on would draw and keeps it in
// DIR/draws-<rank>. `load`: fresh objects and another seed, loads the checkpoint, draws, and
// compares with what the run that went on drew, bit for bit; the ranks' draws differ.
void rng_resume(std::shared_ptr<ProcessGroup> group, const std::string& dir, const std::string& phase) {
  auto net = std::make_shared<Net>();
  OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  const std::string path = dir + "/rng.ckpt", mine = dir + "/draws-" + std::to_string(group->rank());
  if (phase == "save") {
    at::manual_seed(1000 + group->rank());
    at::randn({16});
    save_checkpoint(path, *net, oss, TrainingState());
    write_checkpoint_file(mine, at::randn({16}));
    std::cout << "saved" << std::endl;
    return;
  }
  if (phase == "load_threads") {
    // Two ranks as threads of this one process load the two processes' checkpoint: they share
    // one generator, which only rank 0 sets, to rank 0's saved state (a rank 1 setting it too,
    // before or after, would leave rank 1's draws or a race).
    const at::Tensor expected = read_checkpoint_file(dir + "/draws-0").toTensor();
    for (int round = 0; round < 10; ++round) {
      shardopt::testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> threads) {
        auto thread_net = std::make_shared<Net>();
        OSS thread_oss(thread_net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), threads);
        if (threads->rank() == 1) at::manual_seed(7);
        load_checkpoint(path, *thread_net, thread_oss);
      });
      TORCH_CHECK(at::randn({16}).equal(expected), "round ", round, ": two thread ranks' load left other numbers "
                  "than rank 0's saved state");
    }
    std::cout << "rng ok for thread ranks" << std::endl;
    return;
  }
  at::manual_seed(7);
  load_checkpoint(path, *net, oss);
  const at::Tensor drawn = at::randn({16});
  TORCH_CHECK(drawn.equal(read_checkpoint_file(mine).toTensor()), "rank ", group->rank(),
              " drew other numbers after the load than the run that went on");
  at::Tensor others = drawn.clone();
  group->broadcast(others, 0);
  TORCH_CHECK(group->rank() == 0 || !drawn.equal(others), "rank ", group->rank(), " drew rank 0's numbers");
  std::cout << "rng ok on rank " << group->rank() << std::endl;
}

void ddp_parity(std::shared_ptr<ProcessGroup> group) {
  ProcessGroup& g = *group;
  auto net = std::make_shared<Net>();
  auto ref = shardopt::testing::clone_params(net->params);
  optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
  OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(160));
  for (int step = 0; step < 8; ++step) {
    const bool frozen = step >= 3 && step < 5;  // a whole layer, frozen then unfrozen
    for (int i : {2, 3}) net->params[i].requires_grad_(!frozen), ref[i].requires_grad_(!frozen);
    auto data = shardopt::testing::rank_data(step, g.rank(), 4);
    if (step == 0) TORCH_CHECK(shardopt::testing::differs_across_ranks(data.x, g), "each rank's data must differ");
    ref_opt.zero_grad(true);
    ddp.zero_grad(true);
    shardopt::testing::loss(ref, data, 4).backward();
    shardopt::testing::allreduce_grads(ref, g);
    shardopt::testing::loss_of(ddp.forward(data.x), data, 4).backward();
    ref_opt.step();
    oss.step();
    for (size_t i = 0; i < ref.size(); ++i) {
      const double d = shardopt::testing::rel_diff(net->params[i], ref[i]);
      TORCH_CHECK(d <= 1e-5, "ShardedDDP: parameter ", i, " differs from the reference by ", d, " after step ", step);
    }
    TORCH_CHECK(shardopt::testing::same_on_all_ranks(net->params, g), "ShardedDDP: ranks diverged after step ", step);
  }
  std::cout << "ShardedDDP parity ok on rank " << g.rank() << " of " << g.size() << std::endl;
}

// A training loop in which `victim` kills itself with SIGKILL at step 2: before its forward
// (the others' trainability check is then in flight), in the middle of backward (bucket
// reductions in flight), before the step's parameter sync, or before consolidation. The others
// must fail with an error naming it.
void die_in(std::shared_ptr<ProcessGroup> group, const std::string& phase, int victim) {
  auto net = std::make_shared<Net>();
  OSS oss(net->parameters(), shardopt::optimizer<optim::Adam>(optim::AdamOptions(1e-2)), group);
  ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(0));  // a bucket per tensor
  const bool dies = group->rank() == victim;
  for (int step = 0; step < 4; ++step) {
    auto data = shardopt::testing::rank_data(step, group->rank(), 4);
    ddp.zero_grad();
    if (dies && step == 2 && phase == "forward") std::raise(SIGKILL);
    at::Tensor out = ddp.forward(data.x);
    if (dies && step == 2 && phase == "backward") {
      // In the middle of backward: the first layer's gradient comes last, once the reductions of
      // the later layers' buckets are in flight.
      net->params[0].register_hook([](const at::Tensor& grad) {
        std::raise(SIGKILL);
        return grad;
      });
    }
    shardopt::testing::loss_of(out, data, 4).backward();
    if (dies && step == 2 && phase == "step") std::raise(SIGKILL);
    oss.step();
    if (dies && step == 2 && phase == "consolidation") std::raise(SIGKILL);
    if (step == 2) oss.consolidate_state_dict(0);
  }
  TORCH_CHECK(false, "rank ", group->rank(), " finished although rank ", victim, " was killed in ", phase);
}

int64_t count_entries(const char* dir) {
  int64_t n = 0;
  if (DIR* d = ::opendir(dir)) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

double rss_mib() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// A long run: OSS + ShardedDDP against the all-reduce reference, w2/b2 frozen or unfrozen every
// 500 steps, a checkpoint every 2,000; resident memory, threads and file descriptors recorded
// after warm-up (step 1,000) and at the end, parity checked every 2,000 steps and at the end.
void soak(std::shared_ptr<ProcessGroup> group, int64_t steps, const std::string& dir) {
  auto& g = *group;
  ::mkdir(dir.c_str(), 0755);
  auto net = std::make_shared<Net>();
  auto ref = shardopt::testing::make_params();
  optim::Adam ref_opt(ref, optim::AdamOptions(1e-3));
  OSS oss(net->parameters(), shardopt::optimizer<optim::Adam>(optim::AdamOptions(1e-3)), group);
  ShardedDDP ddp(net, oss);
  double rss_warm = 0, rss_max_after = 0;
  int64_t threads_warm = 0, fds_warm = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const bool frozen = (step / 500) % 2 == 1;
    for (int i : {2, 3}) net->params[i].requires_grad_(!frozen), ref[i].requires_grad_(!frozen);
    auto data = shardopt::testing::rank_data(step, g.rank(), 4);
    ddp.zero_grad();
    shardopt::testing::loss_of(ddp.forward(data.x), data, 4).backward();
    oss.step();
    ref_opt.zero_grad(true);
    shardopt::testing::loss(ref, data, 4).backward();
    shardopt::testing::allreduce_grads(ref, g);
    ref_opt.step();
    if ((step + 1) % 2000 == 0 || step + 1 == steps) {
      TrainingState state;
      state.step = step + 1;
      save_checkpoint(dir + "/soak.ckpt", *net, oss, state);
      for (size_t i = 0; i < ref.size(); ++i) {
        const double d = shardopt::testing::rel_diff(net->params[i], ref[i]);
        TORCH_CHECK(d <= 1e-4, "soak: parameter ", i, " differs from the reference by ", d, " after step ", step + 1);
      }
    }
    if (step + 1 == 1000) {
      rss_warm = rss_mib();
      threads_warm = count_entries("/proc/self/task");
      fds_warm = count_entries("/proc/self/fd");
    }
    if (step + 1 > 1000) rss_max_after = std::max(rss_max_after, rss_mib());
  }
  std::printf("{\"rank\": %d, \"steps\": %lld, \"rss_mib_at_1000\": %.1f, \"rss_mib_max_after\": %.1f, "
              "\"rss_growth\": %.4f, \"threads\": [%lld, %lld], \"fds\": [%lld, %lld], \"parity\": \"ok\"}\n",
              g.rank(), static_cast<long long>(steps), rss_warm, rss_max_after, rss_max_after / rss_warm - 1,
              static_cast<long long>(threads_warm), static_cast<long long>(count_entries("/proc/self/task")),
              static_cast<long long>(fds_warm), static_cast<long long>(count_entries("/proc/self/fd")));
  std::fflush(stdout);
  // The bounds docs/reliability.md states: resident memory grows at most 5% after warm-up, and no
  // thread or descriptor is added.
  TORCH_CHECK(steps > 1000, "soak: needs more than the 1,000 warm-up steps, got ", steps);
  TORCH_CHECK(rss_max_after <= 1.05 * rss_warm, "soak: rank ", g.rank(), "'s resident memory grew from ", rss_warm,
              " MiB at step 1000 to ", rss_max_after, " MiB (more than 5%)");
  TORCH_CHECK(count_entries("/proc/self/task") == threads_warm, "soak: rank ", g.rank(), " had ", threads_warm,
              " threads at step 1000 and ", count_entries("/proc/self/task"), " at the end");
  TORCH_CHECK(count_entries("/proc/self/fd") == fds_warm, "soak: rank ", g.rank(), " had ", fds_warm,
              " file descriptors at step 1000 and ", count_entries("/proc/self/fd"), " at the end");
}

}  // namespace

// Eight 512 x 512 layers with biases (2.1M parameters): gradients large enough that the bytes
// of control messages (trainability checks, heartbeats) do not matter.
struct WideNet : torch::nn::Module {
  WideNet() {
    at::manual_seed(5);
    for (int i = 0; i < 8; ++i) {
      ws.push_back(register_parameter("w" + std::to_string(i), (at::randn({512, 512}) * 0.04).requires_grad_()));
      bs.push_back(register_parameter("b" + std::to_string(i), at::zeros({512}).requires_grad_()));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < ws.size(); ++i) x = at::tanh(at::linear(x, ws[i], bs[i]));
    return x;
  }
  std::vector<at::Tensor> ws, bs;
};

// Mean bytes written per call of `step` over `steps` calls, after one unmeasured call.
double written_per_step(const std::function<void()>& step, int steps) {
  step();
  const int64_t before = shardopt::testing::written_bytes();
  for (int s = 0; s < steps; ++s) step();
  return static_cast<double>(shardopt::testing::written_bytes() - before) / steps;
}

// Matrices of four sizes (262,144 down to 8,192 elements): Muon's rows of whole matrices, each as
// long as its bucket's longest, then carry padding (Note [Rows with padding]).
struct UnevenNet : torch::nn::Module {
  UnevenNet() {
    const int64_t sizes[][2] = {{512, 512}, {64, 512}, {512, 64}, {16, 512}};
    for (size_t i = 0; i < 4; ++i) {
      ws.push_back(register_parameter("w" + std::to_string(i), (at::randn({sizes[i][0], sizes[i][1]}) * 0.04).requires_grad_()));
      bs.push_back(register_parameter("b" + std::to_string(i), at::zeros({sizes[i][0]}).requires_grad_()));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < ws.size(); ++i) x = at::tanh(at::linear(x, ws[i], bs[i]));
    return x;
  }
  std::vector<at::Tensor> ws, bs;
};

void wire_bytes(std::shared_ptr<ProcessGroup> group) {
  const int rank = group->rank(), world = group->size();
  auto data = [&](int step) { return at::randn({4, 512}) * (1 + rank) + step; };
  int step = 0;
  // OSS + ShardedDDP with `wire` on the gradients and the parameters.
  auto sharded_on = [&](Wire wire) {
    auto sharded_net = std::make_shared<WideNet>();
    OSS oss(sharded_net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), group,
            OSSOptions().param_wire(wire));
    ShardedDDP ddp(sharded_net, oss, ShardedDDPOptions().gradient_wire(wire));
    return written_per_step([&] {
      ddp.zero_grad();
      ddp.forward(data(step++)).pow(2).mean().backward();
      oss.step();
    }, 3);
  };
  const double sharded = sharded_on(Wire::kExact);
  const double bf16 = sharded_on(Wire::kBFloat16);
  const double int8 = sharded_on(Wire::kInt8);
  // Muon on the matrices of uneven sizes, AdamW on the biases.
  auto uneven = std::make_shared<UnevenNet>();
  OSS muon_oss({{uneven->ws, optimizer<Muon>(MuonOptions(0.02))},
                {uneven->bs, optimizer<optim::AdamW>(optim::AdamWOptions(1e-3))}},
               group);
  ShardedDDP muon_ddp(uneven, muon_oss);
  const double muon = written_per_step([&] {
    muon_ddp.zero_grad();
    muon_ddp.forward(data(step++)).pow(2).mean().backward();
    muon_oss.step();
  }, 3);
  int64_t uneven_bytes = 0;
  for (const auto& p : uneven->parameters()) uneven_bytes += 4 * p.numel();
  // DDP's exchange: every gradient all-reduced (in one flat buffer) and averaged on every rank.
  auto plain_net = std::make_shared<WideNet>();
  optim::Adam adam(plain_net->parameters(), optim::AdamOptions(1e-3));
  const double allreduce = written_per_step([&] {
    adam.zero_grad();
    plain_net->forward(data(step++)).pow(2).mean().backward();
    std::vector<at::Tensor> grads;
    for (auto& p : plain_net->parameters()) grads.push_back(p.grad().reshape(-1));
    at::Tensor flat = at::cat(grads);
    group->allreduce(flat);
    flat.div_(world);
    int64_t at = 0;
    for (auto& p : plain_net->parameters()) p.mutable_grad().view(-1).copy_(flat.narrow(0, at, p.numel())), at += p.numel();
    adam.step();
  }, 3);
  at::Tensor all = at::zeros({5 * world}, at::kDouble);
  all.narrow(0, 5 * rank, 5).copy_(at::tensor({sharded, allreduce, bf16, int8, muon}, at::kDouble));
  group->allreduce(all);
  double total_sharded = 0, total_allreduce = 0, total_bf16 = 0, total_int8 = 0, total_muon = 0;
  for (int r = 0; r < world; ++r) {
    total_sharded += all[5 * r].item<double>();
    total_allreduce += all[5 * r + 1].item<double>();
    total_bf16 += all[5 * r + 2].item<double>();
    total_int8 += all[5 * r + 3].item<double>();
    total_muon += all[5 * r + 4].item<double>();
    if (rank == 0) {
      std::printf("rank %d: %.0f bytes per step sharded (bf16 wires %.0f, int8 wires %.0f), %.0f all-reduce; Muon "
                  "%.0f\n", r, all[5 * r].item<double>(), all[5 * r + 2].item<double>(), all[5 * r + 3].item<double>(),
                  all[5 * r + 1].item<double>(), all[5 * r + 4].item<double>());
    }
  }
  // Muon's rows move only what their matrices occupy, so they write what plain data
  // parallelism's ring all-reduce does, 2(N-1) times the gradients' bytes on all ranks together,
  // not the padding of the shorter rows.
  const double muon_allreduce = 2.0 * (world - 1) * static_cast<double>(uneven_bytes);
  TORCH_CHECK(total_muon <= muon_allreduce + 65536, "OSS + ShardedDDP with Muon wrote ", total_muon,
              " bytes per step on all ranks, more than a ring all-reduce's ", muon_allreduce);
  // The compressed wires against the formula: every gradient and parameter element the exact
  // wire sends in 4 bytes travels in 2 (bf16) or in 1 plus a 4-byte scale per block of 256
  // (int8); control messages and each row's exact flags add far less than 64 KiB.
  for (const auto& [name, total, bytes] : {std::tuple{"bf16", total_bf16, 2.0}, std::tuple{"int8", total_int8, 1.0 + 4.0 / 256}}) {
    const double expected = total_sharded * bytes / 4.0;
    TORCH_CHECK(std::abs(total - expected) <= 0.01 * expected + 65536, "OSS + ShardedDDP on ", name, " wires wrote ",
                total, " bytes per step on all ranks, not the ", expected, " of ", bytes, " bytes an element");
  }
  const double gradient_bytes = 4.0 * 8 * (512 * 512 + 512);
  // Both move 2(N-1)/N of the gradients per rank; what control messages add is far below 64 KiB.
  TORCH_CHECK(total_allreduce >= 2.0 * (world - 1) * gradient_bytes * 0.99, "the all-reduce wrote ", total_allreduce,
              " bytes per step on all ranks, less than a ring all-reduce must: is /proc/self/io counting?");
  TORCH_CHECK(total_sharded <= total_allreduce + 65536, "OSS + ShardedDDP wrote ", total_sharded,
              " bytes per step on all ranks, more than the all-reduce's ", total_allreduce);
  if (rank == 0) {
    std::printf("wire bytes ok at world %d: %.0f sharded <= %.0f all-reduce; bf16 wires %.0f (%.3fx), int8 wires %.0f "
                "(%.3fx); Muon %.0f <= %.0f\n", world, total_sharded, total_allreduce, total_bf16,
                total_bf16 / total_sharded, total_int8, total_int8 / total_sharded, total_muon, muon_allreduce);
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: mp_worker oss_parity | fail_rank R" << std::endl;
    return 2;
  }
  if (std::strcmp(argv[1], "abort_after_a_line") == 0) {
    // One line through C stdio (block-buffered into a pipe unless the launcher line-buffers it),
    // then an abort, which flushes nothing.
    std::printf("the last line before the abort\n");
    std::abort();
  }
  try {
    at::set_num_threads(1);
    if (std::strcmp(argv[1], "checkpoint_writer") == 0 && argc > 2) {
      // Writes checkpoints to argv[2] without end, each 32 MB, one line after each: for the test
      // that kills a process in the middle of a save.
      for (int64_t count = 1;; ++count) {
        c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
        d.insert("count", count);
        d.insert("blob", at::full({8 << 20}, static_cast<float>(count)));
        write_checkpoint_file(argv[2], d);
        std::cout << "saved " << count << std::endl;
      }
    }
    // SHARDOPT_TEST_TIMEOUT_S: the group's timeout (default 60 s).
    const char* timeout_env = std::getenv("SHARDOPT_TEST_TIMEOUT_S");
    const auto timeout = std::chrono::seconds(timeout_env ? std::atoi(timeout_env) : 60);
    auto group = init_process_group(InitOptions().backend("gloo").timeout(timeout));
    if (std::strcmp(argv[1], "wire_bytes") == 0) {
      wire_bytes(group);
      return 0;
    }
    if (std::strcmp(argv[1], "hello") == 0) {
      // One all-reduce of the ranks' numbers: the group works under this launcher's variables.
      at::Tensor t = at::full({1}, static_cast<double>(group->rank()), at::kDouble);
      group->allreduce(t);
      std::cout << "rank " << group->rank() << " of " << group->size() << ", local rank " << local_rank()
                << ": sum of ranks " << t.item<double>() << std::endl;
      return 0;
    }
    if (std::strcmp(argv[1], "soak") == 0 && argc > 3) {
      soak(group, std::atoll(argv[2]), argv[3]);
      return 0;
    }
    if (std::strcmp(argv[1], "die_in") == 0 && argc > 3) {
      die_in(group, argv[2], std::atoi(argv[3]));
      return 0;
    }
    if (std::strcmp(argv[1], "oss_parity") == 0) {
      oss_parity(*group, group, "Adam", optimizer<optim::Adam>(optim::AdamOptions(1e-2)));
      oss_parity(*group, group, "SGD", optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9)));
      return 0;
    }
    if (std::strcmp(argv[1], "ddp_parity") == 0) {
      ddp_parity(group);
      return 0;
    }
    if (std::strcmp(argv[1], "async_saves") == 0 && argc > 2) {
      async_saves(group, argv[2]);
      return 0;
    }
    if (std::strcmp(argv[1], "hold") == 0) {
      // One all-reduce, then the group stays open until stdin closes (the test reads the
      // sockets meanwhile).
      at::Tensor t = at::ones({1});
      group->allreduce(t);
      std::cout << "holding on rank " << group->rank() << std::endl;
      std::string line;
      std::getline(std::cin, line);
      return 0;
    }
    if (std::strcmp(argv[1], "rng_resume") == 0 && argc > 3) {
      rng_resume(group, argv[2], argv[3]);
      return 0;
    }
    if (std::strcmp(argv[1], "one_sharded_save") == 0 && argc > 3) {
      one_sharded_save(group, argv[2], std::strcmp(argv[3], "async") == 0);
      return 0;
    }
    if (std::strcmp(argv[1], "sharded_saves") == 0 && argc > 3) {
      sharded_saves(group, argv[2], std::atoi(argv[3]));
      return 0;
    }
    if (std::strcmp(argv[1], "fail_rank") == 0 && argc > 2) {
      // A crash: no teardown, so this rank is the first to exit.
      if (group->rank() == std::atoi(argv[2])) std::_Exit(3);
      at::Tensor t = at::ones({1});
      group->allreduce(t);  // never completes: the launcher must stop this rank
      return 0;
    }
    std::cerr << "mp_worker: unknown command " << argv[1] << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << std::endl;  // one line, as a user sees it
    return 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

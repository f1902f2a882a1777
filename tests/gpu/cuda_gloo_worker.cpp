// One rank of OSS and ShardedDDP on CUDA parameters over Gloo: every rank its own process (under
// tools/launch), all on the one GPU, the CUDA tensors staged through pinned host memory (Note
// [Staging] in csrc/comm/process_group.cpp). NCCL refuses two ranks on one device, so this is how
// the CUDA path runs at world sizes above 1 on a machine with one GPU. (Ranks as threads of one
// process cannot do it: autograd runs every CUDA backward of a process on one thread per device,
// where one rank's gradient hook would wait for another rank's backward.)
//
//   cuda_gloo_worker parity | mixed | resume | wires | probe
//
// Exits 77 where no CUDA device is visible (probe: only that, else 0) (ctest reports the test skipped), 0 when every check
// held, 1 with the failed check on stderr.
#include <shardopt/comm/wire.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/mixed_precision.h>
#include <shardopt/testing/introspection.h>

#include "model.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace shardopt;
namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

// 12 -> 16 -> 3, the same initial values on every rank.
torch::nn::Sequential small_net() {
  auto made = torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

// Rank r's batch at step `step`: 4 rows of its own.
std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return {at::randn({4, 12}, gen), at::randn({4, 3}, gen)};
}

Params cpu(const Params& params) {
  Params out;
  for (const auto& p : params) out.push_back(p.detach().cpu());
  return out;
}

optim::AdamOptions adam() { return optim::AdamOptions(1e-2); }

// Every rank learns whether every rank's check held (no rank leaves early for another to wait
// on), and the first failing rank's message is raised everywhere.
void check_everywhere(ProcessGroup& g, bool ok, const std::string& what) {
  at::Tensor t = at::tensor({ok ? 0.0 : 1.0}, at::kDouble);
  g.allreduce(t, Reduction::kMax);
  TORCH_CHECK(t.item<double>() == 0.0, "rank ", g.rank(), ": ", ok ? "another rank failed: " : "", what);
}

// One step of the parity runs: the first layer frozen at steps 2 and 3, this rank's batch through
// ShardedDDP on CUDA with clipping at 0.5; the reference (plain Adam on the CPU) steps the mean of
// every rank's gradients, clipped alike.
void step_both(ProcessGroup& g, int step, torch::nn::Sequential& net, ShardedDDP& ddp, OSS& oss,
               torch::nn::Sequential& ref_net, optim::Adam& ref_opt) {
  const int world = g.size();
  const bool frozen = step >= 2 && step < 4;
  for (auto& p : net[0]->parameters()) p.requires_grad_(!frozen);
  for (auto& p : ref_net[0]->parameters()) p.requires_grad_(!frozen);
  const auto [x, y] = batch(step, g.rank());
  if (step == 0) check_everywhere(g, shardopt::testing::differs_across_ranks(x, g), "every rank's data differs");
  ddp.zero_grad(true);
  ddp.forward(x.cuda()).sub(y.cuda()).pow(2).mean().backward();
  oss.clip_grad_norm(0.5);
  oss.step();
  ref_opt.zero_grad(true);
  for (int r = 0; r < world; ++r) {
    const auto [rx, ry] = batch(step, r);
    ref_net->forward(rx).sub(ry).pow(2).mean().div(world).backward();
  }
  torch::nn::utils::clip_grad_norm_(ref_net->parameters(), 0.5);
  ref_opt.step();
}

// Each rank's data its own: parameters follow torch::optim::Adam on the CPU stepping the mean of
// every rank's gradients, through a freeze and an unfreeze of the first layer with clipping,
// every rank bitwise equal.
void parity(ProcessGroup& g, const std::shared_ptr<ProcessGroup>& group) {
  auto net = small_net(), ref_net = small_net();
  net->to(at::kCUDA);
  OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), group);
  ShardedDDP ddp(net.ptr(), oss);
  Params ref = ref_net->parameters();
  optim::Adam ref_opt(ref, adam());
  for (int step = 0; step < 6; ++step) {
    step_both(g, step, net, ddp, oss, ref_net, ref_opt);
    const Params mine = cpu(net->parameters());
    double worst = 0;
    for (size_t i = 0; i < mine.size(); ++i) worst = std::max(worst, shardopt::testing::rel_diff(mine[i], ref[i]));
    bool on_cuda = true;
    for (const auto& p : net->parameters()) on_cuda = on_cuda && p.is_cuda();
    check_everywhere(g, on_cuda && worst <= 1e-5,
                     "step " + std::to_string(step) + ": parameters on CUDA, within 1e-5 of the reference (" +
                         std::to_string(worst) + ")");
    check_everywhere(g, shardopt::testing::same_on_all_ranks(mine, g), "step " + std::to_string(step) + ": ranks bitwise equal");
  }
}

// bf16 parameters and gradients on the GPU, fp32 masters and Adam state sharded, gradients
// reduced in fp32: the masters follow torch::optim::Adam on fp32 masters stepping the mean of every
// rank's bf16 gradients (computed on the CPU), upcast, through a freeze; each parameter is its
// master rounded. Tolerance 1e-3 relative: the GPU's and the CPU's bf16 products round apart.
void mixed(ProcessGroup& g, const std::shared_ptr<ProcessGroup>& group) {
  const int world = g.size();
  auto net = small_net();
  Params master;
  for (const auto& p : net->parameters()) master.push_back(p.detach().clone().requires_grad_());
  optim::Adam ref_opt(master, adam());
  net->to(at::kCUDA);
  OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), group,
          OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
  ShardedDDP ddp(net.ptr(), oss);
  for (int step = 0; step < 5; ++step) {
    const bool frozen = step == 2;
    for (auto& p : net[0]->parameters()) p.requires_grad_(!frozen);
    const auto [x, y] = batch(step, g.rank());
    ddp.zero_grad(true);
    ddp.forward(x.cuda()).to(at::kFloat).sub(y.cuda()).pow(2).mean().backward();
    oss.step();
    ref_opt.zero_grad(true);
    for (int r = 0; r < world; ++r) {
      Params low;
      for (size_t i = 0; i < master.size(); ++i) {
        low.push_back(master[i].detach().to(at::kBFloat16).requires_grad_(!(frozen && i < 2)));
      }
      const auto [rx, ry] = batch(step, r);
      const at::Tensor h = at::tanh(at::linear(rx.to(at::kBFloat16), low[0], low[1]));
      at::linear(h, low[2], low[3]).to(at::kFloat).sub(ry).pow(2).mean().backward();
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < master.size(); ++i) {
        if (!low[i].grad().defined()) continue;
        const at::Tensor g32 = low[i].grad().to(at::kFloat).div(world);
        master[i].mutable_grad() = master[i].grad().defined() ? master[i].grad() + g32 : g32;
      }
    }
    ref_opt.step();
    oss.consolidate_state_dict(0);
    bool ok = true;
    std::string what = "step " + std::to_string(step) + ": masters within 1e-3, parameters their masters rounded";
    if (g.rank() == 0) {
      const auto sd = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      const Params params = net->parameters();
      for (size_t i = 0; i < master.size(); ++i) {
        const at::Tensor mine = sd.at(static_cast<int64_t>(i)).toTensor().cpu();
        const double d = shardopt::testing::rel_diff(mine, master[i].detach());
        if (d > 1e-3 || !params[i].cpu().equal(mine.to(at::kBFloat16))) {
          ok = false;
          what += " (master " + std::to_string(i) + ": " + std::to_string(d) + ")";
        }
      }
    }
    check_everywhere(g, ok, what);
  }
}

// Saved after 4 steps (the consolidated state and the parameters), loaded into a new model and
// OSS, 2 more steps: bit for bit the parameters of the run that went on.
void resume(ProcessGroup& g, const std::shared_ptr<ProcessGroup>& group) {
  auto train = [&](torch::nn::Sequential& net, ShardedDDP& ddp, OSS& oss, int step) {
    const auto [x, y] = batch(step, g.rank());
    for (auto& p : net[0]->parameters()) p.requires_grad_(step != 1);
    ddp.zero_grad(true);
    ddp.forward(x.cuda()).sub(y.cuda()).pow(2).mean().backward();
    oss.step();
  };
  auto net = small_net();
  net->to(at::kCUDA);
  OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), group);
  ShardedDDP ddp(net.ptr(), oss);
  for (int step = 0; step < 4; ++step) train(net, ddp, oss, step);
  oss.consolidate_state_dict(0);
  const std::vector<char> saved = g.rank() == 0 ? torch::pickle_save(oss.state_dict()) : std::vector<char>{};
  // Every rank loads rank 0's bytes, as from a checkpoint file.
  at::Tensor size = at::tensor({static_cast<int64_t>(saved.size())}, at::kLong);
  g.broadcast(size, 0);
  at::Tensor bytes = at::zeros({size.item<int64_t>()}, at::kByte);
  if (g.rank() == 0) std::memcpy(bytes.data_ptr(), saved.data(), saved.size());
  g.broadcast(bytes, 0);
  const Params at_save = cpu(net->parameters());
  for (int step = 4; step < 6; ++step) train(net, ddp, oss, step);

  auto resumed = small_net();
  {
    at::NoGradGuard no_grad;
    const Params ps = resumed->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(at_save[i]);
  }
  resumed->to(at::kCUDA);
  OSS oss2(resumed->parameters(), optimizer<optim::Adam>(adam()), group);
  ShardedDDP ddp2(resumed.ptr(), oss2);
  const char* data = static_cast<const char*>(bytes.data_ptr());
  oss2.load_state_dict(torch::pickle_load(std::vector<char>(data, data + bytes.numel())));
  for (int step = 4; step < 6; ++step) train(resumed, ddp2, oss2, step);
  const Params a = cpu(net->parameters()), b = cpu(resumed->parameters());
  bool equal = true;
  for (size_t i = 0; i < a.size(); ++i) equal = equal && a[i].equal(b[i]);
  check_everywhere(g, equal, "the resumed run equals the one that went on, bit for bit");
}

// The compressed wires (Note [Gradient wire], Note [Parameter wire], Note [Int8 wire]) on CUDA
// parameters: bf16 and int8 gradients and parameters, int8 with and without error feedback, and
// last the int8 reductions as NCCL takes them (Note [Int8 wire on collectives]: packed and
// summed on the GPU, moved by one all-to-all per bucket), each rank's data its own, through a freeze and an unfreeze with clipping. Every step, every
// rank holds bitwise the same parameters on CUDA; on rank 0 each parameter is its fp32 master
// rounded to bf16, or within half an int8 step of it (max |master| / 254, the largest master of
// any step so far: a frozen parameter keeps the rounding of its last sync); and the parameters
// stay near torch::optim::Adam on the CPU stepping the exact mean gradient (bf16 within 1e-2,
// int8 within 5e-2 relative: the wires' rounding, which Adam's normalisation can magnify on
// small gradients).
void wires(ProcessGroup& g, const std::shared_ptr<ProcessGroup>& group) {
  struct Case {
    Wire wire;
    bool feedback;
    double near;
    bool collectives = false;
  };
  for (const Case c : {Case{Wire::kBFloat16, false, 1e-2}, Case{Wire::kInt8, false, 5e-2}, Case{Wire::kInt8, true, 5e-2},
                       Case{Wire::kInt8, true, 5e-2, true}}) {
    const std::string name = std::string(c.wire == Wire::kInt8 ? "int8" : "bf16") +
                             (c.feedback ? " with error feedback" : "") + (c.collectives ? " on collectives" : "");
    if (c.collectives) shardopt::testing::Introspection::wire_by_collectives(g);  // for the rest of the run
    auto net = small_net(), ref_net = small_net();
    net->to(at::kCUDA);
    OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), group, OSSOptions().param_wire(c.wire));
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(c.wire).error_feedback(c.feedback));
    Params ref = ref_net->parameters();
    optim::Adam ref_opt(ref, adam());
    double largest = 0;  // on rank 0: the largest master element of any step so far
    for (int step = 0; step < 6; ++step) {
      const std::string at = name + ", step " + std::to_string(step) + ": ";
      step_both(g, step, net, ddp, oss, ref_net, ref_opt);
      const Params mine = cpu(net->parameters());
      bool on_cuda = true;
      for (const auto& p : net->parameters()) on_cuda = on_cuda && p.is_cuda() && p.scalar_type() == at::kFloat;
      check_everywhere(g, on_cuda, at + "fp32 parameters on CUDA");
      check_everywhere(g, shardopt::testing::same_on_all_ranks(mine, g), at + "ranks bitwise equal");
      double near = 0;
      for (size_t i = 0; i < mine.size(); ++i) near = std::max(near, shardopt::testing::rel_diff(mine[i], ref[i]));
      check_everywhere(g, near <= c.near, at + "within " + std::to_string(c.near) + " of the exact reference (" + std::to_string(near) + ")");
      oss.consolidate_state_dict(0);
      bool ok = true;
      std::string what = at + "parameters are their masters through the wire";
      if (g.rank() == 0) {
        const auto sd = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
        Params masters;
        for (size_t i = 0; i < mine.size(); ++i) {
          masters.push_back(sd.at(static_cast<int64_t>(i)).toTensor().cpu());
          largest = std::max(largest, masters[i].abs().max().item<double>());
        }
        double off = 0;
        for (size_t i = 0; i < mine.size(); ++i) {
          if (c.wire == Wire::kBFloat16) {
            if (!mine[i].equal(masters[i].to(at::kBFloat16).to(at::kFloat))) ok = false;
          } else {
            off = std::max(off, (mine[i] - masters[i]).abs().max().item<double>());
          }
        }
        if (c.wire == Wire::kInt8) {
          ok = off <= largest / 254 * 1.0001 && off > 0;
          what += " (off by " + std::to_string(off) + ", half a step " + std::to_string(largest / 254) + ")";
        }
      }
      check_everywhere(g, ok, what);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "parity" && mode != "mixed" && mode != "resume" && mode != "wires" && mode != "probe") {
    std::cerr << "usage: cuda_gloo_worker parity | mixed | resume | wires | probe" << std::endl;
    return 2;
  }
  if (!at::globalContext().hasCUDA()) {
    std::cout << "no CUDA device visible: not run" << std::endl;
    return 77;
  }
  if (mode == "probe") return 0;
  try {
    at::set_num_threads(1);
    auto group = init_process_group(InitOptions().backend("gloo").timeout(std::chrono::seconds(120)));
    if (mode == "parity") parity(*group, group);
    if (mode == "mixed") mixed(*group, group);
    if (mode == "resume") resume(*group, group);
    if (mode == "wires") wires(*group, group);
    if (group->rank() == 0) std::cout << "cuda over gloo " << mode << " ok at world " << group->size() << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << std::endl;
    return 1;
  }
}

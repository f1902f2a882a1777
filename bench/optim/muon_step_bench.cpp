// The Muon + AdamW step each rank computes under OSS, on GPT-2's shape (width 512, vocab 10000,
// context 512, 6 blocks: ~24.4M parameters): Muon on the blocks' weight matrices, each whole on
// one owner, AdamW on the embeddings, norms and biases, split into equal ranges. One rank of a
// run under tools/launch; prints one JSON line per rank.
//
//   tools/launch -n 2 build/bench/muon_step_bench [--device cuda]
//
// With --device cuda every rank's tensors live on the one GPU (ranks over Gloo, staged), and each
// timed region ends with a device synchronisation.
//
// Each rank times its own optimizers' step over the tensors OSS gave it (Muon's own step and the
// fused AdamW step, the two OSS runs), one rank at a time while the others wait at a barrier, on
// one intra-op thread: the compute of the step alone, without the parameter sync, and without
// ranks sharing the machine's cores. World 1 is the unsharded step; bench/optim/muon_step_peer.py
// times torch.optim.Muon + AdamW on the same shapes in Python.
#include "median.h"

#include "models/gpt2.h"
#include <shardopt/optim/fused_step.h>
#include <shardopt/shardopt.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/cuda.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace {

using shardopt::bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Muon + AdamW step per rank under OSS (one rank; run under tools/launch)"};
  int steps = 7, warmup = 2;
  std::string device = "cpu";
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    const bool cuda = device == "cuda";
    if (cuda && !torch::cuda::is_available()) {
      std::cerr << "muon_step_bench: --device cuda: no CUDA device is visible" << std::endl;
      return 1;
    }
    const at::Device where = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    auto sync = [cuda] {
      if (cuda) torch::cuda::synchronize();
    };
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo").timeout(std::chrono::minutes(5)));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    std::vector<at::Tensor> matrices, others;
    size_t k = 0;
    for (const auto& layer : shardopt::models::gpt2_shapes(512, 10000, 512, 6)) {
      at::Tensor p = (at::randn(layer.shape, gen) * 0.02).to(where).requires_grad_();
      (p.dim() == 2 && k++ >= 2 ? matrices : others).push_back(p);  // the embeddings take AdamW
    }
    shardopt::OSS oss({{matrices, shardopt::optimizer<shardopt::Muon>(
                                      shardopt::MuonOptions(0.02).adjust_lr_fn("match_rms_adamw"))},
                       {others, shardopt::optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(3e-4))}},
                      group);
    auto& muon = Introspection::local_optimizer(oss, 0);
    auto& adamw = Introspection::local_optimizer(oss, 1);
    int64_t muon_numel = 0, adamw_numel = 0;
    double cost = 0;
    for (auto* opt : {&muon, &adamw}) {
      for (auto& t : opt->param_groups().at(0).params()) {
        t.mutable_grad() = (at::randn(t.sizes(), gen) * 1e-3).to(where);
        (opt == &muon ? muon_numel : adamw_numel) += t.numel();
        if (opt == &muon) cost += shardopt::muon_cost(t.sizes());
      }
    }
    double total_cost = 0;
    for (const auto& m : matrices) total_cost += shardopt::muon_cost(m.sizes());
    std::vector<double> muon_ms, adamw_ms;
    for (int r = 0; r < group->size(); ++r) {
      group->barrier();
      if (r != group->rank()) continue;
      for (int s = 0; s < warmup + steps; ++s) {
        sync();
        auto t0 = std::chrono::steady_clock::now();
        muon.step();
        sync();
        auto t1 = std::chrono::steady_clock::now();
        shardopt::fused_step(adamw);
        sync();
        auto t2 = std::chrono::steady_clock::now();
        if (s < warmup) continue;
        muon_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        adamw_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
    }
    group->barrier();
    std::vector<double> total;
    for (size_t s = 0; s < muon_ms.size(); ++s) total.push_back(muon_ms[s] + adamw_ms[s]);
    const nlohmann::json row = {{"rank", group->rank()},
                                {"device", device},
                                {"world", group->size()},
                                {"median_step_ms", median(total)},
                                {"muon_ms", median(muon_ms)},
                                {"adamw_ms", median(adamw_ms)},
                                {"muon_elements", muon_numel},
                                {"adamw_elements", adamw_numel},
                                {"cost_share", cost / total_cost},
                                {"state_bytes", oss.local_state_bytes()}};
    std::printf("%s\n", row.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

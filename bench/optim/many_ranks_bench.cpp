// What each rank costs at 2, 16, 32 and 64 ranks: OSS + ShardedDDP on a 39-element model (most
// ranks own a few elements or none), the ranks as threads of this process over one HashStore and
// real Gloo groups, as the many-rank tests run them.
//
//   build/bench/many_ranks_bench --world-sizes 2,16,32,64
//
// With --optimizer muon, Muon steps the hidden matrices of a deeper model (--layers hidden
// Linear(8, 8) layers between Linear(5, 8) and Linear(8, 3)), whole on owners balanced by
// Newton-Schulz cost, and AdamW the rest (one OSS of two optimizer groups).
//
// Per world size, one JSON line: the median step time (zero_grad, forward, backward, clipping,
// step, rank 0's clock, every rank stepping) and the collectives a rank calls per step, and, measured while every rank is alive after the
// steps, the threads, file descriptors (sockets) and resident memory the ranks added to the
// process, per rank, and the heartbeat's store traffic: increments of every rank's heartbeat
// counter per second over the timed steps. On 2 cores the step time is overhead per rank, not
// speed-up.
#include "median.h"

#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

int64_t status_value(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size()));
  }
  return 0;
}

int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n - 2;  // . and ..
}

struct Usage {
  int64_t threads = 0, fds = 0, rss_kib = 0;
  static Usage now() { return {status_value("Threads:"), open_fds(), status_value("VmRSS:")}; }
};

int64_t heartbeats(c10d::Store& store, int world) {
  int64_t total = 0;
  for (int r = 0; r < world; ++r) total += store.add("shardopt/heartbeat/" + std::to_string(r), 0);
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"OSS + ShardedDDP at many ranks (threads) on a tiny model: step time and per-rank overhead"};
  std::vector<int> worlds{2, 16, 32, 64};
  int steps = 40, warmup = 5;
  app.add_option("--world-sizes", worlds)->delimiter(',');
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  std::string sync = "broadcast";
  app.add_option("--param-sync", sync, "the parameter sync after the step: broadcast (one per owner, the default) or "
                                      "allgather (one per flat buffer)")
      ->check(CLI::IsMember({"broadcast", "allgather"}));
  std::string optimizer = "adamw";
  app.add_option("--optimizer", optimizer, "adamw, or muon: Muon on the hidden matrices, AdamW on the rest")
      ->check(CLI::IsMember({"adamw", "muon"}));
  int layers = 6;
  app.add_option("--layers", layers, "with --optimizer muon: hidden Linear(8, 8) layers")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const bool muon = optimizer == "muon";
  for (int world : worlds) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    const Usage before = Usage::now();
    Usage during;
    std::vector<double> step_ms;
    double seconds = 0;
    int64_t beats = 0;
    double collectives = 0;
    std::mutex mu;
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        at::set_num_threads(1);
        auto g = shardopt::init_process_group(
            store, shardopt::InitOptions().backend("gloo").rank(r).world_size(world).timeout(std::chrono::minutes(5)));
        torch::nn::Sequential net;
        if (muon) {
          net->push_back(torch::nn::Linear(5, 8));
          for (int l = 0; l < layers; ++l) net->push_back(torch::nn::Tanh()), net->push_back(torch::nn::Linear(8, 8));
          net->push_back(torch::nn::Tanh());
          net->push_back(torch::nn::Linear(8, 3));
        } else {
          net = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Tanh(), torch::nn::Linear(4, 3));
        }
        const auto options = shardopt::OSSOptions().sync(sync == "allgather" ? shardopt::ParamSync::kAllgather
                                                                              : shardopt::ParamSync::kBroadcast);
        const auto adamw = shardopt::optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(1e-2));
        std::vector<at::Tensor> matrices, others;
        const auto params = net->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          // The hidden matrices: 2-D, neither the first nor the last layer's.
          const bool hidden = params[i].dim() == 2 && i > 0 && i + 2 < params.size();
          (muon && hidden ? matrices : others).push_back(params[i]);
        }
        const auto muon_factory =
            shardopt::optimizer<shardopt::Muon>(shardopt::MuonOptions(0.02).adjust_lr_fn("match_rms_adamw"));
        auto made = muon ? std::make_unique<shardopt::OSS>(
                               std::vector<shardopt::OptimizerGroup>{{matrices, muon_factory}, {others, adamw}}, g, options)
                         : std::make_unique<shardopt::OSS>(params, adamw, g, options);
        shardopt::OSS& oss = *made;
        shardopt::ShardedDDP ddp(net.ptr(), oss);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(r);
        const at::Tensor x = at::randn({4, 5}, gen), y = at::randn({4, 3}, gen);
        std::vector<double> mine;
        int64_t beats_before = 0;
        Clock::time_point start;
        for (int s = 0; s < warmup + steps; ++s) {
          if (s == warmup) {
            g->barrier();
            g->reset_stats();
            if (r == 0) beats_before = heartbeats(*store, world), start = Clock::now();
          }
          const auto t0 = Clock::now();
          ddp.zero_grad();
          (ddp.forward(x) - y).square().mean().backward();
          oss.clip_grad_norm(1.0);
          oss.step();
          mine.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
        const int64_t calls = g->stats().total_calls();
        g->barrier();
        if (r == 0) {
          std::lock_guard<std::mutex> lock(mu);
          collectives = static_cast<double>(calls) / steps;
          seconds = std::chrono::duration<double>(Clock::now() - start).count();
          beats = heartbeats(*store, world) - beats_before;
          during = Usage::now();
          step_ms.assign(mine.begin() + warmup, mine.end());
        }
        g->barrier();  // rank 0 counted while every rank was alive
      });
    }
    for (auto& t : threads) t.join();
    nlohmann::json line = {{"world", world},
                           {"optimizer", optimizer},
                           {"param_sync", sync},
                           {"step_ms_median", shardopt::bench::median(step_ms)},
                           {"collectives_per_step", collectives},
                           {"threads_per_rank", static_cast<double>(during.threads - before.threads) / world},
                           {"fds_per_rank", static_cast<double>(during.fds - before.fds) / world},
                           {"rss_mib_per_rank", static_cast<double>(during.rss_kib - before.rss_kib) / 1024.0 / world},
                           {"heartbeat_store_adds_per_s", static_cast<double>(beats) / seconds},
                           {"timed_seconds", seconds}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

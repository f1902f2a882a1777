// What a checkpoint costs a training loop: the GPT-2 shape (~24M parameters, bench/gpt2_like.h)
// under OSS + ShardedDDP, a save every --save-every steps, one rank of a run under tools/launch.
//
//   tools/launch -n 2 build/bench/save_bench --mode async --steps 60 --save-every 20
//
// mode: none  (no save), sync (save_checkpoint), async (save_checkpoint_async; the last save is
// waited for after the timed steps). Prints one JSON line per rank: the median step, the median
// of the steps that ran while a save was in flight (async: the steps after a call until done()
// says this rank's writer has finished) and of the others, how many steps overlapped a save, and
// the median time the save call took to return. The run's folder is removed at the end.
#include "gpt2_like.h"
#include "median.h"

#include <shardopt/shardopt.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/nn/functional/loss.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <ftw.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using shardopt::bench::GPT2Like;
using shardopt::bench::median;

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A checkpoint every N steps of the GPT-2 shape: the step and the save call's time"};
  std::string mode = "async", dir;
  int steps = 60, warmup = 3, tokens = 16, save_every = 20;
  app.add_option("--mode", mode)->check(CLI::IsMember({"none", "sync", "async"}));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--tokens", tokens, "tokens per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--save-every", save_every, "steps between saves")->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "where the checkpoints go (default: a new folder under /tmp, removed at the end)");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo").timeout(std::chrono::minutes(5)));
    if (dir.empty()) {
      // rank 0 names the folder; every rank uses it
      std::string made;
      if (group->rank() == 0) {
        std::string pattern = "/tmp/shardopt-save-bench-XXXXXX";
        made = ::mkdtemp(pattern.data());
      }
      at::Tensor length = at::full({1}, static_cast<int64_t>(made.size()), at::kLong);
      group->broadcast(length, 0);
      at::Tensor name = at::zeros({length.item<int64_t>()}, at::kByte);
      if (group->rank() == 0) std::memcpy(name.data_ptr(), made.data(), made.size());
      group->broadcast(name, 0);
      dir.assign(static_cast<const char*>(name.data_ptr()), static_cast<size_t>(name.numel()));
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + group->rank());
    auto model = std::make_shared<GPT2Like>();
    shardopt::OSS oss(model->parameters(), shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-4)),
                      group);
    shardopt::ShardedDDP ddp(model, oss);
    auto one_step = [&] {
      ddp.zero_grad(true);
      at::Tensor tok = at::randint(model->kVocab, {tokens + 1}, gen);
      torch::nn::functional::cross_entropy(ddp.forward(tok.narrow(0, 0, tokens)), tok.narrow(0, 1, tokens)).backward();
      oss.step();
    };
    for (int s = 0; s < warmup; ++s) one_step();
    const std::string path = dir + "/last.ckpt";
    shardopt::PendingCheckpoint pending;
    std::vector<double> all, during, between, calls;
    bool in_flight = false;
    group->barrier();
    auto last = std::chrono::steady_clock::now();
    for (int s = 1; s <= steps; ++s) {
      one_step();
      const bool overlapped = in_flight && !pending.done();  // (this rank's writer ran during the step)
      in_flight = overlapped;
      double took = ms_since(last);
      if (s % save_every == 0 && mode != "none") {
        shardopt::TrainingState state;
        state.step = s;
        oss.finish_param_sync();
        const auto t0 = std::chrono::steady_clock::now();
        if (mode == "sync") {
          shardopt::save_checkpoint(path, *model, oss, state);
        } else {
          pending = shardopt::save_checkpoint_async(path, *model, oss, state);
          in_flight = true;
        }
        calls.push_back(ms_since(t0));
        took = ms_since(last);  // the step that saves pays for its call
      }
      all.push_back(took);
      (overlapped ? during : between).push_back(took);
      last = std::chrono::steady_clock::now();
    }
    pending.wait();
    oss.finish_param_sync();
    group->barrier();
    const nlohmann::json row = {{"rank", group->rank()},
                                {"world", group->size()},
                                {"mode", mode},
                                {"steps", steps},
                                {"save_every", save_every},
                                {"median_step_ms", median(all)},
                                {"median_step_during_save_ms", during.empty() ? 0.0 : median(during)},
                                {"median_step_between_saves_ms", between.empty() ? 0.0 : median(between)},
                                {"steps_overlapping_a_save", static_cast<int64_t>(during.size())},
                                {"median_save_call_ms", calls.empty() ? 0.0 : median(calls)}};
    std::printf("%s\n", row.dump().c_str());
    if (group->rank() == 0 && app.count("--dir") == 0) {
      ::nftw(dir.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
             FTW_DEPTH | FTW_PHYS);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

// One rank of the data-parallel comparison (run under tools/launch; bench/run_ddp_comparison.py
// drives it next to the PyTorch peers in bench/peers/).
//
//   tools/launch -n 2 build/bench/ddp_bench --impl sharded --model gpt2
//
// impl: sharded   = OSS(Adam) + ShardedDDP (gradients reduced to owners during backward)
//       allreduce = torch::optim::Adam, gradients all-reduced in 8 MB buckets after backward
// model: gpt2      = ~24M parameters in GPT-2-like shapes (6 blocks, width 512, vocab 10000)
//        gpt2small = ~124M parameters in GPT-2-small shapes (12 blocks, width 768, vocab 50257;
//                    the 38.6M-element embedding is 31% of the model)
//        small     = 300 small tensors (150 layers of 16x16 + bias): overhead-bound
// partition (sharded): auto (split ranges for Adam), split, whole (whole parameters per owner)
// mixed-precision (sharded): off, bf16, fp16 (parameters and gradients; fp32 masters and state)
// state-format (sharded): fp32, bf16, int8 (OSSOptions::state_format: the owners' optimizer state in bf16 or
// 8-bit blockwise codes)
// Prints one JSON line per rank: median step time, peak RSS and RSS added since start-up, and for
// `sharded` the time pre_forward() blocks per step (the trainability check is started there and
// awaited by backward after the forward), then a freeze (--freeze): the time of the rebuild, of
// the re-partition that follows (with --rebalance 1), the trainable-work imbalance kept or
// re-partitioned, the optimizer-state bytes moved, and the step time after the freeze. Phase
// times (forward, backward, step) go to stderr. cpu_ms_per_step: this process's CPU time (every
// thread, Gloo's transport too, user and system) per timed step; on fewer cores than ranks, the
// ranks' sum over the cores is the least a step can take.
#include "gpt2_like.h"
#include "harness.h"
#include "median.h"

#include "models/gpt2.h"
#include <shardopt/shardopt.h>
#include <shardopt/comm/launch_env.h>
#include <shardopt/comm/timeline.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/api/include/torch/nn/functional/loss.h>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace {

double rss_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1048576.0);
}
// This process's CPU time so far, every thread, user and system, in ms.
double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto ms = [](const timeval& t) { return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_usec) / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;
}

using shardopt::bench::median;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

at::Tensor init(std::vector<int64_t> shape, double scale, at::Generator& gen) {
  return (at::randn(shape, gen) * scale).requires_grad_();
}

using shardopt::bench::GPT2Like;

// Mirrors SmallTensors in bench/peers/ddp_peers.py.
struct SmallTensors : torch::nn::Module {
  SmallTensors() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    for (int i = 0; i < 150; ++i) {
      ws.push_back(register_parameter("w" + std::to_string(i), init({16, 16}, 0.25, gen)));
      bs.push_back(register_parameter("b" + std::to_string(i), at::zeros({16}).requires_grad_()));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < ws.size(); ++i) x = x + 0.1 * at::tanh(at::linear(x, ws[i], bs[i]));
    return x;
  }
  std::vector<at::Tensor> ws, bs;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardopt data-parallel step benchmark (one rank; run under tools/launch)"};
  std::string impl = "sharded", model_name = "gpt2";
  int steps = 12, warmup = 3, tokens = 16, freeze_steps = 8, accumulate = 1;
  std::string accumulate_in = "no_sync";
  bool rebalance = true;
  std::string freeze = "embeddings", partition = "auto";
  app.add_option("--impl", impl)->check(CLI::IsMember({"sharded", "allreduce"}));
  std::string optimizer_name = "adam";
  app.add_option("--optimizer", optimizer_name,
                 "adam, or muon: Muon on the 2-D weights past the embeddings, Adam on the rest (one OSS of two "
                 "optimizer groups, or the two plain optimizers under allreduce)")
      ->check(CLI::IsMember({"adam", "muon"}));
  app.add_option("--model", model_name)->check(CLI::IsMember({"gpt2", "gpt2small", "small"}));
  app.add_option("--partition", partition, "OSSOptions::partition (sharded)")
      ->check(CLI::IsMember({"auto", "split", "whole"}));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--tokens", tokens, "tokens (gpt2) or rows (small) per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--freeze-steps", freeze_steps, "steps timed after freezing every other tensor (sharded)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rebalance", rebalance, "OSSOptions::rebalance (sharded)");
  bool fused = true;
  app.add_option("--fused-step", fused, "OSSOptions::fused_step (sharded)");
  int shard_group_size = 0;
  app.add_option("--shard-group-size", shard_group_size, "OSSOptions::shard_group_size (sharded; 0: whole group)");
  bool overlap = false;
  app.add_option("--overlap-sync", overlap, "ShardedDDPOptions::overlap_param_sync (sharded; gpt2 waits per block)");
  std::string timeline_path;
  app.add_option("--timeline", timeline_path,
                 "write the timed steps' timeline as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): rank 0's "
                 "to this file, rank r's to FILE.rank<r>");
  std::string step_in_backward_mode = "auto";
  app.add_option("--step-in-backward", step_in_backward_mode,
                 "ShardedDDPOptions::step_in_backward (sharded): auto (on where the ranks span nodes, unless "
                 "muon, fused-step 0 or shard-group-size), on, off")
      ->check(CLI::IsMember({"auto", "on", "off", "1", "0"}));
  std::string clearing = "none";
  app.add_option("--zero-grad", clearing, "how each step clears gradients: none (set to none) or zero (in place)")
      ->check(CLI::IsMember({"none", "zero"}));
  bool bucket_view = true;
  std::string timing = "back-to-back";
  app.add_option("--timing", timing,
                 "back-to-back: each step from the end of the one before; barrier: each step after a barrier, "
                 "as a step alone")
      ->check(CLI::IsMember({"back-to-back", "barrier"}));
  app.add_option("--bucket-view", bucket_view, "ShardedDDPOptions::gradient_as_bucket_view (sharded)");
  int64_t bucket_bytes = shardopt::ShardedDDPOptions().reduce_bucket_bytes();
  app.add_option("--reduce-bucket-bytes", bucket_bytes, "ShardedDDPOptions::reduce_bucket_bytes (sharded)")
      ->check(CLI::PositiveNumber);
  std::string mixed = "off";
  app.add_option("--mixed-precision", mixed, "OSSOptions::mixed_precision param_dtype (sharded): off, bf16, fp16")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}));
  app.add_option("--freeze", freeze, "which tensors the freeze measurement freezes (sharded)")
      ->check(CLI::IsMember({"embeddings", "lower", "alternate"}));
  std::string gradient_wire = "exact";
  app.add_option("--gradient-wire", gradient_wire, "ShardedDDPOptions::gradient_wire (sharded): exact, bf16, int8")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}));
  bool error_feedback = false;
  app.add_option("--error-feedback", error_feedback, "ShardedDDPOptions::error_feedback (sharded, with a compressed gradient wire)");
  std::string param_wire = "exact";
  app.add_option("--param-wire", param_wire, "OSSOptions::param_wire (sharded): exact, bf16, int8")
      ->check(CLI::IsMember({"exact", "bf16", "int8"}));
  std::string state_format = "fp32";
  app.add_option("--state-format", state_format, "OSSOptions::state_format (sharded): fp32, bf16, int8")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  int transport_nice = shardopt::InitOptions().transport_thread_nice();
  app.add_option("--accumulate", accumulate, "micro-batches per step, each a forward and a backward")
      ->check(CLI::PositiveNumber);
  app.add_option("--accumulate-in", accumulate_in,
                 "sharded, with --accumulate above 1: no_sync (the first micro-batches under no_sync(), "
                 "accumulating whole gradients) or shards (every backward reduces, the shards accumulate)")
      ->check(CLI::IsMember({"no_sync", "shards"}));
  app.add_option("--transport-nice", transport_nice, "InitOptions::transport_thread_nice")->check(CLI::Range(0, 39));
  bool transport_batch = shardopt::InitOptions().transport_thread_batch();
  app.add_option("--transport-batch", transport_batch, "InitOptions::transport_thread_batch");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo").timeout(std::chrono::minutes(2)).transport_thread_nice(transport_nice).transport_thread_batch(transport_batch));
    const double rss_start = rss_mb();

    std::shared_ptr<torch::nn::Module> module;
    std::function<at::Tensor(int)> loss_fn;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + group->rank());
    if (model_name == "gpt2" || model_name == "gpt2small") {
      auto m = model_name == "gpt2" ? std::make_shared<GPT2Like>() : std::make_shared<GPT2Like>(768, 50257, 1024, 12);
      module = m;
      loss_fn = [m, &gen, tokens](int) {
        at::Tensor tok = at::randint(m->kVocab, {tokens + 1}, gen);
        return torch::nn::functional::cross_entropy(m->forward(tok.narrow(0, 0, tokens)), tok.narrow(0, 1, tokens));
      };
    } else {
      auto m = std::make_shared<SmallTensors>();
      module = m;
      loss_fn = [m, &gen, tokens](int) { return m->forward(at::randn({tokens, 16}, gen)).pow(2).mean(); };
    }

    int64_t nparams = 0;
    for (auto& p : module->parameters()) nparams += p.numel();
    std::unique_ptr<shardopt::OSS> oss;
    std::unique_ptr<shardopt::ShardedDDP> ddp;
    bool step_in_backward = false;  // (--step-in-backward, resolved)
    std::unique_ptr<torch::optim::Adam> adam;
    std::unique_ptr<shardopt::Muon> muon;
    auto factory = shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-4));
    // --optimizer muon: the hidden matrices (2-D, past the embeddings) and the rest.
    std::vector<at::Tensor> matrices, others;
    {
      size_t k = 0;
      for (const auto& p : module->parameters()) (optimizer_name == "muon" && p.dim() == 2 && k++ >= 2 ? matrices : others).push_back(p);
    }
    const auto muon_options = shardopt::MuonOptions(0.02).adjust_lr_fn("match_rms_adamw");
    if (impl == "sharded") {
      const auto mode = partition == "split"   ? shardopt::PartitionMode::kSplit
                        : partition == "whole" ? shardopt::PartitionMode::kWholeParameters
                                               : shardopt::PartitionMode::kAuto;
      auto options =
          shardopt::OSSOptions().rebalance(rebalance).partition(mode).fused_step(fused).shard_group_size(shard_group_size).param_wire(
          shardopt::wire_from_name(param_wire));
      options.state_format(shardopt::parse_state_format(state_format));
      if (mixed != "off") {
        options.mixed_precision(shardopt::MixedPrecision().param_dtype(mixed == "bf16" ? at::kBFloat16 : at::kHalf));
      }
      // auto: as shardopt train's, on where the ranks span nodes (tools/launch_hosts: a host each).
      step_in_backward = step_in_backward_mode == "on" || step_in_backward_mode == "1" ||
                         (step_in_backward_mode == "auto" && optimizer_name != "muon" && fused && shard_group_size == 0 &&
                          shardopt::ranks_span_nodes());
      oss = optimizer_name == "muon"
                ? std::make_unique<shardopt::OSS>(
                      std::vector<shardopt::OptimizerGroup>{{matrices, shardopt::optimizer<shardopt::Muon>(muon_options)},
                                                            {others, factory}},
                      group, options)
                : std::make_unique<shardopt::OSS>(module->parameters(), factory, group, options);
      ddp = std::make_unique<shardopt::ShardedDDP>(module, *oss,
                                                   shardopt::ShardedDDPOptions().overlap_param_sync(overlap).gradient_as_bucket_view(bucket_view).reduce_bucket_bytes(bucket_bytes).gradient_wire(
                                                       shardopt::wire_from_name(gradient_wire)).error_feedback(error_feedback).step_in_backward(step_in_backward));
      if (auto gpt = std::dynamic_pointer_cast<GPT2Like>(module); gpt && overlap) {
        gpt->before_use = [d = ddp.get()](const std::vector<at::Tensor>& ps) { d->wait_param_sync(ps); };
      }
    } else {
      adam = std::make_unique<torch::optim::Adam>(others, torch::optim::AdamOptions(1e-4));
      if (!matrices.empty()) muon = std::make_unique<shardopt::Muon>(matrices, muon_options);
    }
    auto params = module->parameters();

    // The most gradient bytes this rank held after any backward of a step (--accumulate).
    int64_t accumulated_grad_bytes = 0;
    std::vector<double> checks;  // time pre_forward() blocks in each step
    std::vector<double> phases[4];  // forward, backward, step, zero_grad
    auto one_step = [&](int step) {
      if (ddp) {
        auto tz = std::chrono::steady_clock::now();
        ddp->zero_grad(/*set_to_none=*/clearing == "none");
        phases[3].push_back(ms_since(tz));
        double forward_ms = 0, backward_ms = 0;
        for (int m = 0; m < accumulate; ++m) {
          auto t0 = std::chrono::steady_clock::now();
          std::optional<shardopt::timeline::Span> forward_span(std::in_place, "forward", group->rank());
          ddp->pre_forward(/*finish_sync=*/!overlap);
          if (m == 0) checks.push_back(ms_since(t0));
          at::Tensor loss = loss_fn(step);
          forward_span.reset();
          auto t1 = std::chrono::steady_clock::now();
          shardopt::timeline::Span backward_span("backward", group->rank());
          if (m + 1 < accumulate && accumulate_in == "no_sync") {
            auto local = ddp->no_sync();
            loss.backward();
          } else {
            loss.backward();
          }
          forward_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
          backward_ms += ms_since(t1);
          accumulated_grad_bytes = std::max(accumulated_grad_bytes, ddp->local_grad_bytes());
        }
        auto t2 = std::chrono::steady_clock::now();
        {
          shardopt::timeline::Span step_span("step()", group->rank());
          oss->step();
        }
        phases[0].push_back(forward_ms);
        phases[1].push_back(backward_ms);
        phases[2].push_back(ms_since(t2));
        return;
      }
      auto tz = std::chrono::steady_clock::now();
      adam->zero_grad(/*set_to_none=*/clearing == "none");
      if (muon) muon->zero_grad(/*set_to_none=*/clearing == "none");
      phases[3].push_back(ms_since(tz));
      double forward_ms = 0, backward_ms = 0;
      for (int m = 0; m < accumulate; ++m) {  // local accumulation, one all-reduce per step
        auto t0 = std::chrono::steady_clock::now();
        at::Tensor loss = loss_fn(step);
        auto t1 = std::chrono::steady_clock::now();
        loss.backward();
        forward_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
        backward_ms += ms_since(t1);
      }
      auto t2 = std::chrono::steady_clock::now();
      phases[0].push_back(forward_ms);
      phases[1].push_back(backward_ms);
      // shardopt's all-reduce-everything baseline: 8 MB buckets, averaged.
      std::vector<at::Tensor> bucket;
      int64_t bytes = 0;
      auto flush = [&] {
        if (bucket.empty()) return;
        std::vector<at::Tensor> flat;
        for (auto& g : bucket) flat.push_back(g.reshape(-1));
        at::Tensor buf = at::cat(flat);
        group->allreduce(buf);
        buf.div_(group->size());
        int64_t off = 0;
        for (auto& g : bucket) g.copy_(buf.narrow(0, off, g.numel()).view(g.sizes())), off += g.numel();
        bucket.clear();
        bytes = 0;
      };
      for (auto it = params.rbegin(); it != params.rend(); ++it) {
        if (!it->grad().defined()) continue;
        bucket.push_back(it->grad());
        bytes += it->grad().nbytes();
        if (bytes >= (8 << 20)) flush();
      }
      flush();
      adam->step();
      if (muon) muon->step();
      phases[2].push_back(ms_since(t2));
    };

    for (int s = 0; s < warmup; ++s) one_step(s);
    // Bytes handed to collectives per timed step: the whole group's (the block's, with
    // --shard-group-size) and across blocks.
    auto block_total = [&] { return oss ? oss->process_group().stats().total_bytes() : group->stats().total_bytes(); };
    auto cross_total = [&] { return oss && Introspection::replica_group(*oss) ? Introspection::replica_group(*oss)->stats().total_bytes() : int64_t{0}; };
    const int64_t block_before = block_total(), cross_before = cross_total();
    const int64_t written_before = shardopt::testing::written_bytes();  // headers aside: what left on the wire
    // Steps back to back, each timed from the end of the one before: what a step costs in a
    // training loop, the parameter sync left in flight by one step (--overlap-sync) included in
    // the next (and finished inside the last).
    std::vector<double> times;
    if (ddp) ddp->finish_param_sync();
    group->barrier();
    auto last = std::chrono::steady_clock::now();
    const double cpu_before = cpu_ms();
    if (!timeline_path.empty()) shardopt::timeline::start();
    for (int s = 0; s < steps; ++s) {
      if (timing == "barrier") {
        group->barrier();
        last = std::chrono::steady_clock::now();
      }
      one_step(warmup + s);
      if (ddp && s + 1 == steps) ddp->finish_param_sync();
      times.push_back(ms_since(last));
      last = std::chrono::steady_clock::now();
    }
    if (!timeline_path.empty()) {
      shardopt::timeline::stop();
      shardopt::timeline::write(group->rank() == 0 ? timeline_path : timeline_path + ".rank" + std::to_string(group->rank()));
    }
    const double step_ms = median(times);
    const double cpu_ms_per_step = (cpu_ms() - cpu_before) / steps;
    const double wire_bytes_per_step = static_cast<double>(shardopt::testing::written_bytes() - written_before) / steps;
    const double block_bytes_per_step = static_cast<double>(block_total() - block_before) / steps;
    const double cross_bytes_per_step = static_cast<double>(cross_total() - cross_before) / steps;
    const double train_peak_mb = peak_rss_mb();  // before the freeze measurement below
    for (auto& p : phases) p.erase(p.begin(), p.begin() + warmup);
    std::fprintf(stderr, "phases ms: zero_grad %.2f forward %.1f backward %.1f step %.1f\n", median(phases[3]),
                 median(phases[0]), median(phases[1]), median(phases[2]));

    double check_ms = 0, rebuild_ms = 0, move_step_ms = 0, still_step_ms = 0, grad_fraction = 1, kept_imbalance = 0, freeze_imbalance = 0,
           rebalance_ms = 0, after_freeze_ms = 0;
    int64_t moved_bytes = 0, grad_bytes = 0, state_bytes = 0, master_bytes = 0;
    // The busiest rank's trainable elements against 1/world, as trained above (before the freeze).
    const double imbalance = oss ? oss->layout().imbalance() : 0.0;
    if (ddp) {
      // Gradient bytes this rank holds after a backward, as a fraction of all gradients.
      ddp->zero_grad(true);
      ddp->pre_forward();
      loss_fn(0).backward();
      grad_bytes = ddp->local_grad_bytes();
      grad_fraction = static_cast<double>(grad_bytes) / (static_cast<double>(params[0].element_size()) * nparams);
      oss->step();
      state_bytes = oss->local_state_bytes();
      master_bytes = oss->local_master_bytes();
      ddp->zero_grad(true);
      // What the trainability check costs a step: pre_forward() only starts it (backward waits
      // for it after the forward has run), so this is its blocking time.
      checks.erase(checks.begin(), checks.begin() + warmup);
      check_ms = median(checks);
      // Freeze part of the model (--freeze). The next forward rebuilds the
      // buckets; the one after it, once the ranks have agreed on the new set, re-partitions.
      auto trainable_imbalance = [&] {
        if (oss->layout().options().split()) return oss->layout().imbalance();  // equal ranges of the set laid out last
        std::vector<double> load(group->size(), 0.0);
        for (auto& p : params) {
          if (p.requires_grad()) load[oss->owner(p)] += p.numel();
        }
        double total = 0, top = 0;
        for (double l : load) total += l, top = std::max(top, l);
        return total > 0 ? top / (total / group->size()) - 1 : 0;
      };
      if (freeze == "embeddings") {  // the first two tensors: token and position embeddings (gpt2)
        for (size_t i = 0; i < std::min<size_t>(2, params.size()); ++i) params[i].requires_grad_(false);
      } else if (freeze == "alternate") {
        for (size_t i = 0; i < params.size(); i += 2) params[i].requires_grad_(false);
      } else {  // "lower": the first half of the parameter tensors (embeddings and lower layers)
        for (size_t i = 0; i < params.size() / 2; ++i) params[i].requires_grad_(false);
      }
      kept_imbalance = trainable_imbalance();
      group->barrier();
      auto t0 = std::chrono::steady_clock::now();
      ddp->pre_forward();
      rebuild_ms = ms_since(t0);
      loss_fn(0).backward();
      t0 = std::chrono::steady_clock::now();
      oss->step();  // moves the state of the ranges whose holder changed, then steps
      move_step_ms = ms_since(t0);
      ddp->zero_grad(true);
      group->barrier();
      t0 = std::chrono::steady_clock::now();
      ddp->pre_forward();
      rebalance_ms = ms_since(t0);
      loss_fn(0).backward();
      t0 = std::chrono::steady_clock::now();
      oss->step();  // nothing left to move: the step alone
      still_step_ms = ms_since(t0);
      freeze_imbalance = trainable_imbalance();
      moved_bytes = oss->last_rebalance().state_bytes_sent + oss->last_rebalance().state_bytes_received;
      std::vector<double> after;
      for (int s = 0; s < freeze_steps; ++s) {
        group->barrier();
        t0 = std::chrono::steady_clock::now();
        one_step(s);
        after.push_back(ms_since(t0));
      }
      after_freeze_ms = median(after);
    }
    const nlohmann::json row = {
        {"impl", "shardopt-" + impl}, {"model", model_name}, {"optimizer", optimizer_name}, {"rank", group->rank()}, {"world", group->size()},
        {"params", nparams}, {"median_step_ms", step_ms}, {"cpu_ms_per_step", cpu_ms_per_step}, {"peak_rss_mb", train_peak_mb},
        {"added_rss_mb", train_peak_mb - rss_start}, {"check_ms", check_ms}, {"rebuild_ms", rebuild_ms},
        {"move_step_ms", move_step_ms}, {"still_step_ms", still_step_ms},
        {"grad_fraction", grad_fraction}, {"imbalance", imbalance}, {"rebalance", rebalance},
        {"kept_imbalance", kept_imbalance}, {"freeze_imbalance", freeze_imbalance}, {"rebalance_ms", rebalance_ms},
        {"moved_state_bytes", moved_bytes}, {"after_freeze_step_ms", after_freeze_ms},
        {"peak_rss_with_freeze_mb", peak_rss_mb()}, {"split", oss && oss->layout().options().split()}, {"state_bytes", state_bytes},
        {"grad_bytes", grad_bytes}, {"master_bytes", master_bytes}, {"mixed_precision", mixed},
        {"gradient_wire", gradient_wire},
        {"param_wire", param_wire},
        {"state_format", state_format},
        {"error_feedback", error_feedback},
        {"step_in_backward", step_in_backward},
        {"error_feedback_bytes", ddp ? ddp->error_feedback_bytes() : int64_t{0}},
        {"accumulate", accumulate}, {"accumulate_in", accumulate_in},
        {"accumulated_grad_bytes", accumulated_grad_bytes},
        {"block_bytes_per_step", block_bytes_per_step},
        {"cross_block_bytes_per_step", cross_bytes_per_step}, {"wire_bytes_per_step", wire_bytes_per_step}};
    std::printf("%s\n", row.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

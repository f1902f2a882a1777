#include "memory.h"

#include "charts.h"
#include "local_ranks.h"
#include "memory_worker.h"
#include "model_spec.h"
#include "units.h"

#include <shardopt/check.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <tuple>

namespace shardopt::app {

namespace {

int64_t available_memory_bytes() { return proc_kib("/proc/meminfo", "MemAvailable:") * 1024; }

// What one rank of `mode` needs, from the formula, plus the runtime (about 400 MB for LibTorch).
double estimate_per_rank(const std::string& mode, int world, int64_t numel) {
  const auto f = zero_formula(mode, world, numel, numel, numel);
  const double buckets = mode.rfind("zero2", 0) == 0 ? 0.0 : 4.0 * numel;
  const double transient = 4.0 * numel;  // the backward's temporaries and the step's
  return f["params"].get<double>() + f["grads"].get<double>() + f["state"].get<double>() + buckets + transient + 400e6;
}

std::vector<std::string> worker_args(const MemoryOptions& o, char** argv, const std::string& mode, const std::string& out) {
  std::vector<std::string> a = {argv[0], "memory"};
  if (!o.spec.empty()) {
    a.insert(a.end(), {"--spec", o.spec});
  } else {
    a.insert(a.end(), {"--preset", o.preset});
  }
  if (o.error_feedback) a.push_back("--error-feedback");
  a.insert(a.end(), {"--optimizer", o.optimizer, "--steps", std::to_string(o.steps), "--freeze-fraction",
                     fmt::format("{}", o.freeze_fraction), "--gradient-wire", o.gradient_wire,
                     "--state-format", o.state_format,
                     "--worker-mode", mode, "--worker-out", out});
  return a;
}

// The largest rank's figures of one (world, mode, scenario): the rank that bounds the job.
const nlohmann::json* largest(const nlohmann::json& rows, int world, const std::string& mode, const std::string& scenario) {
  const nlohmann::json* best = nullptr;
  for (const auto& r : rows) {
    if (r["world"] != world || r["mode"] != mode || r["scenario"] != scenario) continue;
    if (!best || r["state"].get<double>() + r["grads"].get<double>() > (*best)["state"].get<double>() + (*best)["grads"].get<double>()) best = &r;
  }
  return best;
}

void print_table(const nlohmann::json& rows, const nlohmann::json& skipped, const ModelSpec& spec,
                 const std::string& optimizer) {
  std::printf("\nmemory per rank, %s (%s parameters, %s; fp32, or bf16 with fp32 masters counted as state): the "
              "largest rank of each run; every rank is in the JSON and CSV files. model state = params + grads + "
              "state + buckets + feedback (error feedback's residuals); formula = the ZeRO paper's params + grads + state\n",
              spec.name.c_str(), count_text(spec.numel()).c_str(),
              optimizer == "muon" ? "Muon on the matrices, Adam on the rest" : "Adam");
  double runtime = 0;
  for (const auto& r : rows) runtime = std::max(runtime, r["runtime"].get<double>());
  std::printf("the runtime's fixed cost (LibTorch and Gloo, before the model exists), the most any rank had: %s\n",
              bytes_text(runtime).c_str());
  std::printf("%-10s %5s  %-14s %10s %10s %10s %10s %10s %11s | %10s %10s | %10s\n", "mode", "world", "scenario",
              "params", "grads", "state", "buckets", "feedback", "model state", "transient", "peak RSS", "formula");
  std::vector<std::string> scenarios;
  for (const auto& r : rows) {
    if (std::find(scenarios.begin(), scenarios.end(), r["scenario"]) == scenarios.end()) scenarios.push_back(r["scenario"]);
  }
  std::map<std::pair<int, std::string>, bool> done;
  for (const auto& r : rows) {
    const auto key = std::make_pair(r["world"].get<int>(), r["mode"].get<std::string>());
    if (done[key]) continue;
    done[key] = true;
    for (const auto& scenario : scenarios) {
      const auto* b = largest(rows, key.first, key.second, scenario);
      if (!b) continue;
      const double counted = (*b)["params"].get<double>() + (*b)["grads"].get<double>() + (*b)["state"].get<double>() +
                             (*b)["buckets"].get<double>() + (*b)["feedback"].get<double>();
      const auto& f = (*b)["formula"];
      const double transient = (*b)["peak_rss"].get<double>() - (*b)["runtime"].get<double>() - counted;
      std::printf("%-10s %5d  %-14s %10s %10s %10s %10s %10s %11s | %10s %10s | %10s\n", key.second.c_str(), key.first,
                  scenario.c_str(), bytes_text((*b)["params"]).c_str(), bytes_text((*b)["grads"]).c_str(),
                  bytes_text((*b)["state"]).c_str(), bytes_text((*b)["buckets"]).c_str(),
                  bytes_text((*b)["feedback"]).c_str(), bytes_text(counted).c_str(),
                  bytes_text(std::max(0.0, transient)).c_str(), bytes_text((*b)["peak_rss"]).c_str(),
                  bytes_text(f["params"].get<double>() + f["grads"].get<double>() + f["state"].get<double>()).c_str());
    }
  }
  for (const auto& s : skipped) std::printf("skipped: %s\n", s.get<std::string>().c_str());
}

// One line per sharded run and scenario: every rank's optimizer state (masters included), and the
// busiest rank against its share of all the state held.
void print_state_per_rank(const nlohmann::json& rows) {
  std::map<std::tuple<int, std::string, std::string>, std::vector<double>> state;
  std::vector<std::tuple<int, std::string, std::string>> order;
  for (const auto& r : rows) {
    if (r["mode"] == "ddp" || r["world"].get<int>() < 2) continue;
    const auto key = std::make_tuple(r["world"].get<int>(), r["mode"].get<std::string>(), r["scenario"].get<std::string>());
    auto& ranks = state[key];
    if (ranks.empty()) order.push_back(key);
    ranks.resize(std::max<size_t>(ranks.size(), r["rank"].get<size_t>() + 1));
    ranks[r["rank"].get<size_t>()] = r["state"].get<double>();
  }
  if (!order.empty()) std::printf("\noptimizer state per rank (busiest rank against its share of all the state held):\n");
  for (const auto& key : order) {
    const auto& ranks = state[key];
    std::string line;
    double sum = 0, most = 0;
    for (double b : ranks) {
      line += (line.empty() ? "" : " / ") + bytes_text(b);
      sum += b;
      most = std::max(most, b);
    }
    std::printf("%-10s %5d  %-14s %s (busiest %.2fx)\n", std::get<1>(key).c_str(), std::get<0>(key),
                std::get<2>(key).c_str(), line.c_str(), sum > 0 ? most * static_cast<double>(ranks.size()) / sum : 1.0);
  }
}

void write_csv(const nlohmann::json& rows, const std::string& path) {
  std::ofstream f(path);
  SHARDOPT_CHECK(f, "cannot write '", path, "'");
  f << "mode,world,scenario,rank,params,grads,state,buckets,feedback,peak_rss,runtime,formula_params,formula_grads,"
       "formula_state\n";
  for (const auto& r : rows) {
    f << fmt::format("{},{},{},{},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f}\n",
                     r["mode"].get<std::string>(), r["world"].get<int>(), r["scenario"].get<std::string>(),
                     r["rank"].get<int>(), r["params"].get<double>(), r["grads"].get<double>(), r["state"].get<double>(),
                     r["buckets"].get<double>(), r["feedback"].get<double>(),
                     r["peak_rss"].get<double>(), r["runtime"].get<double>(), r["formula"]["params"].get<double>(),
                     r["formula"]["grads"].get<double>(), r["formula"]["state"].get<double>());
  }
}

}  // namespace

int run_memory(const MemoryOptions& o, char** argv) {
  const ModelSpec spec = model_spec(o.preset, o.spec);
  if (!o.worker_mode.empty()) {
    run_memory_worker(spec, o);
    return 0;
  }
  SHARDOPT_CHECK(!under_a_launcher(), "shardopt memory starts its own ranks for each world size; run it without a launcher");
  SHARDOPT_CHECK(o.steps > 0, "--steps must be positive, got ", o.steps);
  SHARDOPT_CHECK(o.state_format != "bf16" || o.optimizer != "muon", "--state-format bf16 holds Adam's state, not "
                 "Muon's; use --state-format fp32 or int8 with --optimizer muon");
  SHARDOPT_CHECK(o.freeze_fraction >= 0 && o.freeze_fraction < 1, "--freeze-fraction must be in [0, 1), got ", o.freeze_fraction);
  SHARDOPT_CHECK(!o.error_feedback || o.gradient_wire != "exact", "--error-feedback needs a compressed --gradient-wire "
                 "(bf16 or int8), got exact");
  for (int w : o.world_sizes) SHARDOPT_CHECK(w >= 1, "--world-sizes: ", w, " is not a positive world size");
  const std::string python = chart_python(o.python, o.out_dir, !o.no_chart);
  nlohmann::json rows = nlohmann::json::array(), skipped = nlohmann::json::array();
  for (int world : o.world_sizes) {
    for (const auto& mode : o.modes) {
      const double need = estimate_per_rank(mode, world, spec.numel()) * world;
      const double have = 0.85 * static_cast<double>(available_memory_bytes());
      if (need > have) {
        skipped.push_back(fmt::format("{} at world size {}: needs about {}, {} available", mode, world, bytes_text(need),
                                      bytes_text(have / 0.85)));
        std::printf("%s\n", ("skipped " + skipped.back().get<std::string>()).c_str());
        continue;
      }
      std::printf("measuring %s at world size %d ...\n", mode.c_str(), world);
      std::fflush(stdout);
      const std::string out = o.out_dir + fmt::format("/.rank-rows-{}-{}.json", mode, world);
      auto args = worker_args(o, argv, mode, out);
      std::vector<char*> c_args;
      for (auto& a : args) c_args.push_back(a.data());
      c_args.push_back(nullptr);
      const int rc = run_local_ranks(world, c_args.data());
      SHARDOPT_CHECK(rc == 0, "the ", mode, " run at world size ", world, " failed (exit code ", rc, ")");
      std::ifstream f(out);
      for (const auto& r : nlohmann::json::parse(f)) rows.push_back(r);
      ::unlink(out.c_str());
    }
  }
  print_table(rows, skipped, spec, o.optimizer);
  print_state_per_rank(rows);
  nlohmann::json report = {{"model", spec.name}, {"numel", spec.numel()}, {"rows", rows}, {"skipped", skipped}};
  std::ofstream(o.out_dir + "/memory.json") << report.dump(1) << "\n";
  write_csv(rows, o.out_dir + "/memory.csv");
  if (o.no_chart) {
    std::printf("wrote %s/memory.json and memory.csv\n", o.out_dir.c_str());
    return 0;
  }
  draw_chart(python, "plot_memory.py", o.out_dir + "/memory.json", o.out_dir + "/memory.png");
  std::printf("wrote %s/memory.json, memory.csv and memory.png\n", o.out_dir.c_str());
  return 0;
}

}  // namespace shardopt::app

// One rank of the rank-death survival benchmark (run under tools/launch, which serves the store).
//
// What buddy copies cost (OSS(Adam) + ShardedDDP on the GPT-2 shape, back-to-back steps):
//   tools/launch -n 4 build/bench/survive_bench --refresh-every 0,1,10,100 --steps 100 --rounds 2
// refresh_every 0 is the same run without shardopt::Resilient. The configurations run one after
// the other, round by round (each built afresh), so that each is measured beside the others.
// Rank 0 prints one JSON line per configuration: mean and median step (ms), the mean's ratio to
// the run without copies, the time of one refresh, the minor page faults of a step without a
// refresh, the host bytes of the copies and the resident memory of the rank.
//
// The same with replica blocks as the second copy (2 blocks of 2: no copy is sent):
//   tools/launch -n 4 build/bench/survive_bench --refresh-every 0,1 --shard-group-size 2 --steps 100 --rounds 2
//
// How long a recovery takes (world 4 or 8; the kill time is read from a file the dying rank
// writes just before SIGKILL, on the same monotonic clock):
//   tools/launch --keep-going -n 4 build/bench/survive_bench --refresh-every 10 --steps 30 \
//       --kill-rank 2 --kill-at-step 17 --kill-stamp /tmp/kill
// With --stop the rank stops itself (SIGSTOP) instead: a hung rank, found by its silent heartbeat
// (its last beat came at most a second before the stamp).
// Every survivor prints the time from the kill to the end of its first step after the recovery,
// the recovery's own time, and the steps rolled back.
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

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>

namespace {

using Clock = std::chrono::steady_clock;
using shardopt::bench::GPT2Like;
using shardopt::bench::median;

// This process's minor page faults so far (a page touched for the first time since it was mapped).
int64_t minor_faults() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

double rss_mb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1048576.0);
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct Measured {
  std::vector<double> steps, refreshes;
  int64_t plain_faults = 0;  // minor page faults in the steps without a refresh
  int64_t copy_bytes = 0;
  double rss = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardopt rank-death survival benchmark (one rank; run under tools/launch)"};
  std::vector<int> refresh_every{0, 1, 10, 100};
  int steps = 100, warmup = 2, rounds = 2, tokens = 16, kill_rank = -1, kill_at = -1;
  std::string kill_stamp = "/tmp/shardopt-survive-kill";
  int shard_group_size = 0;
  app.add_option("--shard-group-size", shard_group_size, "OSSOptions::shard_group_size (0: flat, buddy copies; B: "
                 "replica blocks of B ranks, which are the second copy)");
  app.add_option("--refresh-every", refresh_every, "configurations (0: without copies)")->delimiter(',');
  app.add_option("--steps", steps, "timed steps per configuration and round")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", rounds)->check(CLI::PositiveNumber);
  app.add_option("--tokens", tokens, "tokens per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--kill-rank", kill_rank, "this rank kills itself (SIGKILL) before step --kill-at-step");
  app.add_option("--kill-at-step", kill_at);
  app.add_option("--kill-stamp", kill_stamp, "file the dying rank writes its kill time to");
  bool stop = false;
  app.add_flag("--stop", stop, "the rank stops itself (SIGSTOP: a hung rank) instead of dying; the launcher ends it "
               "after the others finish");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo").timeout(std::chrono::minutes(2)));
    const bool killing = kill_rank >= 0;
    std::map<int, Measured> measured;
    for (int round = 0; round < (killing ? 1 : rounds); ++round) {
      for (int n : refresh_every) {
        auto model = std::make_shared<GPT2Like>();
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + group->global_rank());
        auto factory = shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-4));
        std::unique_ptr<shardopt::Resilient> run;
        std::unique_ptr<shardopt::OSS> oss;
        std::unique_ptr<shardopt::ShardedDDP> ddp;
        if (n > 0) {
          run = std::make_unique<shardopt::Resilient>(
              group, model,
              [&](std::shared_ptr<shardopt::ProcessGroup> g) {
                const bool blocks = shard_group_size > 0 && g->size() > shard_group_size && g->size() % shard_group_size == 0;
                return std::make_unique<shardopt::OSS>(model->parameters(), factory, g,
                                                       shardopt::OSSOptions().shard_group_size(blocks ? shard_group_size : 0));
              },
              [&](shardopt::OSS& opt) { return std::make_unique<shardopt::ShardedDDP>(model, opt); },
              shardopt::ResilienceOptions().refresh_every(n));
        } else {
          oss = std::make_unique<shardopt::OSS>(model->parameters(), factory, group,
                                                shardopt::OSSOptions().shard_group_size(shard_group_size));
          ddp = std::make_unique<shardopt::ShardedDDP>(model, *oss);
        }
        auto body = [&] {
          shardopt::ShardedDDP& d = run ? *run->ddp() : *ddp;
          d.zero_grad();
          d.pre_forward();
          at::Tensor tok = at::randint(model->kVocab, {tokens + 1}, gen);
          torch::nn::functional::cross_entropy(model->forward(tok.narrow(0, 0, tokens)), tok.narrow(0, 1, tokens))
              .backward();
        };
        Measured& m = measured[n];
        std::optional<Clock::time_point> recovered_at;
        int64_t recovery_bytes = 0;
        const int total = warmup + steps;
        for (int64_t t = 0; t < total;) {
          if (killing && group->global_rank() == kill_rank && t == kill_at) {
            std::ofstream(kill_stamp) << Clock::now().time_since_epoch().count() << "\n";
            std::raise(stop ? SIGSTOP : SIGKILL);
          }
          const int64_t refreshed_before = run ? run->refreshed_at() : -1;
          const int64_t faults_before = minor_faults();
          const auto t0 = Clock::now();
          int64_t next = t + 1;
          if (run) {
            auto r = run->step(t, body);
            next = r.next_step;
            if (r.recovery) {
              recovered_at = Clock::now();
              // What the recovery moved on the new group (the state shards and the parameters,
              // broadcast from their holders; the refresh's copies): this rank's bytes.
              recovery_bytes = run->group().stats().total_bytes();
              std::cout << "global rank " << group->global_rank() << ": " << r.recovery->to_string() << std::endl;
              t = next;
              continue;
            }
          } else {
            body();
            oss->step();
          }
          const auto t1 = Clock::now();
          if (recovered_at) {
            std::ifstream in(kill_stamp);
            Clock::rep killed = 0;
            in >> killed;
            const auto& rec = run->recoveries().back();
            nlohmann::json j{{"global_rank", run->group().global_rank()},
                             {"world", run->world_size()},
                             {"kill_to_first_step_s", ms_between(Clock::time_point(Clock::duration(killed)), t1) / 1e3},
                             {"recovery_s", rec.seconds},
                             {"recovery_bytes", recovery_bytes},
                             {"state_bytes_received", rec.state_bytes_received},
                             {"steps_rolled_back", rec.steps_rolled_back},
                             {"failed_step", rec.failed_step}};
            std::cout << j.dump() << std::endl;
            recovered_at.reset();
          }
          if (t >= warmup) {
            const bool refreshed = run && run->refreshed_at() != refreshed_before;
            (refreshed ? m.refreshes : m.steps).push_back(ms_between(t0, t1));
            if (!refreshed) m.plain_faults += minor_faults() - faults_before;
          }
          t = next;
        }
        if (run) m.copy_bytes = run->copy_bytes();
        m.rss = std::max(m.rss, rss_mb());
        (run ? run->group() : *group).barrier();
      }
    }
    if (killing) return 0;
    if (group->rank() != 0) return 0;
    auto mean = [](const std::vector<double>& v) {
      double s = 0.0;
      for (double x : v) s += x;
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    const Measured& base = measured[refresh_every.front()];
    double base_mean = mean(base.steps);
    for (int n : refresh_every) {
      const Measured& m = measured[n];
      std::vector<double> all = m.steps;
      all.insert(all.end(), m.refreshes.begin(), m.refreshes.end());
      nlohmann::json j{{"world", group->size()},
                       {"shard_group_size", shard_group_size},
                       {"refresh_every", n},
                       {"mean_step_ms", mean(all)},
                       {"median_step_ms", median(all)},
                       {"mean_ratio_to_first", mean(all) / base_mean},
                       {"refreshing_step_ms", m.refreshes.empty() ? 0.0 : median(m.refreshes)},
                       {"plain_step_ms", median(m.steps)},
                       {"plain_step_faults_rank0",
                        m.steps.empty() ? 0.0 : static_cast<double>(m.plain_faults) / static_cast<double>(m.steps.size())},
                       {"copy_bytes_rank0", m.copy_bytes},
                       {"rss_mb_rank0", m.rss}};
      std::cout << j.dump() << std::endl;
    }
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "survive_bench: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}

// What staging CUDA tensors through pinned host memory costs a Gloo group (Note [Staging] in
// csrc/comm/process_group.cpp): the same all-reduce and broadcast of CUDA tensors and of CPU
// tensors of the same sizes, two ranks (threads of this process) on one GPU, side by side.
//
//   build/bench/staging_bench --sizes-mib 1,16,64
//
// One JSON line per size and collective: the median time over the repetitions on each device and
// their ratio (the copy back to the device is synchronous, so each time includes it). Without a
// CUDA device it says so and exits 0.
#include "median.h"

#include <shardopt/comm/process_group.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

using shardopt::bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CUDA tensors over Gloo, staged through pinned memory, against CPU tensors"};
  std::vector<int> sizes{1, 16, 64};
  int reps = 20;
  app.add_option("--sizes-mib", sizes)->delimiter(',');
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (!at::globalContext().hasCUDA()) {
    std::printf("no CUDA device visible: nothing to measure\n");
    return 0;
  }
  const int world = 2;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<nlohmann::json> lines;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(1);
      auto g = shardopt::init_process_group(store, shardopt::InitOptions().backend("gloo").rank(r).world_size(world));
      for (int mib : sizes) {
        const int64_t n = int64_t{mib} << 18;  // fp32 elements
        for (const char* op : {"allreduce", "broadcast"}) {
          double ms[2];
          for (int d = 0; d < 2; ++d) {
            at::Tensor t = at::ones({n}, d == 0 ? at::kCPU : at::kCUDA);
            std::vector<double> times;
            for (int i = 0; i < reps + 2; ++i) {
              g->barrier();
              const auto t0 = std::chrono::steady_clock::now();
              std::string(op) == "allreduce" ? g->allreduce(t) : g->broadcast(t, 0);
              if (i >= 2) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
            }
            ms[d] = median(times);
          }
          if (r == 0) {
            lines.push_back({{"op", op}, {"mib", mib}, {"cpu_ms", ms[0]}, {"cuda_staged_ms", ms[1]}, {"ratio", ms[1] / ms[0]}});
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& l : lines) std::printf("%s\n", l.dump().c_str());
  return 0;
}

// One rank of the multi-process tests, started by tools/launch (env:// rendezvous).
//
//   mp_worker oss_parity     OSS(Adam, SGD) vs the all-reduce reference, 10 steps
//   mp_worker fail_rank R    rank R exits with code 3; the others wait in a collective
#include <shardopt/oss.h>

#include "model.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <cstdio>
#include <cstring>
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: mp_worker oss_parity | fail_rank R" << std::endl;
    return 2;
  }
  try {
    at::set_num_threads(1);
    auto group = init_process_group(InitOptions().timeout(std::chrono::seconds(60)));
    if (std::strcmp(argv[1], "oss_parity") == 0) {
      oss_parity(*group, group, "Adam", optimizer<optim::Adam>(optim::AdamOptions(1e-2)));
      oss_parity(*group, group, "SGD", optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9)));
      return 0;
    }
    if (std::strcmp(argv[1], "fail_rank") == 0 && argc > 2) {
      if (group->rank() == std::atoi(argv[2])) return 3;
      at::Tensor t = at::ones({1});
      group->allreduce(t);  // never completes: the launcher must stop this rank
      return 0;
    }
    std::cerr << "mp_worker: unknown command " << argv[1] << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

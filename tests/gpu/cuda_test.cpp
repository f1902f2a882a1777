// OSS and ShardedDDP on CUDA tensors over NCCL. These run where a CUDA device is visible and are
// reported as skipped (not passed) everywhere else.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/fused_step.h>

#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace shardopt {
namespace {

namespace optim = torch::optim;

#define SHARDOPT_NEEDS_CUDA() \
  if (!at::globalContext().hasCUDA()) GTEST_SKIP() << "no CUDA device visible: not run"

std::shared_ptr<ProcessGroup> nccl_world_of_one() {
  return init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("nccl").rank(0).world_size(1));
}

TEST(Cuda, NcclGroupRefusesCpuParametersNamingThem) {
  SHARDOPT_NEEDS_CUDA();
  auto g = nccl_world_of_one();
  std::vector<at::Tensor> params{at::zeros({4}).requires_grad_()};
  try {
    OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    ADD_FAILURE() << "a CPU parameter in an NCCL group must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 0 is on cpu but the process group uses NCCL"), std::string::npos)
        << e.what();
  }
}

// A CUDA model under OSS + ShardedDDP steps like torch::optim::Adam on a copy, through a freeze
// and an unfreeze of the first layer.
TEST(Cuda, OssAndShardedDdpOnCudaMatchTorchOptim) {
  SHARDOPT_NEEDS_CUDA();
  auto g = nccl_world_of_one();
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Linear(32, 4));
  model->to(at::kCUDA);
  auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  OSS oss(model->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
  ShardedDDP ddp(model.ptr(), oss);
  optim::Adam ref_opt(ref->parameters(), optim::AdamOptions(1e-2));
  for (int step = 0; step < 6; ++step) {
    const bool frozen = step >= 2 && step < 4;
    for (auto& p : model[0]->parameters()) p.requires_grad_(!frozen);
    for (auto& p : (*ref)[0]->parameters()) p.requires_grad_(!frozen);
    at::Tensor x = torch::randn({8, 16}, at::kCUDA), y = torch::randn({8, 4}, at::kCUDA);
    ddp.zero_grad(true);
    ddp.forward(x).sub(y).pow(2).mean().backward();
    oss.step();
    // fp32 CUDA parameters take kernels/'s fused AdamW/Adam kernel (a build with nvcc).
    EXPECT_TRUE(oss.stepped_fused()) << fused_step_unsupported(oss.local_optimizer());
    ref_opt.zero_grad();
    ref->forward(x).sub(y).pow(2).mean().backward();
    ref_opt.step();
  }
  const auto mine = model->parameters(), theirs = ref->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_TRUE(mine[i].is_cuda());
    EXPECT_LE(testing::rel_diff(mine[i].cpu(), theirs[i].cpu()), 1e-5) << "parameter " << i;
  }
}

}  // namespace
}  // namespace shardopt

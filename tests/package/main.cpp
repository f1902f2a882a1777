// A user's program against the installed package: one rank, OSS(Adam) over a Linear layer, one
// step, a checkpoint saved and loaded. Started by the installed launcher (RANK set), each rank
// joins the launcher's group instead and sums its rank with the others.
#include <shardopt/shardopt.h>
#include <shardopt/checkpoint.h>
// The paths docs/api.md names for each piece, as a user includes them.
#include <shardopt/comm.h>
#include <shardopt/grad_scaler.h>
#include <shardopt/oss.h>
#include <shardopt/sampler.h>
#include <shardopt/sharded_ddp.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  if (std::getenv("RANK")) {  // under shardopt-launch
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo"));
    auto sum = torch::full({1}, static_cast<float>(group->rank()));
    group->allreduce(sum);
    std::printf("consumer rank %d of %d: sum of ranks %g\n", group->rank(), group->size(), sum.item<float>());
    return 0;
  }
  auto group = shardopt::init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                            shardopt::InitOptions().backend("gloo").rank(0).world_size(1));
  torch::nn::Linear model(4, 2);
  shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.1)), group);
  const auto before = model->weight.clone();
  model->forward(torch::ones({3, 4})).sum().backward();
  opt.step();
  TORCH_CHECK(!torch::equal(before, model->weight), "the step did not move the weights");
  const std::string path = std::string(argc > 1 ? argv[1] : ".") + "/consumer.ckpt";
  shardopt::save_checkpoint(path, *model, opt, {});
  shardopt::load_checkpoint(path, *model, opt);
  std::printf("consumer ok: stepped, saved and loaded %s\n", path.c_str());
  return 0;
}

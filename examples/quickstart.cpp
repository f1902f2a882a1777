// Data-parallel training with a sharded optimizer: run with tools/launch -n 2 build/quickstart
#include <shardopt/shardopt.h>
#include <torch/torch.h>

int main() {
  auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo"));  // env:// from the launcher
  torch::manual_seed(0);  // the same initial weights on every rank
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)), group);
  shardopt::ShardedDDP ddp(model.ptr(), opt);  // gradients reduced to the rank that owns them
  const auto x = torch::randn({1024, 16}), y = x.sum(1, true).sin();  // a toy dataset
  shardopt::BalancedSampler sampler(x.size(0), *group, shardopt::SamplerOptions(32).seed(1));
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    for (auto& p : model[0]->parameters()) p.requires_grad_(epoch != 2);  // first layer frozen in epoch 2
    sampler.set_epoch(epoch);
    double loss_sum = 0;
    for (int64_t step = 0; step < sampler.steps_per_epoch(); ++step) {
      const auto idx = torch::tensor(sampler.batch(step).indices);
      ddp.zero_grad();
      auto loss = torch::mse_loss(ddp.forward(x.index_select(0, idx)), y.index_select(0, idx));
      loss.backward();
      opt.step();
      loss_sum += loss.item<double>();
    }
    shardopt::TrainingState state;
    state.epoch = epoch + 1;
    shardopt::save_checkpoint("quickstart.ckpt", *model, opt, state);  // collective; rank 0 writes
    if (group->rank() == 0) {
      std::printf("epoch %lld: loss %.4f, optimizer state on this rank %lld bytes\n", static_cast<long long>(epoch),
                  loss_sum / sampler.steps_per_epoch(), static_cast<long long>(opt.local_state_bytes()));
    }
  }
}

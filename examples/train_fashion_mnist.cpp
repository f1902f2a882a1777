// Data-parallel training of an MLP on Fashion-MNIST with shardopt.
//
//   tools/launch -n 2 build/train_fashion_mnist --epochs 2
//
// BalancedSampler gives every rank its share of each global batch (the same number of steps on
// every rank; padding of the last step is masked out of the loss), ShardedDDP reduces each
// gradient to the rank that owns it, and OSS(Adam) keeps only this rank's shard of the optimizer
// state. Prints the loss per epoch and, per rank, optimizer-state and gradient bytes against the
// unsharded figures.
#include <shardopt/shardopt.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/functional/loss.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <zlib.h>

#include <cstdio>
#include <iostream>
#include <string>

namespace {

// Reads a gzipped IDX file (big-endian header: magic, dims) into a uint8 tensor.
at::Tensor read_idx(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  TORCH_CHECK(f, "cannot open ", path, " (install the dataset-fashion-mnist package)");
  auto read_u32 = [&] {
    unsigned char b[4];
    TORCH_CHECK(gzread(f, b, 4) == 4, "truncated IDX header in ", path);
    return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
  };
  const uint32_t magic = read_u32();
  TORCH_CHECK((magic >> 8) == 0x08, "unexpected IDX magic in ", path);
  std::vector<int64_t> dims(magic & 0xff);
  for (auto& d : dims) d = read_u32();
  at::Tensor t = at::empty(dims, at::kByte);
  const int64_t n = t.numel();
  TORCH_CHECK(gzread(f, t.data_ptr<uint8_t>(), static_cast<unsigned>(n)) == n, "truncated IDX data in ", path);
  gzclose(f);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST with a sharded optimizer (run under tools/launch)"};
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int epochs = 2, batch = 64;
  double lr = 1e-3;
  app.add_option("--data", data_dir, "directory with the gzipped IDX files");
  app.add_option("--epochs", epochs, "epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch, "samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Adam learning rate")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    at::set_num_threads(1);
    auto group = shardopt::init_process_group(shardopt::InitOptions().backend("gloo"));  // CPU tensors
    const int rank = group->rank(), world = group->size();

    at::Tensor images = read_idx(data_dir + "/train-images-idx3-ubyte.gz").to(at::kFloat).div_(255).reshape({-1, 784});
    at::Tensor labels = read_idx(data_dir + "/train-labels-idx1-ubyte.gz").to(at::kLong);
    images = (images - 0.2860) / 0.3530;

    at::manual_seed(0);  // identical initial weights on every rank
    // Whole tensors are sharded, so layers of similar size shard evenly.
    torch::nn::Sequential model(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                torch::nn::ReLU(), torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
    shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(lr)),
                      group);
    // Each rank's loss is the sum over its real samples; the gradient is divided by the number
    // of real samples in the global step, so padded last steps weigh exactly right.
    shardopt::ShardedDDP ddp(model.ptr(), opt,
                             shardopt::ShardedDDPOptions().grad_scaling(shardopt::GradScaling::kGlobalSamples));
    shardopt::BalancedSampler sampler(images.size(0), *group, shardopt::SamplerOptions(batch).seed(0));

    int64_t grad_bytes = 0, all_grad_bytes = 0;
    for (auto& p : model->parameters()) all_grad_bytes += p.numel() * 4;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      sampler.set_epoch(epoch);
      double loss_sum = 0;
      for (int64_t step = 0; step < sampler.steps_per_epoch(); ++step) {
        shardopt::Batch b = sampler.batch(step);
        at::Tensor idx = at::tensor(b.indices, at::kLong);
        at::Tensor real = at::tensor(std::vector<float>(b.real.begin(), b.real.end()));
        ddp.zero_grad(true);
        ddp.set_global_samples(b.global_real);
        ddp.pre_forward();  // Sequential has a template forward(): call it after pre_forward()
        at::Tensor per_sample = torch::nn::functional::cross_entropy(
            model->forward(images.index_select(0, idx)), labels.index_select(0, idx),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
        at::Tensor loss = (per_sample * real).sum();
        loss.backward();
        grad_bytes = ddp.local_grad_bytes();
        opt.step();
        loss_sum += loss.item<double>();
      }
      at::Tensor sum = at::full({1}, loss_sum, at::kDouble);
      group->allreduce(sum);
      if (rank == 0) {
        std::printf("epoch %d: mean training loss %.4f over %lld steps of %lld samples\n", epoch,
                    sum.item<double>() / images.size(0), (long long)sampler.steps_per_epoch(),
                    (long long)batch * world);
      }
    }

    at::Tensor mine = at::full({1}, opt.local_state_bytes(), at::kLong), total = mine.clone();
    group->allreduce(total);
    std::printf("rank %d: optimizer state %lld bytes of %lld unsharded (%.1f%%); gradients after backward %lld bytes "
                "of %lld (%.1f%%); partition imbalance %.2f%%\n",
                rank, (long long)mine.item<int64_t>(), (long long)total.item<int64_t>(),
                100.0 * mine.item<int64_t>() / total.item<int64_t>(), (long long)grad_bytes, (long long)all_grad_bytes,
                100.0 * grad_bytes / all_grad_bytes, 100.0 * opt.imbalance());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

// Data-parallel training of an MLP on Fashion-MNIST with a sharded optimizer (OSS).
//
//   tools/launch -n 2 build/train_fashion_mnist --epochs 2
//
// Each rank reads its share of every global batch, gradients are averaged over the ranks, and
// OSS(Adam) keeps only this rank's shard of the optimizer state. Prints per-rank optimizer-state
// bytes against the unsharded figure and the loss per epoch.
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
    auto group = shardopt::init_process_group();
    const int rank = group->rank(), world = group->size();

    at::Tensor images = read_idx(data_dir + "/train-images-idx3-ubyte.gz").to(at::kFloat).div_(255).reshape({-1, 784});
    at::Tensor labels = read_idx(data_dir + "/train-labels-idx1-ubyte.gz").to(at::kLong);
    images = (images - 0.2860) / 0.3530;

    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    at::manual_seed(0);  // identical initial weights on every rank
    // Whole tensors are sharded, so layers of similar size shard evenly.
    torch::nn::Sequential model(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                torch::nn::ReLU(), torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
    shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::Adam>(torch::optim::AdamOptions(lr)),
                      group);

    const int64_t n = images.size(0), global = static_cast<int64_t>(batch) * world;
    const int64_t steps = n / global;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      at::Tensor order = at::randperm(n, gen);  // same generator and seed: same order on every rank
      double loss_sum = 0;
      for (int64_t step = 0; step < steps; ++step) {
        at::Tensor idx = order.narrow(0, step * global + rank * batch, batch);
        opt.zero_grad(true);
        at::Tensor loss = torch::nn::functional::cross_entropy(model->forward(images.index_select(0, idx)),
                                                               labels.index_select(0, idx));
        loss.backward();
        for (auto& p : model->parameters()) {
          group->allreduce(p.mutable_grad());
          p.mutable_grad().div_(world);
        }
        opt.step();
        loss_sum += loss.item<double>();
      }
      at::Tensor mean = at::full({1}, loss_sum / steps, at::kDouble);
      group->allreduce(mean);
      if (rank == 0) std::printf("epoch %d: mean training loss %.4f over %lld steps\n", epoch, mean.item<double>() / world, (long long)steps);
    }

    at::Tensor mine = at::full({1}, opt.local_state_bytes(), at::kLong), total = mine.clone();
    group->allreduce(total);
    std::printf("rank %d: optimizer state %lld bytes, unsharded %lld bytes (%.1f%%), partition imbalance %.2f%%\n",
                rank, (long long)mine.item<int64_t>(), (long long)total.item<int64_t>(),
                100.0 * mine.item<int64_t>() / total.item<int64_t>(), 100.0 * opt.partition().imbalance());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

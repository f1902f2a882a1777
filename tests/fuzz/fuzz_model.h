// What the fuzz targets load bytes into: a small module, an OSS(Adam) over it on a world of one
// (a store in this process), and a sampler; fresh for each input (the group is made once), so
// that one input's partial load cannot change the next one's starting point. And a decoder that
// turns bytes into nested dicts, lists, numbers and small tensors, so that the loaders see
// arbitrary structures without going through LibTorch's own unpickler.
#pragma once

#include <shardopt/shardopt.h>

#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <memory>

namespace shardopt::fuzz {

inline std::shared_ptr<ProcessGroup> world_of_one() {
  static auto group = init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                         InitOptions().backend("gloo").rank(0).world_size(1));
  return group;
}

struct Target {
  std::shared_ptr<ProcessGroup> group = world_of_one();
  torch::nn::Linear model{nullptr};
  std::unique_ptr<OSS> oss;
  std::unique_ptr<BalancedSampler> sampler;

  Target() {
    torch::manual_seed(0);
    model = torch::nn::Linear(4, 3);
    oss = std::make_unique<OSS>(model->parameters(), optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)), group);
    model->forward(torch::ones({2, 4})).sum().backward();
    oss->step();  // state to replace
    sampler = std::make_unique<BalancedSampler>(1000, 0, 1, SamplerOptions(10).seed(3));
  }
};

// Bytes -> a value: each byte picks a kind (dict, list, int, double, string, tensor, none) and
// the following bytes its contents; depth and sizes are bounded.
class Decoder {
 public:
  Decoder(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}

  torch::IValue value(int depth = 0) {
    switch (depth > 4 ? 2 + byte() % 5 : byte() % 7) {
      case 0: {
        c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
        for (int n = byte() % 6; n > 0 && p_ < end_; --n) {
          torch::IValue key = byte() % 2 ? torch::IValue(key_name()) : torch::IValue(static_cast<int64_t>(byte() % 8));
          d.insert_or_assign(key, value(depth + 1));
        }
        return d;
      }
      case 1: {
        c10::impl::GenericList l(c10::AnyType::get());
        for (int n = byte() % 6; n > 0 && p_ < end_; --n) l.push_back(value(depth + 1));
        return l;
      }
      case 2: return static_cast<int64_t>(static_cast<int8_t>(byte())) * (byte() % 2 ? 1 : 1000003);
      case 3: return static_cast<double>(static_cast<int8_t>(byte())) / 16.0;
      case 4: return key_name();
      case 5: {
        std::vector<int64_t> shape;
        for (int n = byte() % 3; n > 0; --n) shape.push_back(byte() % 5);
        return at::full(shape, static_cast<double>(byte()) / 64.0, byte() % 2 ? at::kFloat : at::kDouble);
      }
      default: return torch::IValue();
    }
  }

 private:
  uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  std::string key_name() {
    static const char* names[] = {"state", "param_groups", "params", "lr", "betas", "eps", "weight_decay", "amsgrad",
                                  "step", "exp_avg", "exp_avg_sq", "model", "trainable", "optimizer", "rng",
                                  "sampler", "scalars", "epoch", "world_size", "checkpoint_id", "optimizer_layout",
                                  "format", "weight", "bias", "version", "fingerprint", "dataset_size",
                                  "global_batch_size", "next_step", "consolidated", "sharded"};
    return names[byte() % (sizeof(names) / sizeof(names[0]))];
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace shardopt::fuzz

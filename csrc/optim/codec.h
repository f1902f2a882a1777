// Translation between LibTorch optimizer objects and PyTorch's state_dict layout, so that a
// consolidated OSS state loads into torch.optim in Python and back. Internal to shardopt.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>

namespace shardopt::detail {

using GenericDict = c10::impl::GenericDict;

GenericDict make_string_dict();

// Given a per-element state tensor of one parameter and its entry's name ("exp_avg", ...), the
// tensor to keep in its place: the same one, or a copy placed elsewhere (a ShardStore's slab).
using StatePlacer = std::function<at::Tensor(const char* kind, const at::Tensor& tensor)>;

struct OptimizerCodec {
  std::string name;  // PyTorch's class name: "Adam", "SGD", ...
  // Options of one param group, with PyTorch's key names (without "params").
  GenericDict (*encode_options)(const torch::optim::OptimizerOptions& options);
  // Options from a saved group; keys missing in `saved` keep the value in `base`.
  std::unique_ptr<torch::optim::OptimizerOptions> (*decode_options)(
      const GenericDict& saved, const torch::optim::OptimizerOptions& base);
  GenericDict (*encode_state)(const torch::optim::OptimizerParamState& state);
  std::unique_ptr<torch::optim::OptimizerParamState> (*decode_state)(const GenericDict& saved);
  // Replaces each defined per-element state tensor of `state` by what `place` returns for it.
  void (*place_state)(torch::optim::OptimizerParamState& state, const StatePlacer& place);
};

// The codec for `optimizer`'s concrete type (Adam, AdamW, SGD, RMSprop, Adagrad), or null. These
// optimizers update a parameter from its own state only, so that state can move between ranks.
const OptimizerCodec* find_codec(const torch::optim::Optimizer& optimizer);
// The same; throws naming the type when there is none.
const OptimizerCodec& codec_for(const torch::optim::Optimizer& optimizer);
// Whether an entry of an encoded state is a per-element state tensor (exp_avg, momentum_buffer,
// ...), shaped like its parameter, rather than the "step" counter or a scalar.
bool is_state_tensor(const GenericDict::iterator::value_type& entry);
// `encoded` with every state tensor that views part of a larger storage (a ShardStore slab) copied
// to a storage of its own: what is serialized (pickling a view writes its whole storage).
GenericDict with_own_storage(const GenericDict& encoded);
// Bytes of the state tensors in an encoded state.
int64_t state_tensor_bytes(const GenericDict& state);

}  // namespace shardopt::detail

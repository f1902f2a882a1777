// Translation between LibTorch optimizer objects and PyTorch's state_dict layout, so that a
// consolidated OSS state loads into torch.optim in Python and back. Internal to shardopt.
#pragma once

#include <shardopt/optim/state_layout.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardopt::detail {

using GenericDict = c10::impl::GenericDict;

GenericDict make_string_dict();

// Given a per-element state tensor of one parameter and its entry's name ("exp_avg", ...), the
// tensor to keep in its place: the same one, or a copy placed elsewhere (a ShardStore's slab).
using StatePlacer = std::function<at::Tensor(const char* kind, const at::Tensor& tensor)>;

struct OptimizerCodec {
  std::string name;  // PyTorch's class name: "Adam", "SGD", ...
  StateKind kind = StateKind::kElementWise;
  // Options of one param group, with PyTorch's key names (without "params").
  std::function<GenericDict(const torch::optim::OptimizerOptions& options)> encode_options;
  // Options from a saved group; keys missing in `saved` keep the value in `base`.
  std::function<std::unique_ptr<torch::optim::OptimizerOptions>(const GenericDict& saved,
                                                                const torch::optim::OptimizerOptions& base)>
      decode_options;
  std::function<GenericDict(const torch::optim::OptimizerParamState& state)> encode_state;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const GenericDict& saved)> decode_state;
  // Replaces each defined state tensor of `state` by what `place` returns for it.
  std::function<void(torch::optim::OptimizerParamState& state, const StatePlacer& place)> place_state;
  // Elements of state one parameter of `sizes` holds under `options` (all its state tensors).
  std::function<int64_t(const torch::optim::OptimizerOptions& options, at::IntArrayRef sizes)> state_numel;
  // The shape state entry `entry` has for a parameter of `sizes` (the parameter's, unless a
  // whole-tensor optimizer's registration says otherwise).
  std::function<std::vector<int64_t>(const std::string& entry, at::IntArrayRef sizes)> entry_shape;
  // The cost of one parameter's update (whole-tensor optimizers balance it; Note [Ownership by kind]).
  std::function<double(at::IntArrayRef sizes)> cost;
  // The state entries StateFormat::kInt8 may keep in 8-bit codes (Note [8-bit state slabs]).
  std::vector<std::string> compressible;
  bool compresses(const std::string& entry) const {
    for (const auto& c : compressible) {
      if (c == entry) return true;
    }
    return false;
  }
};

// The codec for `optimizer`'s concrete type (Adam, AdamW, SGD, RMSprop, Adagrad, Muon, or one
// registered through shardopt/optim/state_layout.h), or null.
const OptimizerCodec* find_codec(const torch::optim::Optimizer& optimizer);
// The same; throws naming the type when there is none.
const OptimizerCodec& codec_for(const torch::optim::Optimizer& optimizer);
// The state tensors of a saved parameter's state (`values`) that `codec` does not keep: state
// saved by another optimizer class.
std::vector<std::string> entries_not_kept(const OptimizerCodec& codec, const GenericDict& values);
// The optimizers shardopt knows (built in and registered) that keep state entry `entry`, as text:
// "SGD, RMSprop or Muon"; empty when none does.
std::string optimizers_keeping(const std::string& entry);
// Whether an entry of an encoded state is a per-element state tensor (exp_avg, momentum_buffer,
// ...), shaped like its parameter, rather than the "step" counter or a scalar.
bool is_state_tensor(const GenericDict::iterator::value_type& entry);
// `encoded` with every state tensor copied to a storage of its own: a value the next step does
// not change (state outside a slab, such as a small tensor's fp32 state beside 8-bit slabs, is
// stepped in place), and what is serialized (pickling a view writes its whole storage).
GenericDict with_own_storage(const GenericDict& encoded);
// Registers shardopt::Muon through the public registration (muon.cpp); find_codec calls it once.
void register_muon();
// Whether 8-bit state entry `entry` takes the signed dynamic map (first moments, momentum) or the
// unsigned one (exp_avg_sq, max_exp_avg_sq, and the entries registrations mark
// StateCodes::kUnsigned): one map per entry name, process-wide.
bool signed_state(const std::string& entry);
// Bytes of the state tensors in an encoded state.
int64_t state_tensor_bytes(const GenericDict& state);

}  // namespace shardopt::detail

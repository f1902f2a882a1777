// OSSOptions::state_format: the formats' names, and what each format refuses (Note [State
// formats] and Note [8-bit state slabs] in state_slabs.cpp).
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include "optim/codec.h"

#include <ATen/core/Tensor.h>

#include <string>

namespace shardopt {

std::string state_format_name(StateFormat format) {
  switch (format) {
    case StateFormat::kFloat32: return "fp32";
    case StateFormat::kBFloat16: return "bf16";
    case StateFormat::kInt8: return "int8";
  }
  return "unknown";
}

StateFormat parse_state_format(const std::string& name) {
  for (StateFormat f : {StateFormat::kFloat32, StateFormat::kBFloat16, StateFormat::kInt8}) {
    if (state_format_name(f) == name) return f;
  }
  SHARDOPT_CHECK(false, "unknown state format '", name, "': use fp32, bf16 or int8");
  return StateFormat::kFloat32;
}

// After the ranks agreed on the parameters and state_format (check_params_across_ranks) and on
// the optimizers (check_options_alike): every rank refuses alike.
void OSS::check_state_format() const {
  const StateFormat format = options_.state_format();
  if (format == StateFormat::kFloat32) return;
  const std::string option = std::string("OSSOptions::state_format(") + state_format_name(format) + ")";
  SHARDOPT_CHECK(options_.fused_step(), option, " needs the fused step, which keeps the state in that format; "
                 "leave OSSOptions::fused_step on");
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const Unit& unit = units_[unit_of_group_[g]];
    if (format == StateFormat::kInt8) {
      // Adam, AdamW and SGD through the fused step; Muon and registered optimizers that mark a
      // state tensor compressible through their own step on decoded state (Note [8-bit state slabs]).
      SHARDOPT_CHECK(unit.fused_kind || (unit.codec && !unit.codec->compressible.empty()), option, ": param group ", g,
                     "'s optimizer is ", unit.class_name, ", whose state this format does not hold; it holds Adam's, "
                     "AdamW's, SGD's, Muon's and those of registered optimizers that mark a state tensor compressible "
                     "(OptimizerRegistration::compressible; or use StateFormat::kFloat32)");
      continue;
    }
    SHARDOPT_CHECK(unit.fused_kind, option, ": param group ", g, "'s optimizer is ", unit.class_name, ", whose state this "
                   "format does not hold; it holds Adam's, AdamW's and SGD's (use StateFormat::kFloat32)");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    SHARDOPT_CHECK(p.device().is_cpu(), option, ": parameter ", i, " is on ", p.device(),
                   "; this format is stepped on the CPU only (use StateFormat::kFloat32 on CUDA)");
    SHARDOPT_CHECK(mixed_ || p.scalar_type() == at::kFloat, option, ": parameter ", i, " is ", p.scalar_type(),
                   "; this format holds the state of fp32 parameters (or of mixed precision's fp32 masters)");
  }
}

}  // namespace shardopt

#include "optim/master_weights.h"

#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <string>

namespace shardopt {

std::string MixedPrecision::problem() const {
  if (!param_dtype_) {
    return reduce_dtype_ ? "MixedPrecision: reduce_dtype is set but param_dtype is not (set param_dtype to kBFloat16 "
                           "or kHalf)"
                         : "";
  }
  const auto p = *param_dtype_;
  if (p != c10::kBFloat16 && p != c10::kHalf) {
    return "MixedPrecision: param_dtype must be kBFloat16 or kHalf, got " + std::string(c10::toString(p));
  }
  const auto r = reduce_or_param_dtype();
  if (r != c10::kFloat && r != p) {
    return "MixedPrecision: reduce_dtype must be kFloat32 or the param_dtype (" + std::string(c10::toString(p)) +
           "), got " + std::string(c10::toString(r));
  }
  return "";
}

namespace detail {

// Note [Mixed precision]
// The recipe is the one of DeepSpeed's ZeRO and FSDP's MixedPrecision, with the fp32 copy
// sharded: the module holds param_dtype parameters (2 bytes each on every rank) and each owner
// holds, for the ranges it owns only, an fp32 master tensor; the wrapped optimizer steps the
// masters, so its state is fp32 and sharded too (Adam: 4 + 4 + 4 bytes per owned element).
// A step upcasts the owned gradient (reduced in reduce_dtype), steps the master, writes the
// master rounded to param_dtype into the parameter's range, and the parameter sync moves
// param_dtype bytes. The masters are the holdings' tensors (OSS's Holding::tensor), so
// everything that follows holdings follows them: a re-partition or new split ranges move the
// master values with the state (state_migration.cpp), and a frozen parameter keeps its master
// for when it is unfrozen. The masters start from the fp32 values the parameters had at
// construction (rank 0's), so nothing of the fp32 initialisation is lost to the cast.
std::vector<at::Tensor> cast_to_param_dtype(ProcessGroup& global, const std::vector<at::Tensor>& params,
                                            const MixedPrecision& options) {
  // The parameters are floating point (OSS checked) and their dtypes agreed on; the options are
  // agreed on here.
  const std::string problem = options.problem();
  at::Tensor bad = at::full({1}, problem.empty() ? 0 : 1, at::kLong);
  global.allreduce(bad, Reduction::kMax);
  SHARDOPT_CHECK(problem.empty(), problem);
  SHARDOPT_CHECK(bad.item<int64_t>() == 0, "mixed precision: another rank has bad options or parameters (its "
                 "error names them)");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> fp32;
  for (const auto& p : params) {
    // Whatever the parameters' floating dtype, the masters start from their values in fp32.
    at::Tensor values = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    if (global.size() > 1) global.broadcast(values, 0);
    fp32.push_back(values);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor p = params[i];
    p.set_data(fp32[i].to(*options.param_dtype()));
  }
  return fp32;
}

at::Tensor make_master(const at::Tensor& param, const at::Tensor& fp32_source, Range in_param) {
  at::NoGradGuard no_grad;
  const at::Tensor& from = fp32_source.defined() ? fp32_source : param;
  const bool whole = in_param.begin == 0 && in_param.size() == param.numel();
  at::Tensor values = from.detach().reshape(-1).narrow(0, in_param.begin, in_param.size());
  at::Tensor master = values.to(at::TensorOptions().dtype(at::kFloat).device(param.device()), /*non_blocking=*/false,
                                /*copy=*/true);
  return whole ? master.view(param.sizes()) : master;
}

void set_master(const at::Tensor& master, const at::Tensor& values, Range in_param) {
  at::NoGradGuard no_grad;
  master.view(-1).copy_(values.detach().reshape(-1).narrow(0, in_param.begin, in_param.size()));
}

void write_back(const at::Tensor& param, const at::Tensor& master, Range in_param) {
  at::NoGradGuard no_grad;
  param.detach().view(-1).narrow(0, in_param.begin, in_param.size()).copy_(master.reshape(-1));
}

}  // namespace detail
}  // namespace shardopt

// Mixed precision's master weights: the fp32 copies of the ranges a rank owns (Note [Mixed
// precision] in master_weights.cpp). Internal to shardopt; OSS composes them.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/mixed_precision.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardopt::detail {

// Checks `options` on every rank (an error names the bad option, on every rank), makes every
// parameter global rank 0's values, and casts the parameters to param_dtype (set_data: the
// module keeps its tensors). Returns the fp32 values the masters start from (the parameters'
// values, whatever their floating dtype), one per parameter. Collective over `global`.
std::vector<at::Tensor> cast_to_param_dtype(ProcessGroup& global, const std::vector<at::Tensor>& params,
                                            const MixedPrecision& options);

// A new master for elements `in_param` of `param`: from `fp32_source` (the parameter's fp32
// values) when defined, else from the parameter itself, upcast. The parameter's shape for the
// whole range, flat otherwise.
at::Tensor make_master(const at::Tensor& param, const at::Tensor& fp32_source, Range in_param);

// Sets `master` (a master for elements `in_param`) from those elements of `values`, a tensor of
// the parameter's shape in any dtype (the parameter itself, or a saved master weight).
void set_master(const at::Tensor& master, const at::Tensor& values, Range in_param);

// Writes the rounded `master` into elements `in_param` of `param`.
void write_back(const at::Tensor& param, const at::Tensor& master, Range in_param);

}  // namespace shardopt::detail

// The fused step: Adam, AdamW and SGD (momentum, Nesterov, dampening, weight decay) stepped in
// one pass over the memory of each run of parameters with the same options and step count
// (vectorised; on the CPU one parallel region per run, on LibTorch's intra-op threads), on the
// wrapped optimizer's own state, so that state_dict(), checkpoints,
// consolidation and rebalancing see torch::optim's layout unchanged.
//
// The result equals the optimizer's own step() to float rounding (tested at 1e-6 relative),
// including weight decay, AMSGrad, each parameter's own step count and parameters without a
// gradient (skipped, state untouched). OSS uses it by default (OSSOptions::fused_step).
#pragma once

#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <string>

namespace shardopt {

// Empty when fused_step() can step `optimizer` now; otherwise why not (another optimizer class,
// a parameter or gradient that is not a dense contiguous float/double CPU tensor, ...).
std::string fused_step_unsupported(const torch::optim::Optimizer& optimizer);

// Steps `optimizer` like optimizer.step() (no closure). Call only when
// fused_step_unsupported(optimizer) is empty.
void fused_step(torch::optim::Optimizer& optimizer);

}  // namespace shardopt

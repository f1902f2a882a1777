// Every difference between the LibTorch versions shardopt builds against lives here.
#pragma once

#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <string>

namespace shardopt::compat {

// Optimizer state is keyed by the parameter's TensorImpl: `void*` in LibTorch 2.x (a string of
// the address in 1.x). set_data() into a flat buffer keeps the key; a new tensor object does not.
using StateKey = void*;
inline StateKey state_key(const at::Tensor& param) {
  return param.unsafeGetTensorImpl();
}

}  // namespace shardopt::compat

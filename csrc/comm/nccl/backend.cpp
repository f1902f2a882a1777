// The NCCL backend: built only when the NCCL headers (from the nvidia-nccl wheel) and the CUDA
// toolkit are found; see CMakeLists.txt.
#include "comm/backends.h"

#include <ATen/Context.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace shardopt::detail {

bool nccl_compiled() {
  return true;
}

bool nccl_usable() {
  return at::globalContext().hasCUDA();
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace shardopt::detail

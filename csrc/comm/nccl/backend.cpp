// The NCCL backend: built only when the NCCL headers (from the nvidia-nccl wheel) and the CUDA
// toolkit are found; see CMakeLists.txt.
#include "comm/backends.h"

#include <shardopt/comm/process_group.h>

#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
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
  // One device per rank: the launcher's local rank picks it (NCCL refuses two ranks on one GPU).
  const int local = local_rank();
  const int devices = static_cast<int>(c10::cuda::device_count());
  if (local >= 0 && devices > 0) c10::cuda::set_device(static_cast<c10::DeviceIndex>(local % devices));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace shardopt::detail

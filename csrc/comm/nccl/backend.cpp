// The NCCL backend: built only when the NCCL headers (from the nvidia-nccl wheel) and the CUDA
// toolkit are found; see CMakeLists.txt.
#include "comm/backends.h"

#include <shardopt/check.h>
#include <shardopt/comm/launch_env.h>
#include <shardopt/comm/process_group.h>

#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

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
  // NCCL refuses two ranks on one GPU ("invalid usage", at the first collective): said here, at
  // the group's creation, in words.
  int local_size = -1;  // the launcher's count of ranks on this machine, where it gives one
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* v = env_var(name); v != nullptr && local_size < 0) local_size = std::atoi(v);
  }
  SHARDOPT_CHECK(devices == 0 || local_size <= devices, local_size,
                 " ranks on this machine (LOCAL_WORLD_SIZE) but ", devices,
                 " CUDA device(s) visible: NCCL needs a GPU of its own for each rank; start at most ", devices,
                 " ranks per machine, or use the Gloo backend (shardopt train --device cpu)");
  if (local >= 0 && devices > 0) c10::cuda::set_device(static_cast<c10::DeviceIndex>(local % devices));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  // Note [NCCL timeouts]
  // A group's communicator is made at its first collective, and a blocking ncclCommInitRank waits
  // for every peer for ever: a rank whose peer never reaches a collective would hang there (seen
  // on an H100: a world of 2 whose rank 1 never called the all-reduce rank 0 waited in). In
  // nonblocking mode c10d polls the communicator's creation and gives up after
  // TORCH_NCCL_NONBLOCKING_TIMEOUT seconds, which is set to the group's timeout unless the user set
  // it (c10d reads it once per process: the first NCCL group's timeout holds for all). Once the
  // communicator exists, waiting for a collective gives up after the timeout too
  // (PendingWork::wait passes it; c10d then blocks the host thread until completion or timeout).
  options->config.blocking = 0;
  if (env_var("TORCH_NCCL_NONBLOCKING_TIMEOUT") == nullptr) {
    const auto seconds = std::max<int64_t>(1, std::chrono::ceil<std::chrono::seconds>(timeout).count());
    setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", std::to_string(seconds).c_str(), /*overwrite=*/0);
  }
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace shardopt::detail

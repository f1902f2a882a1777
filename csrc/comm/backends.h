// Backend factories behind init_process_group. Internal to shardopt.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace shardopt::detail {

// True when this build carries the NCCL backend (csrc/comm/nccl/) and a CUDA device is visible.
bool nccl_usable();
// Whether this build carries the NCCL backend at all.
bool nccl_compiled();
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout);

}  // namespace shardopt::detail

// Stand-in when this build has no NCCL backend (no NCCL headers or CUDA toolkit found).
#include <shardopt/check.h>
#include "comm/backends.h"

#include <c10/util/Exception.h>

namespace shardopt::detail {

bool nccl_compiled() {
  return false;
}

bool nccl_usable() {
  return false;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds) {
  SHARDOPT_CHECK(false, "this build has no NCCL backend (NCCL headers or the CUDA toolkit were not found)");
}

}  // namespace shardopt::detail

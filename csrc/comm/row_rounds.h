// Rows in log2(size) rounds of one peer each (Note [Row rounds] in row_rounds.cpp). Internal:
// ProcessGroup's rows (rows.cpp) start them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>

namespace c10d {
class Backend;
class ProcessGroupGloo;
class Work;
}  // namespace c10d

namespace shardopt::detail {

struct GroupFailure;

// What the rounds of one collective need of its group: the Gloo backend (which runs them on its
// worker thread), the failure watch, this rank, the size, the timeout of each transfer and the
// collective's tag (Note [Reduce to one owner]).
struct RoundsOf {
  c10d::ProcessGroupGloo* backend = nullptr;
  std::shared_ptr<GroupFailure> failure;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  int tag = 0;
};

// The Gloo backend that moves a CPU buffer's rows by rounds in a group of `size` ranks over
// `backend`, or null where they go otherwise: at any size of at least kRoundsMinSize, the
// reduce-scatter of rows of `row_bytes` (at most kRoundsRowBytes), and the all-gather of rows
// of any size; below kRoundsMinSize, the reduce-scatter of rows of at least kWorkerSumRowBytes
// (direct transfers, summed on the worker thread).
inline constexpr int kRoundsMinSize = 8;
inline constexpr int64_t kRoundsRowBytes = 64 * 1024;
inline constexpr int64_t kWorkerSumRowBytes = 1024 * 1024;
c10d::ProcessGroupGloo* reduce_scatter_rounds_on(c10d::Backend& backend, int size, int64_t row_bytes);
c10d::ProcessGroupGloo* allgather_rounds_on(c10d::Backend& backend, int size);

// Started: completes when `result` holds the sum over ranks of row `rank` of their `flat`
// (this rank's contribution to it read from `own`), divided by `divisor`. `flat` is only read.
c10::intrusive_ptr<c10d::Work> start_reduce_scatter_rounds(const RoundsOf& group, at::Tensor flat, at::Tensor own,
                                                           at::Tensor result, double divisor);
// Started: completes when every row r of `flat` holds rank r's row r.
c10::intrusive_ptr<c10d::Work> start_allgather_rounds(const RoundsOf& group, at::Tensor flat);

}  // namespace shardopt::detail

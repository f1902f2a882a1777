// Reduce scratch: the memory of the buckets a rank sends, bounded and kept for the next backward
// (ShardedDDP::take_scratch, recycle_oldest_launched, give_back_scratch, reduce_scratch_bytes).
#include <shardopt/ddp/sharded_ddp.h>

#include "ddp/executor.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace shardopt {

// Note [Reduce scratch]
// A bucket this rank sends to other owners (a row bucket's other rows, a whole-parameter bucket
// another rank owns) needs memory only while its reduction is in flight. Allocating it afresh
// for every bucket of every backward puts the whole model's gradients in flight at once, and
// glibc hands such large blocks back to the system between steps, so every step faults them in
// again, page by page, zeroed by the kernel (docs/benchmarks-log.md, "Where the rows' cost on the
// GPT-2 shape goes"). So at most kScratchBuckets buckets hold scratch at once: a bucket that
// needs it while that many do waits for the oldest launched one (its reduction, and the sum
// its owner does, finish there, in the backward's hook, as DeepSpeed's ZeRO-2 waits for its
// previous bucket), which gives its memory back. Scratch given back is kept for the next buckets
// and the next backward, at most kScratchBuckets pieces, the smallest dropped first: between steps
// a rank keeps at most that many buckets of scratch (reduce_scratch_bytes()), and during the
// backward it holds no more. Only launched buckets are waited for, in launch order, which is the
// same on every rank, so a wait never needs a collective some rank has not started. Where no
// launched bucket holds scratch (gradients that fill many buckets at once), the bucket takes new
// memory. The receive memory of ranks past the second (the reduce-scatter's other incoming rows,
// ProcessGroup's) is not kept.
namespace {
constexpr size_t kScratchBuckets = 4;
}

at::Tensor ShardedDDP::take_scratch(Bucket& b, int64_t elements) {
  while (scratch_held_ >= kScratchBuckets && recycle_oldest_launched()) {
  }
  auto best = scratch_.end();
  for (auto it = scratch_.begin(); it != scratch_.end(); ++it) {
    if (it->numel() >= elements && it->dtype() == b.options.dtype() && it->device() == b.options.device() &&
        (best == scratch_.end() || it->numel() < best->numel())) {
      best = it;
    }
  }
  if (best != scratch_.end()) {
    b.scratch = std::move(*best);
    scratch_.erase(best);
  } else {
    b.scratch = at::empty({elements}, b.options);
  }
  most_scratch_held_ = std::max(most_scratch_held_, ++scratch_held_);
  return b.scratch.numel() == elements ? b.scratch : b.scratch.narrow(0, 0, elements);
}

bool ShardedDDP::recycle_oldest_launched() {
  for (; next_recycle_ < next_launch_; ++next_recycle_) {
    Bucket& b = buckets_[next_recycle_];
    if (!b.scratch.defined()) continue;
    b.work.wait();
    give_back_scratch(b);
    ++next_recycle_;
    return true;
  }
  return false;
}

void ShardedDDP::give_back_scratch(Bucket& b) {
  if (!b.scratch.defined()) return;
  b.buffer = at::Tensor();
  --scratch_held_;
  scratch_.push_back(std::move(b.scratch));
  b.scratch = at::Tensor();
  if (scratch_.size() > kScratchBuckets) {
    scratch_.erase(std::min_element(scratch_.begin(), scratch_.end(),
                                    [](const at::Tensor& x, const at::Tensor& y) { return x.numel() < y.numel(); }));
  }
}

int64_t ShardedDDP::reduce_scratch_bytes() const {
  int64_t bytes = 0;
  for (const auto& t : scratch_) bytes += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  return bytes;
}

}  // namespace shardopt

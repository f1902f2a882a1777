// Rows in log2(size) rounds of one peer each: recursive halving for the reduce-scatter, recursive
// doubling for the all-gather (Bruck's algorithm for both at other sizes), run on Gloo's worker
// thread (Note [Row rounds]).
#include "comm/row_rounds.h"

#include <shardopt/check.h>

#include "comm/failure_watch.h"
#include "comm/sum_into.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace shardopt::detail {

// Note [Row rounds]
// Note [Rows]'s direct transfers cost each rank 2(size - 1) point-to-point operations per
// collective. Where every transfer is latency (small rows, many ranks) that count is the cost:
// at 16 ranks four rounds of one peer each took about half the direct transfers' time for a
// bucket of 40,960 floats, in both collectives (docs/benchmarks-log.md, "Ranks as processes at
// world 16"). So at a size of at least kRoundsMinSize, on Gloo and for
// CPU buffers on the exact wire, the rows go in rounds, log2(size) at a power of two:
// - reduce-scatter, recursive halving: at distance d = size/2, size/4, .., 1, a rank keeps the
//   half of its range of rows that holds its own row, sends the other half to rank ^ d, and adds
//   what that rank sends of the kept half. The first round adds into a buffer of half the rows,
//   so `flat` is only read, as by direct transfers; this rank's contribution to its own row is
//   read from `own` (ShardedDDP's own gradients of a row bucket stay where they are). The sum is
//   a tree, this rank's own contribution first, then one partner's partial sum per round: the
//   same on every run, but not the rank-order chain of the direct transfers and of the reduce
//   to one owner. It is used only while a row is at most kRoundsRowBytes: on large rows the
//   halving's passes over memory cost more than the transfers it saves (at 8 ranks a 4 MiB
//   bucket's reduce-scatter was slower in rounds than direct: docs/benchmarks-log.md).
// - all-gather, recursive doubling: at distance d = 1, 2, .., size/2, a rank sends the d rows it
//   holds to rank ^ d and receives that rank's d, in place. Rounds were as fast or faster at every
//   size measured, so it has no row limit. At any other size of at least kRoundsMinSize the
//   all-gather takes ceil(log2(size)) rounds of Bruck's algorithm: a rank gathers rows rank,
//   rank + 1, .. (mod size) in that order in a buffer of its own; at distance d = 1, 2, 4, .. it
//   sends its first min(d, size - d) rows to rank - d and receives as many from rank + d after
//   them, and at the end the rows go to their places (one more pass over the buffer). The
//   reduce-scatter there runs Bruck's rounds backwards, under the same row limit as halving: a
//   rank copies its contributions into a buffer of its own in the order rank, rank + 1, ..
//   (mod size), its own row from `own`; at distance d = .., 4, 2, 1 it sends its rows [d, d +
//   min(d, size - d)) to rank + d and adds the as many rows that rank - d sends into its first
//   ones. Each contribution reaches each row's owner by exactly one path (the all-gather's,
//   reversed), so row 0 of the buffer ends as the sum: a tree again, this rank's contribution
//   first, deterministic.
// - below kRoundsMinSize, the reduce-scatter of rows of at least kWorkerSumRowBytes goes by the
//   direct transfers, with the same bits (this rank's row, then the others' in rank order, then
//   the division, in one pass: sum_to), but as a work on the worker thread, which sums each
//   bucket as its rows arrive, during backward, instead of on the rank's thread when it waits
//   for the bucket. On the GPT-2 shape that made the step faster at two and four ranks
//   (docs/benchmarks-log.md, "Large rows summed on the worker thread"); on small rows the
//   worker's hand-off cost more than the sum it moved (the small model's step was slower with
//   every row on the worker), hence the bound.
// Each rank sends (size - 1) / size of the buffer either way, the least any scheme can (the wire
// bytes do not change), and each ordered pair of ranks exchanges at most one message per
// collective (Bruck's distances are distinct below the size), so one tag serves it. A round can
// start only when the round before it has arrived, so something must drive the rounds while the
// rank computes: the collective is a work on the Gloo backend's queue, run by its worker thread
// in the order collectives were started, as Gloo's own collectives are. Every rank starts its collectives in the same order, so the
// earliest unfinished one is running on every rank and none waits for a peer that is busy with a
// later one: waiting for them in any order cannot deadlock. The sum of the reduce-scatter is
// done there too, overlapping the rank's own work. Each transfer is waited for at most the
// group's timeout, and under the failure watch a group broken elsewhere aborts it
// (Note [Failure watch]); a failure fails the work, whose wait names the collective.
namespace {

// ProcessGroupGloo's queue of works for its worker thread (protected: reached through a
// pointer to the member, named in a derived class).
struct GlooQueue : c10d::ProcessGroupGloo {
  static auto entry() { return &GlooQueue::enqueue; }
};

class Rounds final : public c10d::ProcessGroupGloo::AsyncWork {
 public:
  Rounds(std::function<void()> body, c10d::OpType type, std::chrono::milliseconds timeout)
      : AsyncWork(nullptr, {}, type, 0, timeout), body_(std::move(body)) {}
  void run() override {
    body_();
    body_ = nullptr;  // the tensors it holds
  }
  const std::vector<at::Tensor> getInputTensors() override { return {}; }
  const std::vector<at::Tensor> getOutputTensors() override { return {}; }

 private:
  std::function<void()> body_;
};

c10::intrusive_ptr<c10d::Work> start_rounds(const RoundsOf& group, c10d::OpType type, std::function<void()> body) {
  SHARDOPT_CHECK(group.backend, "rows by rounds need a Gloo backend");
  auto work = c10::make_intrusive<Rounds>(std::move(body), type, group.timeout);
  (group.backend->*GlooQueue::entry())(work);
  return work;
}

void wait_transfer(const RoundsOf& group, const c10::intrusive_ptr<c10d::Work>& work) {
  GroupFailure& failure = *group.failure;
  if (!failure.watching) {
    TORCH_CHECK(work->wait(group.timeout), "not completed");
    return;
  }
  TORCH_CHECK(!failure.broken, "abandoned: a rank saw a failure");
  failure.wait_watched(work, group.timeout);
}

// Sends `out` to rank `to` and receives `in` from rank `from`, both in flight together.
void transfer(const RoundsOf& group, const at::Tensor& out, int to, const at::Tensor& in, int from) {
  TORCH_CHECK(!group.failure->broken || !group.failure->watching, "abandoned: a rank saw a failure");
  std::vector<at::Tensor> outs{out}, ins{in};
  auto send = group.backend->send(outs, to, group.tag);
  auto recv = group.backend->recv(ins, from, group.tag);
  wait_transfer(group, send);
  wait_transfer(group, recv);
}

void exchange(const RoundsOf& group, const at::Tensor& out, const at::Tensor& in, int peer) {
  transfer(group, out, peer, in, peer);
}

bool power_of_two_at_least(int size, int least) { return size >= least && (size & (size - 1)) == 0; }

}  // namespace

c10d::ProcessGroupGloo* allgather_rounds_on(c10d::Backend& backend, int size) {
  return size >= kRoundsMinSize ? dynamic_cast<c10d::ProcessGroupGloo*>(&backend) : nullptr;
}

c10d::ProcessGroupGloo* reduce_scatter_rounds_on(c10d::Backend& backend, int size, int64_t row_bytes) {
  if (size > 1 && size < kRoundsMinSize && row_bytes >= kWorkerSumRowBytes) {
    return dynamic_cast<c10d::ProcessGroupGloo*>(&backend);
  }
  return row_bytes <= kRoundsRowBytes ? allgather_rounds_on(backend, size) : nullptr;
}

namespace {

// Below kRoundsMinSize: direct transfers, summed here in rank order as they arrive.
void reduce_scatter_direct(const RoundsOf& group, const at::Tensor& flat, const at::Tensor& own, at::Tensor& result,
                           double divisor) {
  const int size = group.size, rank = group.rank;
  const int64_t row = flat.numel() / size;
  TORCH_CHECK(!group.failure->broken || !group.failure->watching, "abandoned: a rank saw a failure");
  at::Tensor arrived = at::empty({row * (size - 1)}, flat.options());
  std::vector<at::Tensor> from(static_cast<size_t>(size));  // from[r]: rank r's contribution
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int k = 1; k < size; ++k) {
    const int to = (rank + k) % size, src = (rank - k + size) % size;
    std::vector<at::Tensor> outs{flat.narrow(0, to * row, row)};
    works.push_back(group.backend->send(outs, to, group.tag));
    from[static_cast<size_t>(src)] = arrived.narrow(0, (k - 1) * row, row);
    std::vector<at::Tensor> ins{from[static_cast<size_t>(src)]};
    works.push_back(group.backend->recv(ins, src, group.tag));
  }
  for (const auto& work : works) wait_transfer(group, work);
  std::vector<at::Tensor> in_rank_order;
  for (int r = 0; r < size; ++r) {
    if (r != rank) in_rank_order.push_back(from[static_cast<size_t>(r)]);
  }
  sum_to(result, own, in_rank_order, divisor != 1.0 ? row : 0, divisor);
}

// Bruck's, the all-gather's rounds backwards: `sums` row i is this rank's partial sum of row
// (rank + i) % size, its own contribution first; at distance d = .., 4, 2, 1 a rank sends its
// rows [d, d + count) to rank + d and adds what rank - d sends into rows [0, count).
void reduce_scatter_bruck(const RoundsOf& group, const at::Tensor& flat, const at::Tensor& own, at::Tensor& result,
                          double divisor) {
  const int size = group.size, rank = group.rank;
  const int64_t row = flat.numel() / size;
  at::Tensor incoming = at::empty({row * (size / 2)}, flat.options());
  at::Tensor sums = at::empty({row * size}, flat.options());
  const int to_end = size - rank;
  sums.narrow(0, 0, row).copy_(own);
  sums.narrow(0, row, (to_end - 1) * row).copy_(flat.narrow(0, (rank + 1) * row, (to_end - 1) * row));
  sums.narrow(0, to_end * row, rank * row).copy_(flat.narrow(0, 0, rank * row));
  int top = 1;
  while (top * 2 < size) top *= 2;
  for (int d = top; d >= 1; d /= 2) {
    const int64_t count = std::min(d, size - d) * row;  // at most size / 2 rows
    at::Tensor in = incoming.narrow(0, 0, count);
    transfer(group, sums.narrow(0, d * row, count), (rank + d) % size, in, (rank - d + size) % size);
    sums.narrow(0, 0, count).add_(in);
  }
  result.copy_(sums.narrow(0, 0, row));
  if (divisor != 1.0) result.div_(divisor);
}

// Recursive halving, at a power-of-two size.
void reduce_scatter_halving(const RoundsOf& group, const at::Tensor& flat, const at::Tensor& own, at::Tensor& result,
                            double divisor) {
  const int size = group.size, rank = group.rank;
  const int64_t row = flat.numel() / size;
  at::Tensor incoming = at::empty({row * (size / 2)}, flat.options());
  at::Tensor sum = at::empty({row * (size / 2)}, flat.options());  // rows [base, base + size/2)
  int base = 0, lo = 0, n = size;
  for (int d = size / 2; d >= 1; d /= 2) {
    const int half = n / 2;
    const bool low = (rank & d) == 0;
    const int keep = low ? lo : lo + half, give = low ? lo + half : lo;
    at::Tensor in = incoming.narrow(0, 0, half * row);
    if (d == size / 2) {
      exchange(group, flat.narrow(0, give * row, half * row), in, rank ^ d);
      base = keep;
      // sum = this rank's kept rows (its own row from `own`) + the partner's
      const int64_t before = (rank - keep) * row, after = (keep + half - rank - 1) * row;
      auto seg = [&](int64_t at_row, int64_t from, int64_t len, const at::Tensor& mine) {
        if (len == 0) return;
        at::Tensor to = sum.narrow(0, at_row, len);
        at::add_out(to, mine, in.narrow(0, from, len));
      };
      seg(0, 0, before, flat.narrow(0, keep * row, before));
      seg(before, before, row, own);
      seg(before + row, before + row, after, flat.narrow(0, (rank + 1) * row, after));
    } else {
      exchange(group, sum.narrow(0, (give - base) * row, half * row), in, rank ^ d);
      sum.narrow(0, (keep - base) * row, half * row).add_(in);
    }
    lo = keep;
    n = half;
  }
  result.copy_(sum.narrow(0, (rank - base) * row, row));
  if (divisor != 1.0) result.div_(divisor);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> start_reduce_scatter_rounds(const RoundsOf& group, at::Tensor flat, at::Tensor own,
                                                           at::Tensor result, double divisor) {
  return start_rounds(group, c10d::OpType::REDUCE_SCATTER, [group, flat, own, result, divisor]() mutable {
    at::NoGradGuard no_grad;
    if (group.size < kRoundsMinSize) {
      reduce_scatter_direct(group, flat, own, result, divisor);
    } else if (power_of_two_at_least(group.size, 1)) {
      reduce_scatter_halving(group, flat, own, result, divisor);
    } else {
      reduce_scatter_bruck(group, flat, own, result, divisor);
    }
  });
}

c10::intrusive_ptr<c10d::Work> start_allgather_rounds(const RoundsOf& group, at::Tensor flat) {
  return start_rounds(group, c10d::OpType::ALLGATHER, [group, flat]() mutable {
    at::NoGradGuard no_grad;
    const int rank = group.rank, size = group.size;
    const int64_t row = flat.numel() / size;
    if (power_of_two_at_least(size, 1)) {  // recursive doubling, in place
      for (int d = 1; d < size; d *= 2) {
        const int peer = rank ^ d;
        exchange(group, flat.narrow(0, (rank / d) * d * row, d * row), flat.narrow(0, (peer / d) * d * row, d * row),
                 peer);
      }
      return;
    }
    // Bruck's: `held` row i is row (rank + i) % size once it has arrived.
    at::Tensor held = at::empty({row * size}, flat.options());
    held.narrow(0, 0, row).copy_(flat.narrow(0, rank * row, row));
    for (int d = 1; d < size; d *= 2) {
      const int64_t count = std::min(d, size - d) * row;
      transfer(group, held.narrow(0, 0, count), (rank - d + size) % size, held.narrow(0, d * row, count),
               (rank + d) % size);
    }
    const int to_end = size - rank;  // held rows [0, to_end) are rows [rank, size), the rest [0, rank)
    flat.narrow(0, (rank + 1) * row, (to_end - 1) * row).copy_(held.narrow(0, row, (to_end - 1) * row));
    flat.narrow(0, 0, rank * row).copy_(held.narrow(0, to_end * row, rank * row));
  });
}

}  // namespace shardopt::detail

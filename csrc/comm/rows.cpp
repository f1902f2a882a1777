// Rows: one reduce-scatter and one all-gather over a flat buffer cut into one equal row per
// rank (ProcessGroup::reduce_scatter_rows_async, allgather_rows_async).
#include <shardopt/check.h>
#include <shardopt/comm/process_group.h>

#include "comm/row_rounds.h"
#include "comm/sum_into.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace shardopt {

// Note [Rows]
// A buffer of size() equal rows, row r owned by rank r, is what a sharded step needs from the
// wire: each rank's gradients of row r summed on rank r (a reduce-scatter), then each owner's
// updated row copied to every rank (an all-gather). One collective each, whatever the world
// size. On NCCL they are NCCL's own, in place (the output row inside the input buffer, as NCCL
// allows). On Gloo, whose reduce-scatter is an all-reduce and whose all-gather was several times
// slower than the per-owner path (docs/benchmarks-log.md), they are direct transfers, as in Note [Reduce to
// one owner]: at step k = 1 .. size-1, rank r sends row (r + k) % size to its owner and receives
// its own row from rank (r - k) % size, so each rank sends (size - 1) / size of the buffer, the
// least any scheme can, and no two ranks send to the same rank at the same step. The owner sums
// what it received into its row in rank order, its own row first, as the reduce to one owner
// does: the same bits as that path for the same row. One tag serves every transfer of one
// collective (each ordered pair of ranks exchanges one message in it). At a power-of-two size of
// 8 or more, where each of these transfers is mostly latency, small rows go in log2(size) rounds
// of one peer each instead, and the all-gather also at other sizes of 8 or more (Note [Row
// rounds] in row_rounds.cpp).
//
// Note [Rows with padding]
// Rows of whole parameters (Note [Rows of whole parameters] in flat_layout.h) are as long as
// their bucket's longest, so the others end in padding, and where ranks outnumber a bucket's
// matrices most rows are empty. With `used` (one count per row), row r's live elements are its
// first used[r] and its last `exact_tail` (ShardedDDP's flags), or none where used[r] is 0; the
// rest of the row is padding that no rank reads. On Gloo, on the exact wire, the collectives then
// move only live elements, by the direct transfers above, also at sizes where rows otherwise go
// in rounds (a round moves ranges of rows, padding and all): an empty row costs no message, and a
// row with padding between its two parts travels packed into one. Each live element is summed
// as in a whole row (the same rank order, the same bits); the padding of the result keeps this
// rank's own values. NCCL's reduce-scatter and all-gather need equal rows, and the compressed
// wires cut whole rows into blocks: there the padding travels (docs/benchmarks-log.md measures both).
namespace {

int64_t nbytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

void check_rows(const char* what, const at::Tensor& flat, int size) {
  SHARDOPT_CHECK(flat.dim() == 1 && flat.is_contiguous(), what, ": needs a 1-D contiguous tensor, got sizes ",
                 flat.sizes(), flat.is_contiguous() ? "" : " (not contiguous)");
  SHARDOPT_CHECK(flat.numel() % size == 0, what, ": ", flat.numel(), " elements do not cut into ", size,
                 " equal rows (pad the buffer to a multiple of the group size)");
}

// `t`, where defined, must be one contiguous row of `flat` (`row` elements, flat's dtype and device).
void check_row(const char* what, const char* which, const at::Tensor& t, const at::Tensor& flat, int64_t row) {
  if (!t.defined()) return;
  SHARDOPT_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() == row && t.dtype() == flat.dtype() &&
                     t.device() == flat.device(),
                 what, ": ", which, " must be one contiguous row of ", row, " elements of ", flat.dtype(), " on ",
                 flat.device(), ", got sizes ", t.sizes(), " of ", t.dtype(), " on ", t.device());
}

// Which elements of each row move (Note [Rows with padding]): row r's first head(r) and its last
// `tail`, or, without `used`, all of it.
struct LiveRows {
  int64_t row = 0;
  int64_t tail = 0;
  const std::vector<int64_t>* used = nullptr;  // empty: every row whole
  int64_t head(int r) const { return used->empty() ? row - tail : (*used)[static_cast<size_t>(r)]; }
  int64_t numel(int r) const { return used->empty() ? row : head(r) == 0 ? 0 : head(r) + tail; }
  bool whole(int r) const { return numel(r) == row; }
  // Whether some row has padding: only then do the rows take the padded path.
  bool padded(int size) const {
    for (int r = 0; r < size && !used->empty(); ++r) {
      if (!whole(r)) return true;
    }
    return false;
  }
  // Row r's live elements of `rows` (one contiguous tensor: the row itself, or its parts packed).
  at::Tensor live(const at::Tensor& rows, int r) const {
    at::Tensor all = rows.narrow(0, r * row, row);
    if (whole(r)) return all;
    if (tail == 0) return all.narrow(0, 0, head(r));
    return at::cat({all.narrow(0, 0, head(r)), all.narrow(0, row - tail, tail)});
  }
};

void check_used(const char* what, const std::vector<int64_t>& used, int size, int64_t row, int64_t tail) {
  if (used.empty()) return;
  SHARDOPT_CHECK(static_cast<int>(used.size()) == size, what, ": `used` needs one count per row (", size, "), got ",
                 used.size());
  for (size_t r = 0; r < used.size(); ++r) {
    SHARDOPT_CHECK(used[r] >= 0 && used[r] + tail <= row, what, ": row ", r, "'s ", used[r], " used elements and ",
                   tail, " exact ones do not fit in a row of ", row);
  }
}

}  // namespace

PendingWork ProcessGroup::reduce_scatter_rows_async(at::Tensor& flat, double divisor, at::Tensor out,
                                                    std::optional<at::ScalarType> wire, int64_t exact_tail,
                                                    const std::vector<int64_t>& used) {
  return reduce_scatter_rows(flat, divisor, std::move(out), false, wire, exact_tail, used);
}

PendingWork ProcessGroup::reduce_scatter_rows_into_async(at::Tensor& flat, at::Tensor& out, double divisor,
                                                         std::optional<at::ScalarType> wire, int64_t exact_tail,
                                                         const std::vector<int64_t>& used) {
  SHARDOPT_CHECK(out.defined(), "reduce_scatter_rows_into_async: needs an output row");
  return reduce_scatter_rows(flat, divisor, out, true, wire, exact_tail, used);
}

PendingWork ProcessGroup::reduce_scatter_rows(at::Tensor& flat, double divisor, at::Tensor out, bool own_in_out,
                                              std::optional<at::ScalarType> wire, int64_t exact_tail,
                                              const std::vector<int64_t>& used) {
  check_rows("reduce_scatter_rows_async", flat, size_);
  SHARDOPT_CHECK(divisor > 0, "reduce_scatter_rows_async: divisor must be positive, got ", divisor);
  const int64_t row = flat.numel() / size_;
  check_row("reduce_scatter_rows_async", "the output", out, flat, row);
  check_used("reduce_scatter_rows_async", used, size_, row, std::max<int64_t>(exact_tail, 0));
  constexpr auto kind = CommStats::kReduceScatter;
  at::Tensor mine = out.defined() ? out : flat.narrow(0, rank_ * row, row);
  if (wire && *wire != flat.scalar_type() && size_ > 1) {
    return reduce_scatter_rows_on_wire(flat, divisor, mine, own_in_out ? out : flat.narrow(0, rank_ * row, row),
                                       *wire, exact_tail);
  }
  check_in(kind, nbytes(flat), -1);
  if (size_ == 1) {  // the one row is this rank's: nothing to send
    if (out.defined() && !own_in_out) mine.copy_(flat);
    if (divisor != 1.0) mine.div_(divisor);
    return PendingWork();
  }
  // NCCL's reduce-scatter reads this rank's contribution from its row of the input.
  if (own_in_out && backend_name_ != "gloo") flat.narrow(0, rank_ * row, row).copy_(out);
  const int64_t row_bytes = row * flat.element_size();
  const LiveRows live{row, std::max<int64_t>(exact_tail, 0), &used};
  const bool padded = live.padded(size_);
  if (auto* rounds = flat.is_cpu() && !padded ? detail::reduce_scatter_rounds_on(*backend_, size_, row_bytes)
                                              : nullptr) {
    const detail::RoundsOf group{rounds, failure_, rank_, size_, timeout_, next_p2p_tag()};
    at::Tensor own = own_in_out ? out : flat.narrow(0, rank_ * row, row);
    return track(kind, nbytes(flat),
                 [&] { return detail::start_reduce_scatter_rounds(group, flat, own, mine, divisor); });
  }
  if (backend_name_ == "gloo") {
    const int tag = next_p2p_tag();
    at::Tensor host = staged(flat);  // a CUDA tensor's pinned copy (Note [Staging])
    const bool was_staged = !host.is_same(flat);
    const int64_t arriving = live.numel(rank_);  // of this rank's row, from each other rank
    std::vector<at::Tensor> incoming(static_cast<size_t>(size_));
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    for (int k = 1; k < size_; ++k) {
      const int dst = (rank_ + k) % size_, src = (rank_ - k + size_) % size_;
      if (live.numel(dst) > 0) {
        std::vector<at::Tensor> out{live.live(host, dst)};
        transfers.push_back(start(kind, [&] { return backend_->send(out, dst, tag); }));
      }
      if (arriving == 0) continue;
      // With this rank's contribution elsewhere, its row of the buffer, never sent, takes the
      // first row that arrives (no memory of its own for it).
      const bool into_own_row = own_in_out && !was_staged && k == 1 && live.whole(rank_);
      std::vector<at::Tensor> in{into_own_row ? host.narrow(0, rank_ * row, row)
                                              : at::empty({arriving}, host.options())};
      incoming[static_cast<size_t>(src)] = in[0];
      transfers.push_back(start(kind, [&] { return backend_->recv(in, src, tag); }));
    }
    // Sums the live parts of this rank's row: the head, then the tail.
    auto sum = [divisor, head = live.head(rank_), tail = live.tail, row, arriving](
                   at::Tensor& into, const at::Tensor& own, const std::vector<at::Tensor>& in_rank_order) {
      if (arriving == 0) return;
      if (arriving == row) {
        detail::sum_to(into, own, in_rank_order, divisor != 1.0 ? row : 0, divisor);
        return;
      }
      if (!into.is_same(own)) into.copy_(own);  // the padding keeps this rank's own values
      for (const auto& [at_row, at_in, len] : {std::tuple{int64_t{0}, int64_t{0}, head}, {row - tail, head, tail}}) {
        if (len == 0) continue;
        std::vector<at::Tensor> parts;
        for (const auto& in : in_rank_order) parts.push_back(in.narrow(0, at_in, len));
        at::Tensor part = into.narrow(0, at_row, len);
        detail::sum_to(part, part, parts, divisor != 1.0 ? len : 0, divisor);
      }
    };
    auto finish = [mine, host, incoming, rank = rank_, row, was_staged, own_in_out, sum]() mutable {
      std::vector<at::Tensor> in_rank_order;
      for (size_t r = 0; r < incoming.size(); ++r) {
        if (static_cast<int>(r) != rank) in_rank_order.push_back(incoming[r]);
      }
      at::Tensor own = host.narrow(0, rank * row, row);
      if (own_in_out) {  // this rank's contribution is in `mine`
        if (was_staged) own.copy_(mine);
        else own = mine;
      }
      if (was_staged) {  // summed on the host, then copied to the device
        sum(own, own, in_rank_order);
        mine.copy_(own);
      } else {
        sum(mine, own, in_rank_order);
      }
    };
    if (transfers.empty()) {  // every row empty: nothing moves, and the collective still counts
      stats_.calls[kind] += 1;
      stats_.bytes[kind] += nbytes(flat);
      finish();
      return PendingWork();
    }
    PendingWork work = track_all(kind, nbytes(flat), std::move(transfers));
    work.set_then(std::move(finish));
    return work;
  }
  at::Tensor in = staged(flat);
  const bool was_staged = !in.is_same(flat);
  at::Tensor result = was_staged || !out.defined() ? in.narrow(0, rank_ * row, row) : out;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto work = track(kind, nbytes(flat), [&] { return backend_->_reduce_scatter_base(result, in, opts); });
  work.set_then([mine, result, divisor]() mutable {
    if (divisor != 1.0) result.div_(divisor);
    if (!mine.is_same(result)) mine.copy_(result);
  });
  return work;
}

PendingWork ProcessGroup::allgather_rows_async(at::Tensor& flat, std::optional<at::ScalarType> wire,
                                               const at::Tensor& own, const std::vector<int64_t>& used) {
  check_rows("allgather_rows_async", flat, size_);
  const int64_t row = flat.numel() / size_;
  check_row("allgather_rows_async", "this rank's row", own, flat, row);
  check_used("allgather_rows_async", used, size_, row, 0);
  if (wire && *wire != flat.scalar_type() && size_ > 1) return allgather_rows_on_wire(flat, *wire, own);
  if (own.defined()) flat.narrow(0, rank_ * row, row).copy_(own);
  constexpr auto kind = CommStats::kAllgather;
  check_in(kind, nbytes(flat), -1);
  if (size_ == 1) return PendingWork();
  const LiveRows live{row, 0, &used};
  const bool padded = live.padded(size_);
  if (auto* rounds = flat.is_cpu() && !padded ? detail::allgather_rounds_on(*backend_, size_) : nullptr) {
    const detail::RoundsOf group{rounds, failure_, rank_, size_, timeout_, next_p2p_tag()};
    return track(kind, nbytes(flat), [&] { return detail::start_allgather_rounds(group, flat); });
  }
  if (backend_name_ == "gloo") {
    const int tag = next_p2p_tag();
    at::Tensor host = staged(flat);
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    for (int k = 1; k < size_; ++k) {
      const int dst = (rank_ + k) % size_, src = (rank_ - k + size_) % size_;
      if (live.numel(rank_) > 0) {
        std::vector<at::Tensor> out{live.live(host, rank_)};
        transfers.push_back(start(kind, [&] { return backend_->send(out, dst, tag); }));
      }
      if (live.numel(src) == 0) continue;
      std::vector<at::Tensor> in{live.live(host, src)};  // a prefix of the row, in place
      transfers.push_back(start(kind, [&] { return backend_->recv(in, src, tag); }));
    }
    if (transfers.empty()) {  // every row empty: nothing moves, and the collective still counts
      stats_.calls[kind] += 1;
      stats_.bytes[kind] += nbytes(flat);
      return PendingWork();
    }
    PendingWork work = track_all(kind, nbytes(flat), std::move(transfers));
    unstage_after(work, flat, host);
    return work;
  }
  at::Tensor all = staged(flat);
  at::Tensor mine = all.narrow(0, rank_ * row, row);
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  auto work = track(kind, nbytes(flat), [&] { return backend_->_allgather_base(all, mine, opts); });
  unstage_after(work, flat, all);
  return work;
}

}  // namespace shardopt

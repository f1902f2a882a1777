// The collectives on a compressed wire (Note [Gradient wire], Note [Parameter wire], Note [Int8
// wire] in wire.cpp): each contribution encoded where it leaves, decoded where it arrives, its
// sender's own copy taken through the same codec so that every rank holds the same values.
#include <shardopt/check.h>
#include <shardopt/comm/process_group.h>

#include "comm/sum_into.h"
#include "comm/wire_codec.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <utility>
#include <vector>

namespace shardopt {

PendingWork ProcessGroup::broadcast_on_wire(at::Tensor& tensor, int root, at::ScalarType wire) {
  SHARDOPT_CHECK(tensor.is_contiguous(), "broadcast_async with a wire dtype needs a contiguous tensor");
  // The root rounds in place; the others decode what arrives (Note [Parameter wire]).
  const detail::WireCodec codec(wire);
  at::Tensor flat = tensor.view(-1);
  at::Tensor packed = at::empty({codec.packed_numel(flat.numel())}, tensor.options().dtype(codec.packed_dtype()));
  if (rank_ == root) codec.encode_rounding(flat, packed);
  PendingWork work = broadcast_async(packed, root);
  if (rank_ != root) work.and_then([flat, packed, codec]() mutable { codec.decode_into(packed, flat); });
  return work;
}

PendingWork ProcessGroup::reduce_on_wire(at::Tensor& tensor, int root, int64_t numel, double divisor,
                                         at::ScalarType wire, int64_t exact_tail) {
  // Every contribution travels in `wire`; the root widens and sums in the tensor's dtype (int8's
  // in fp32), its own rounded through `wire` too (Note [Gradient wire] in wire.cpp).
  const detail::WireCodec codec(wire, exact_tail);
  if (codec.int8() && (backend_name_ != "gloo" || wire_by_collectives_)) {
    return reduce_by_gather(tensor, root, numel, divisor, codec);
  }
  const int64_t bytes = codec.packed_bytes(tensor.numel());
  check_in(CommStats::kReduce, bytes, root);
  if (backend_name_ == "gloo") {
    const int tag = next_p2p_tag();
    const auto on_host = at::TensorOptions().device(at::kCPU).dtype(codec.packed_dtype());
    if (rank_ != root) {
      std::vector<at::Tensor> ts{codec.encode(tensor.is_cpu() ? tensor.view(-1) : tensor.view(-1).to(at::kCPU))};
      return track(CommStats::kReduce, bytes, [&] { return backend_->send(ts, root, tag); });
    }
    std::vector<at::Tensor> incoming;
    std::vector<c10::intrusive_ptr<c10d::Work>> recvs;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      std::vector<at::Tensor> ts{at::empty({codec.packed_numel(tensor.numel())}, on_host)};
      incoming.push_back(ts[0]);
      recvs.push_back(start(CommStats::kReduce, [&] { return backend_->recv(ts, r, tag); }));
    }
    PendingWork work = track_all(CommStats::kReduce, bytes, std::move(recvs));
    const at::Tensor own = tensor.is_cpu() ? tensor : tensor.to(at::kCPU);
    work.set_then([tensor, own, incoming, numel, divisor, codec]() mutable {
      at::Tensor sum = tensor.is_cpu() && tensor.is_contiguous() ? tensor : at::empty_like(own);
      detail::sum_decoded(sum, own, incoming, codec, numel, divisor);
      if (!sum.is_same(tensor)) tensor.copy_(sum);
    });
    return work;
  }
  std::vector<at::Tensor> ts{staged(tensor.to(wire))};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto work = track(CommStats::kReduce, bytes, [&] { return backend_->reduce(ts, opts); });
  if (rank_ == root) {
    work.set_then([tensor, packed = ts[0], numel, divisor]() mutable {
      tensor.copy_(packed);
      if (divisor != 1.0 && numel > 0) tensor.narrow(0, 0, numel).div_(divisor);
    });
  }
  return work;
}

// Every rank's contribution travels in `wire`; the owner widens what it receives and sums in the
// rows' own dtype (int8's in fp32), its own contribution rounded through `wire` first, in the
// exact path's order (Note [Gradient wire] in wire.cpp). `own` (which may be `mine`) is read once
// the transfers are done; a CUDA one is copied to the host at once.
PendingWork ProcessGroup::reduce_scatter_rows_on_wire(at::Tensor& flat, double divisor, const at::Tensor& mine,
                                                      const at::Tensor& own, at::ScalarType wire, int64_t exact_tail) {
  constexpr auto kind = CommStats::kReduceScatter;
  const int64_t row = flat.numel() / size_;
  const detail::WireCodec codec(wire, exact_tail);
  if (codec.int8() && (backend_name_ != "gloo" || wire_by_collectives_)) {
    return reduce_scatter_rows_by_alltoall(flat, divisor, mine, own, codec);
  }
  const int64_t bytes = codec.packed_bytes(row) * size_;
  check_in(kind, bytes, -1);
  if (backend_name_ == "gloo") {
    const int tag = next_p2p_tag();
    const auto on_host = at::TensorOptions().device(at::kCPU).dtype(codec.packed_dtype());
    // This rank's contribution stays here: on the host in its own dtype (a CUDA row copied out).
    const at::Tensor own_here = own.is_cpu() ? own : own.to(at::kCPU);
    std::vector<at::Tensor> incoming;
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    std::vector<at::Tensor> outgoing(static_cast<size_t>(size_));
    for (int k = 1; k < size_; ++k) {
      const int dst = (rank_ + k) % size_;
      at::Tensor sent = flat.narrow(0, dst * row, row);
      outgoing[static_cast<size_t>(dst)] = codec.encode(sent.is_cpu() ? sent : sent.to(at::kCPU));  // each row encoded once
    }
    std::vector<at::Tensor> by_rank(static_cast<size_t>(size_));
    for (int k = 1; k < size_; ++k) {
      const int dst = (rank_ + k) % size_, src = (rank_ - k + size_) % size_;
      std::vector<at::Tensor> out{outgoing[static_cast<size_t>(dst)]};
      transfers.push_back(start(kind, [&] { return backend_->send(out, dst, tag); }));
      std::vector<at::Tensor> in{at::empty({codec.packed_numel(row)}, on_host)};
      by_rank[static_cast<size_t>(src)] = in[0];
      transfers.push_back(start(kind, [&] { return backend_->recv(in, src, tag); }));
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) incoming.push_back(by_rank[static_cast<size_t>(r)]);
    }
    PendingWork work = track_all(kind, bytes, std::move(transfers));
    work.set_then([mine, outgoing, own_here, incoming, row, divisor, codec]() mutable {
      at::Tensor sum = mine.is_cpu() && mine.is_contiguous() ? mine : at::empty({row}, own_here.options());
      detail::sum_decoded(sum, own_here, incoming, codec, divisor != 1.0 ? row : 0, divisor);
      if (!sum.is_same(mine)) mine.copy_(sum);
    });
    return work;
  }
  // NCCL sums in the wire's dtype, in place in this rank's row of the packed buffer.
  at::Tensor packed = staged(flat.to(wire));
  packed.narrow(0, rank_ * row, row).copy_(own);
  at::Tensor result = packed.narrow(0, rank_ * row, row);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  auto work = track(kind, bytes, [&] { return backend_->_reduce_scatter_base(result, packed, opts); });
  work.set_then([mine, result, divisor]() mutable {
    mine.copy_(result);
    if (divisor != 1.0) mine.div_(divisor);
  });
  return work;
}

PendingWork ProcessGroup::allgather_rows_on_wire(at::Tensor& flat, at::ScalarType wire, const at::Tensor& own) {
  // This rank's row (from `own` where given) is rounded and travels in `wire`; the others' rows
  // are widened where they arrive (Note [Parameter wire]).
  const int64_t row = flat.numel() / size_;
  const detail::WireCodec codec(wire);
  const int64_t packed_row = codec.packed_numel(row);
  at::Tensor mine = flat.narrow(0, rank_ * row, row);
  at::Tensor packed = at::empty({packed_row * size_}, flat.options().dtype(codec.packed_dtype()));
  codec.encode_rounding(own.defined() ? own : mine, mine, packed.narrow(0, rank_ * packed_row, packed_row));
  PendingWork work = allgather_rows_async(packed);
  work.and_then([flat, packed, rank = rank_, size = size_, row, packed_row, codec]() mutable {
    for (int r = 0; r < size; ++r) {  // this rank's row is current already
      if (r != rank) codec.decode_into(packed.narrow(0, r * packed_row, packed_row), flat.narrow(0, r * row, row));
    }
  });
  return work;
}

// Note [Int8 wire on collectives]
// On Gloo the int8 reductions are direct transfers (above): each rank sends each peer that
// peer's row, packed, and receives its own. NCCL has no such transfers to build on (its sends
// block on the device unless grouped, and c10d groups them only for its own collectives) and
// sums in one dtype. There the packed contributions travel in one of NCCL's collectives per
// bucket, counted once in stats():
// - rows: one all-to-all. Each rank packs every other rank's row of `flat` on its device (this
//   rank's own slot goes unread), the all-to-all hands each rank the packed copies of its row
//   from every rank, and the owner decodes and sums them after its own, in rank order
//   (sum_decoded, on the device): the direct path's values, bit for bit.
// - reduce to one owner: one gather of the packed buckets to the root, summed alike.
// Each rank sends what the direct path sends; the all-to-all also moves this rank's unread slot
// within its own memory. The tests run this path on Gloo (wire_by_collectives_, set through
// testing::Introspection), CUDA tensors included (tests/gpu/cuda_gloo_worker.cpp); NCCL itself
// needs a GPU per rank and has not run it at world sizes above 1.
PendingWork ProcessGroup::reduce_scatter_rows_by_alltoall(at::Tensor& flat, double divisor, const at::Tensor& mine,
                                                          const at::Tensor& own, const detail::WireCodec& codec) {
  constexpr auto kind = CommStats::kReduceScatter;
  const int64_t row = flat.numel() / size_;
  const int64_t packed_row = codec.packed_numel(row);
  const int64_t bytes = codec.packed_bytes(row) * size_;
  check_in(kind, bytes, -1);
  at::Tensor packed = at::empty({packed_row * size_}, flat.options().dtype(codec.packed_dtype()));
  for (int r = 0; r < size_; ++r) {
    at::Tensor slot = packed.narrow(0, r * packed_row, packed_row);
    if (r == rank_) {
      slot.zero_();  // unread, sent to this rank itself
    } else {
      codec.encode_into(flat.narrow(0, r * row, row), slot);
    }
  }
  at::Tensor sent = staged(packed);
  at::Tensor received = at::empty_like(sent);
  c10d::AllToAllOptions opts;
  opts.timeout = timeout_;
  std::vector<int64_t> even;  // equal splits
  PendingWork work = track(kind, bytes, [&] { return backend_->alltoall_base(received, sent, even, even, opts); });
  work.set_then([mine, own, received, rank = rank_, size = size_, row, packed_row, divisor, codec]() mutable {
    const at::Tensor from = received.device() == mine.device() ? received : received.to(mine.device());
    std::vector<at::Tensor> incoming;
    for (int r = 0; r < size; ++r) {
      if (r != rank) incoming.push_back(from.narrow(0, r * packed_row, packed_row));
    }
    at::Tensor sum = mine.is_contiguous() ? mine : at::empty({row}, mine.options());
    detail::sum_decoded(sum, own, incoming, codec, divisor != 1.0 ? row : 0, divisor);
    if (!sum.is_same(mine)) mine.copy_(sum);
  });
  return work;
}

PendingWork ProcessGroup::reduce_by_gather(at::Tensor& tensor, int root, int64_t numel, double divisor,
                                           const detail::WireCodec& codec) {
  const int64_t bytes = codec.packed_bytes(tensor.numel());
  check_in(CommStats::kReduce, bytes, root);
  std::vector<at::Tensor> in{staged(codec.encode(tensor.view(-1)))};
  std::vector<std::vector<at::Tensor>> out(rank_ == root ? 1 : 0);
  if (rank_ == root) {
    for (int r = 0; r < size_; ++r) out[0].push_back(at::empty_like(in[0]));
  }
  c10d::GatherOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  PendingWork work = track(CommStats::kReduce, bytes, [&] { return backend_->gather(out, in, opts); });
  if (rank_ == root) {
    work.set_then([tensor, gathered = out[0], rank = rank_, numel, divisor, codec]() mutable {
      std::vector<at::Tensor> incoming;
      for (size_t r = 0; r < gathered.size(); ++r) {
        if (static_cast<int>(r) != rank) incoming.push_back(gathered[r].to(tensor.device()));
      }
      at::Tensor flat = tensor.view(-1);
      at::Tensor sum = tensor.is_contiguous() ? flat : at::empty_like(flat);
      detail::sum_decoded(sum, flat, incoming, codec, numel, divisor);
      if (!sum.is_same(flat)) flat.copy_(sum);
    });
  }
  return work;
}

}  // namespace shardopt

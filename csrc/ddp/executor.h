// The parts of ShardedDDP's backward executor that its source files share: an entry per
// parameter piece in a bucket, a hooked parameter, a bucket as the executor runs it, and how a
// gradient becomes a tensor over a bucket's memory (alias_at). Internal.
#pragma once

#include <shardopt/ddp/sharded_ddp.h>

#include "ddp/grad_slabs.h"
#include "optim/oss_for_ddp.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <vector>

namespace shardopt {

namespace detail {

// A tensor of `sizes` over `buffer`'s memory from element `offset` on, without being an autograd
// view of it, so that detach_() (Module::zero_grad(false), Optimizer::zero_grad(false)) works on
// a gradient that lives in a bucket, and zero_() keeps it there. Made directly (no dispatcher
// calls): a backward of many small parameters makes one or two per parameter.
inline at::Tensor alias_at(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(),
                                                           buffer.dtype());
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_storage_offset(buffer.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return t;
}

}  // namespace detail

// One piece of a trainable parameter in a bucket (from its OSS's FlatLayout, bucket frame).
struct ShardedDDP::Entry {
  size_t hooked = 0;    // index into hooked_: the parameter
  Range in_param;       // the piece's elements of the parameter
  bool whole = true;    // the piece is the whole parameter
  // On the bucket's owner: where the reduced gradient goes. A whole parameter's is its own .grad
  // (as under DDP); a split range's is its OSS's store (Note [Owned gradients]), at `param`'s
  // range `in_param`.
  bool owned = false;
  detail::ShardStore* store = nullptr;  // split ranges on their owner
  size_t param = 0;                     // position in its OSS
  at::Tensor whole_param;               // whole parameters on their owner
  size_t bucket = 0;
  int64_t offset = 0;   // first element of its gradient in the bucket's reduce buffer
  int64_t out_offset = 0;  // the same in the owner's memory of the bucket (a row bucket: its row)
  int64_t numel = 0;
  int64_t slot_end = 0; // end of its slot: the alignment gap up to the next gradient included
  int64_t flag = 0;     // element that counts the ranks that produced a gradient
  bool ready = false;
  bool local_grad = false;  // this rank had a gradient for it in this backward (so its flag is >= 1)
  at::Tensor carried;   // on the owner, during a backward: the gradient handed over before it
  // The owner's gradient as handed over by the last reduction, without keeping its storage alive,
  // and its version then: Note [Accumulating across reductions].
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> handed_over;
  int64_t handed_version = -1;

  // The owner's gradient of this piece now (undefined: none), and handing one over.
  const at::Tensor& grad() const { return whole ? whole_param.grad() : store->grad(param, in_param); }
  void set_grad(at::Tensor g) {
    if (whole) {
      whole_param.mutable_grad() = std::move(g);
    } else {
      store->set_grad(param, in_param, std::move(g));
    }
  }
  // The shape its gradient has.
  at::IntArrayRef sizes() const { return whole ? whole_param.sizes() : at::IntArrayRef(shape); }
  std::vector<int64_t> shape;  // a split range's: flat
};

// A parameter with our post-accumulation hook, and its entries (one per piece).
struct ShardedDDP::Hooked {
  at::Tensor param;
  std::vector<size_t> entries;
  unsigned pre_hook = 0;  // position of our hook before accumulation (Tensor::register_hook)
  // The gradient fill_param() made this backward: an alias of the owned whole slot (compared,
  // never dereferenced).
  const c10::TensorImpl* slot_alias = nullptr;
};

// One layout bucket, as the executor runs it: reduced to its owner, or a row bucket (owner -1),
// reduce-scattered to the owners of its rows (Note [Row buckets] in flat_layout.h).
struct ShardedDDP::Bucket {
  const OSS* optimizer = nullptr;  // whose layout it comes from
  size_t optimizer_index = 0;      // ... its position in optimizers_
  detail::ShardStore* store = nullptr;  // that optimizer's store
  detail::GradSlabs* slabs = nullptr;   // the memory of that optimizer's buckets this rank owns
  int owner = 0;
  std::vector<size_t> entries;
  // Gradient elements (gaps included) of the reduce buffer, each followed by one flag per entry:
  // numel then the flags (one owner), or one row per rank of `stride` elements, each `numel`
  // gradient elements then its row's flags (a row bucket).
  int64_t numel = 0;
  int64_t stride = 0;
  // A row bucket of whole parameters: each row's gradient elements before its padding (the
  // layout's FlatBucket::row_used; empty: every row full). Its flags, after the padding, move.
  std::vector<int64_t> row_used;
  bool rows() const { return owner < 0; }
  // The entries this rank owns, in the order of their flags in `out`.
  std::vector<size_t> owned;
  // A row bucket with a slot no entry writes (a row with nothing in it, a gap at a row's start):
  // its reduce buffer starts zeroed.
  bool zero_fill = false;
  at::TensorOptions options;
  size_t index = 0;    // in its optimizer's layout
  // During a backward: the memory it reduces in. An owner's is its memory in `slabs`
  // (bucket_memory(): the owner's gradients live there between steps) unless something still
  // refers to that; any other (and a row bucket's) is allocated at its first gradient and
  // released after the reduction.
  at::Tensor buffer;
  // While `buffer` is reduce scratch (Note [Reduce scratch]): the memory it is carved from.
  at::Tensor scratch;
  // After the reduction, on a rank that owns entries: the memory its reduced gradients live in,
  // `numel` of them then their flags. One owner's: `buffer`. A row bucket's: the memory in
  // `slabs` of this rank's row, which holds its own gradients from the first one on (copied, or
  // accumulated there by autograd: Note [Gradients as bucket views]) and into which the
  // reduce-scatter sums the other ranks' rows.
  at::Tensor out;
  // Where this rank's owned gradient slots are: `out` for a row bucket, `buffer` otherwise.
  const at::Tensor& owned_slots() const { return rows() ? out : buffer; }
  // This backward accumulates into the bucket's memory in `slabs`, where the owner's zeroed
  // gradients live (Note [Gradients as bucket views]).
  bool in_place = false;
  // Its reduction divided the gradients by grad_divisor() already (the owner's, when it sums).
  bool divided = false;
  size_t pending = 0;  // entries not yet copied in
  PendingWork work;
  // Error feedback (Note [Error feedback]): what rounding to the wire dropped from this rank's
  // contribution at the last reduction, in the wire's dtype: one row of `numel` per rank (a row
  // bucket), or `numel` (one owner). Kept until the buckets are built again.
  at::Tensor residual;
};

}  // namespace shardopt

// ShardedDDP's buckets as the gradients' own memory (Note [Gradients as bucket views]): the
// decision at the first gradient of a backward, and dropping it.
#include <shardopt/ddp/sharded_ddp.h>

#include "ddp/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

namespace shardopt {

using detail::alias_at;

// Note [Gradients as bucket views]
// After a reduction, the owner's gradients are views of its bucket's memory, which ShardedDDP keeps
// between steps (GradSlabs::bucket_memory, Note [Gradient slab]). When every gradient that refers
// to that memory was zeroed in place by the last zero_grad(false) of its OSS (or ShardedDDP's,
// which calls it) and is unchanged since, and nothing else holds the memory, the next backward uses
// that very memory as the bucket: those gradients stay in place, autograd adds each new gradient
// into its slot (its in-place path for a gradient that exists), and nothing is copied in for them;
// a gradient that is not there (set to none, or never handed over) is copied into its slot as
// usual. Zero plus the local gradient is the local gradient bit for bit, so the reduction and its
// result are those of the copying path. The decision is taken per owned bucket (a row bucket: its
// row on this rank) at the first gradient of a backward, before autograd has accumulated anything,
// and not under no_sync() or with unreduced local gradients. Pieces of split parameters, whose
// gradients autograd never accumulates, are copied into their slots as usual; buckets of another
// dtype than their gradients (a reduce_dtype) copy as before. Any other clearing style (none,
// Module::zero_grad, setting p.grad()) leaves gradients the executor cannot prove to be zero
// without reading them, and they take the copying path, with the semantics of
// Note [Accumulating across reductions].
void ShardedDDP::drop_bucket_views() {
  if (phase_ == Phase::kViews) phase_ = Phase::kIdle;
  for (auto& b : buckets_) {
    if (!b.in_place) continue;
    b.in_place = false;
    if (b.pending == b.entries.size()) (b.rows() ? b.out : b.buffer) = at::Tensor();  // nothing went in yet
  }
}

void ShardedDDP::decide_bucket_views() {
  phase_ = Phase::kViews;
  // The decision holds for this backward only. One that reduces nothing (autograd::grad() runs
  // the hooks before accumulation, never the ones after) drops it at its end; one that reduces
  // drops it in finish_reduction().
  // It also gives back the gradients set aside before accumulation (Note [Accumulating across
  // reductions]), which such a backward never adds to.
  torch::autograd::Engine::get_default_engine().queue_callback([this] {
    if (phase_ == Phase::kReducing) return;
    drop_bucket_views();
    for (auto& e : entries_) {
      if (e.carried.defined() && e.owned && !e.grad().defined()) e.set_grad(e.carried);
      e.carried = at::Tensor();
    }
  });
  if (!options_.gradient_as_bucket_view()) return;
  for (auto& b : buckets_) {
    if (!b.owned.empty() && !b.owned_slots().defined()) decide_bucket_view(b);
  }
}

// Whether this backward accumulates into owned bucket `b` where its zeroed gradients live.
void ShardedDDP::decide_bucket_view(Bucket& b) {
  const int64_t elements = b.stride;
  // The memory the owned gradients live in: the bucket's memory in its GradSlabs, or that of an
  // earlier bucket (before a new layout), where a backward that copied left them (Note
  // [Accumulating across reductions] adds into the gradient as it is).
  at::Tensor& kept = b.slabs->bucket_memory(b.index, b.options);
  const c10::StorageImpl* own = kept.defined() ? kept.storage().unsafeGetStorageImpl() : nullptr;
  c10::Storage memory = kept.defined() ? kept.storage() : c10::Storage();
  bool eligible = true, found = false;
  for (size_t k : b.owned) {
    const Entry& e = entries_[k];
    if (!e.whole) continue;  // a piece of a split parameter is copied into its slot
    if (e.whole_param.dtype() != b.options.dtype()) {
      eligible = false;
      break;
    }
    const at::Tensor& g = e.grad();
    if (!found && g.defined() && b.store->zeroed(g) && g.storage().unsafeGetStorageImpl() != own) {
      memory = g.storage();
      found = true;
    }
  }
  if (!eligible || !memory) return;
  const c10::StorageImpl* impl = memory.unsafeGetStorageImpl();
  if (static_cast<int64_t>(memory.nbytes()) != elements * static_cast<int64_t>(b.options.dtype().itemsize())) return;
  int64_t zeroed = 0;  // owned gradients in that memory, each zeroed and at its own slot
  for (size_t k : b.owned) {
    const Entry& e = entries_[k];
    const at::Tensor& g = e.grad();
    if (!g.defined() || g.storage().unsafeGetStorageImpl() != impl) continue;
    // Zeroed, at its own slot, laid out as the slot is (so that autograd's add lands in order).
    if (!b.store->zeroed(g) || g.storage_offset() != e.out_offset || g.numel() != e.numel ||
        !g.is_contiguous() || g.dtype() != b.options.dtype()) {
      eligible = false;
      break;
    }
    ++zeroed;
  }
  // Nothing else (another view the user holds, a stale reference) may see the memory change.
  const int64_t ours = impl == own ? 1 : 0;
  if (!eligible || static_cast<int64_t>(memory.use_count()) != ours + zeroed + 1 /* `memory` */) return;
  if (impl != own) {
    if (kept.defined() && kept.storage().use_count() == 1) {
      // Zeroed gradients in the memory of an earlier layout move into the new slab's (each keeps its
      // identity and version): the earlier slab is freed once nothing else is left in it.
      kept.zero_();
      for (size_t k : b.owned) {
        const Entry& e = entries_[k];
        at::Tensor g = e.grad();
        if (g.defined() && g.storage().unsafeGetStorageImpl() == impl) g.set_data(alias_at(kept, e.out_offset, g.sizes()));
      }
    } else {
      kept = at::empty({0}, b.options).set_(memory, 0, {elements}, {1});
    }
  }
  b.in_place = true;
  (b.rows() ? b.out : b.buffer) = kept;
}

}  // namespace shardopt

// Tensors adjacent in memory stepped as one (Note [Adjacent tensors in one pass]). Internal to
// shardopt: the fused step joins its entries with it.
#pragma once

#include "optim/state_codes.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <vector>

namespace shardopt::detail {

// Note [Adjacent tensors in one pass]
// The store keeps a run of pieces' state at the same offsets as the parameter buffer holds the
// pieces (Note [State slabs]), mixed precision's masters too, and a gradient bucket holds its
// gradients in the same order. So the tensors of parameters adjacent in the buffer are adjacent
// in every operand of the step, and such entries join into one segment: one kernel launch on
// CUDA instead of one per tensor, one item of the CPU pass. Entries are taken in address order
// (the trainable run holds the parameters in reverse order, Note [Bucket order]). Any gap ends a
// segment: alignment padding between pieces, a gradient in another bucket or of its own (OSS
// without ShardedDDP, an upcast copy), state of its own. The step is element-wise, so joining
// changes nothing in the results.

// Whether `b` begins where `a` ends, both contiguous in one storage (or both undefined). 8-bit
// codes join only where `a` ends on a block boundary (Note [8-bit state slabs]), so
// that the joined codes' blocks, and their scales, are each tensor's.
inline bool follows(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return !a.defined() && !b.defined();
  if (a.scalar_type() == at::kByte && a.numel() % kStateBlock != 0) return false;
  return a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
         a.storage().is_alias_of(b.storage()) && b.storage_offset() == a.storage_offset() + a.numel();
}

// `entries` (each with `p`, the stepped tensor, and operands(), pointers to all its tensors, p
// first) joined where every operand of one follows the same operand of the one before, as flat
// tensors over both.
template <class Entry>
std::vector<Entry> joined_adjacent(std::vector<Entry> entries) {
  auto address = [](const Entry& e) { return reinterpret_cast<uintptr_t>(e.p.data_ptr()); };
  std::sort(entries.begin(), entries.end(), [&](const Entry& a, const Entry& b) { return address(a) < address(b); });
  std::vector<Entry> out;
  for (auto& e : entries) {
    if (!out.empty()) {
      auto mine = out.back().operands();
      auto next = e.operands();
      bool adjacent = true;
      for (size_t k = 0; k < mine.size() && adjacent; ++k) adjacent = follows(*mine[k], *next[k]);
      if (adjacent) {
        for (size_t k = 0; k < mine.size(); ++k) {
          at::Tensor& t = *mine[k];
          if (t.defined()) t = t.as_strided({t.numel() + next[k]->numel()}, {1}, t.storage_offset());
        }
        continue;
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace shardopt::detail

// Ranges moved inside one buffer (Note [Moving ranges in place] in buffer_moves.h).
#include "optim/buffer_moves.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>

namespace shardopt::detail {

namespace {

bool overlap(int64_t a, int64_t an, int64_t b, int64_t bn) { return a < b + bn && b < a + an; }

// One range's elements copied from `from` to `to` of the same buffer; the two may overlap.
void move_within(const at::Tensor& buffer, int64_t from, int64_t to, int64_t numel) {
  if (from == to || numel == 0) return;
  if (buffer.is_cpu()) {
    auto* base = static_cast<char*>(buffer.data_ptr());
    const int64_t size = static_cast<int64_t>(buffer.element_size());
    std::memmove(base + to * size, base + from * size, static_cast<size_t>(numel * size));
    return;
  }
  at::Tensor src = buffer.narrow(0, from, numel);
  buffer.narrow(0, to, numel).copy_(overlap(from, numel, to, numel) ? src.clone() : src);
}

}  // namespace

int64_t move_ranges_in_place(const at::Tensor& buffer, const std::vector<RangeMove>& moves) {
  TORCH_INTERNAL_ASSERT(buffer.dim() == 1 && buffer.is_contiguous(), "moves need a flat contiguous buffer");
  const int64_t size = buffer.numel();
  const size_t n = moves.size();
  for (const auto& m : moves) {
    TORCH_INTERNAL_ASSERT(m.numel >= 0 && m.from >= 0 && m.to >= 0 && m.from + m.numel <= size &&
                              m.to + m.numel <= size,
                          "a move [", m.from, ", +", m.numel, ") to ", m.to, " outside a buffer of ", size);
  }
  // The moves by source, and which sources each destination lands on (sources are disjoint, so
  // a destination covers a run of them in this order).
  std::vector<size_t> by_from;
  for (size_t i = 0; i < n; ++i) {
    if (moves[i].numel > 0) by_from.push_back(i);
  }
  std::sort(by_from.begin(), by_from.end(), [&](size_t a, size_t b) { return moves[a].from < moves[b].from; });
  std::vector<int64_t> blockers(n, 0);    // waiting sources under this move's destination
  std::vector<std::vector<size_t>> waiters(n);  // moves whose destination covers this source
  for (size_t i = 0; i < n; ++i) {
    const RangeMove& m = moves[i];
    if (m.numel == 0) continue;
    auto it = std::partition_point(by_from.begin(), by_from.end(), [&](size_t j) {
      return moves[j].from + moves[j].numel <= m.to;
    });
    for (; it != by_from.end() && moves[*it].from < m.to + m.numel; ++it) {
      const size_t j = *it;
      if (j == i) continue;
      TORCH_INTERNAL_ASSERT(overlap(moves[j].from, moves[j].numel, m.to, m.numel));
      ++blockers[i];
      waiters[j].push_back(i);
    }
  }
  std::vector<uint8_t> done(n, 0), source_free(n, 0);
  std::vector<at::Tensor> aside(n);
  std::deque<size_t> ready;
  for (size_t i = 0; i < n; ++i) {
    if (blockers[i] == 0) ready.push_back(i);
  }
  auto free_source = [&](size_t j) {
    source_free[j] = 1;
    for (size_t w : waiters[j]) {
      if (!done[w] && --blockers[w] == 0) ready.push_back(w);
    }
  };
  int64_t held = 0, most_held = 0;
  size_t left = n;
  while (left > 0) {
    if (ready.empty()) {
      // Every waiting move is blocked: set aside the smallest source that blocks one.
      size_t pick = n;
      for (size_t j = 0; j < n; ++j) {
        if (done[j] || source_free[j]) continue;
        const bool blocks = std::any_of(waiters[j].begin(), waiters[j].end(), [&](size_t w) { return !done[w]; });
        if (blocks && (pick == n || moves[j].numel < moves[pick].numel)) pick = j;
      }
      TORCH_INTERNAL_ASSERT(pick < n, "moves in place: no move can go ahead and none blocks another");
      aside[pick] = buffer.narrow(0, moves[pick].from, moves[pick].numel).clone();
      held += moves[pick].numel;
      most_held = std::max(most_held, held);
      free_source(pick);
      continue;
    }
    const size_t i = ready.front();
    ready.pop_front();
    if (done[i]) continue;
    const RangeMove& m = moves[i];
    if (aside[i].defined()) {
      buffer.narrow(0, m.to, m.numel).copy_(aside[i]);
      held -= m.numel;
      aside[i] = at::Tensor();
    } else {
      move_within(buffer, m.from, m.to, m.numel);
    }
    done[i] = 1;
    --left;
    if (!source_free[i]) free_source(i);
  }
  // Zeros wherever nothing landed.
  std::vector<size_t> by_to(n);
  std::iota(by_to.begin(), by_to.end(), 0);
  std::sort(by_to.begin(), by_to.end(), [&](size_t a, size_t b) { return moves[a].to < moves[b].to; });
  int64_t at = 0;
  for (size_t i : by_to) {
    if (moves[i].numel == 0) continue;
    if (moves[i].to > at) buffer.narrow(0, at, moves[i].to - at).zero_();
    at = std::max(at, moves[i].to + moves[i].numel);
  }
  if (at < size) buffer.narrow(0, at, size - at).zero_();
  return most_held;
}

at::Tensor storage_as(const at::Tensor& t, int64_t bytes) {
  t.storage().unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(bytes));
  return at::empty({0}, t.options()).set_(t.storage(), 0, {bytes / static_cast<int64_t>(t.element_size())});
}

at::Tensor zeros_with_room(int64_t numel, const at::TensorOptions& options, int64_t& room) {
  const int64_t with_room = options.device().is_cpu() ? numel + numel / 32 : numel;
  at::Tensor memory = at::empty({with_room}, options);
  room = static_cast<int64_t>(memory.storage().nbytes());
  return storage_as(memory, numel * static_cast<int64_t>(memory.element_size())).zero_();
}

}  // namespace shardopt::detail

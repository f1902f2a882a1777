// Ranges of one buffer moved to new places inside the same buffer, without a second buffer
// (Note [Moving ranges in place]). Internal to shardopt: a new layout of the parameter buffers
// moves the parameters with it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <vector>

namespace shardopt::detail {

// Elements [from, from + numel) go to [to, to + numel) of the same buffer.
struct RangeMove {
  int64_t from = 0;
  int64_t to = 0;
  int64_t numel = 0;
};

// Note [Moving ranges in place]
// A new layout (a freeze, an unfreeze, a re-partition) moves every parameter to a new place in
// its flat buffer, and the state of each piece a rank holds to a new place in its slabs (Note
// [State slabs]). Copying them into new buffers holds the old and the new at once: the whole
// model twice, for as long as the copy takes, which was the peak of a run that freezes layers.
// Instead they move inside the memory they are in. A move may go ahead once no range still
// waiting to move lies where it lands; a range that overlaps its own destination moves as memmove
// does. Where every waiting move is blocked by another (a cycle), the smallest range that blocks
// one is set aside in a copy of its own, which frees its place; it lands from the copy later. The
// extra memory is those copies (move_ranges_in_place returns the most held at once), never the
// buffer. A new layout needs the old memory to have room for it: buffers and slabs are made with
// a little room to spare (zeros_with_room), as a layout's padding moves by a little; one that
// needs more gets new memory, its values copied in.
//
// Moves `moves` inside `buffer` (1-D, contiguous): the sources are disjoint, the destinations
// are disjoint, and all lie in [0, buffer.numel()). Then every element that no move landed on
// is set to zero. Returns the most elements held aside at once.
int64_t move_ranges_in_place(const at::Tensor& buffer, const std::vector<RangeMove>& moves);

// The first `bytes` of `t`'s storage as a flat tensor of t's dtype; the storage counts that many
// bytes from now on (its memory, the room, stays what it was allocated with).
at::Tensor storage_as(const at::Tensor& t, int64_t bytes);

// A zeroed flat buffer of `numel` elements whose memory has room for a little more (on the CPU,
// 1/32 more, which is never touched and so never resident until a later layout uses it: a new
// layout's padding may grow by a little, Note [Moving ranges in place]). Its storage counts the
// buffer's bytes; `room` receives the bytes its memory holds.
at::Tensor zeros_with_room(int64_t numel, const at::TensorOptions& options, int64_t& room);

}  // namespace shardopt::detail

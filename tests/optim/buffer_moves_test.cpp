// Ranges moved inside one buffer (Note [Moving ranges in place] in csrc/optim/buffer_moves.h):
// the result equals copying every range into a new zeroed buffer, whatever the ranges' order,
// overlaps and cycles, and only a cycle sets anything aside.
#include "optim/buffer_moves.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using detail::RangeMove;

// The reference: a new buffer of zeros, each range copied in from the old one.
at::Tensor moved_by_copy(const at::Tensor& before, const std::vector<RangeMove>& moves) {
  at::Tensor out = at::zeros_like(before);
  for (const auto& m : moves) out.narrow(0, m.to, m.numel).copy_(before.narrow(0, m.from, m.numel));
  return out;
}

// `sizes` laid end to end in a random order with random gaps, in a buffer of `total` elements.
std::vector<int64_t> random_places(const std::vector<int64_t>& sizes, int64_t total, std::mt19937& rng) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t used = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  std::vector<int64_t> places(sizes.size());
  int64_t slack = total - used, at = 0;
  for (size_t i : order) {
    const int64_t gap = slack > 0 ? std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(slack, 7))(rng) : 0;
    slack -= gap;
    at += gap;
    places[i] = at;
    at += sizes[i];
  }
  return places;
}

TEST(BufferMoves, AnyPermutationEqualsCopyingIntoANewBuffer) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int count = std::uniform_int_distribution<int>(1, 12)(rng);
    std::vector<int64_t> sizes(count);
    for (auto& s : sizes) s = std::uniform_int_distribution<int64_t>(trial % 5 == 0 ? 0 : 1, 40)(rng);
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) + 20;
    const auto from = random_places(sizes, total, rng);
    const auto to = random_places(sizes, total, rng);
    std::vector<RangeMove> moves;
    for (int i = 0; i < count; ++i) moves.push_back({from[i], to[i], sizes[i]});
    at::Tensor buffer = at::arange(1, total + 1, at::kFloat);
    const at::Tensor expected = moved_by_copy(buffer, moves);
    detail::move_ranges_in_place(buffer, moves);
    ASSERT_TRUE(at::equal(buffer, expected)) << "trial " << trial;
  }
}

TEST(BufferMoves, OverlappingShiftsNeedNoCopyAndASwapSetsAsideTheSmaller) {
  at::Tensor buffer = at::arange(1, 21, at::kDouble);
  // Two ranges each sliding over themselves, one to the left, one to the right.
  std::vector<RangeMove> shifts = {{2, 0, 6}, {10, 13, 5}};
  at::Tensor expected = moved_by_copy(buffer, shifts);
  EXPECT_EQ(detail::move_ranges_in_place(buffer, shifts), 0);
  EXPECT_TRUE(at::equal(buffer, expected));
  // A swap of 3 and 8 elements is a cycle: the 3 go aside.
  buffer = at::arange(1, 21, at::kDouble);
  std::vector<RangeMove> swap = {{0, 8, 3}, {3, 0, 8}};
  expected = moved_by_copy(buffer, swap);
  EXPECT_EQ(detail::move_ranges_in_place(buffer, swap), 3);
  EXPECT_TRUE(at::equal(buffer, expected));
  // Nothing moved and nothing landed in the tail: it is zeroed.
  buffer = at::arange(1, 11, at::kDouble);
  detail::move_ranges_in_place(buffer, {{0, 0, 4}});
  EXPECT_TRUE(at::equal(buffer, at::cat({at::arange(1, 5, at::kDouble), at::zeros({6}, at::kDouble)})));
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

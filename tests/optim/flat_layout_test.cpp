#include <shardopt/optim/flat_layout.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

LayoutParam param(int64_t numel, int owner, bool trainable = true, c10::ScalarType dtype = c10::kFloat) {
  LayoutParam p;
  p.numel = numel;
  p.owner = owner;
  p.trainable = trainable;
  p.dtype = dtype;
  return p;
}

const Piece& piece_of(const FlatLayout& layout, size_t param) {
  return layout.pieces()[layout.pieces_of(param).at(0)];
}

std::vector<size_t> params_of_bucket(const FlatLayout& layout, size_t bucket) {
  std::vector<size_t> out;
  for (size_t k : layout.buckets()[bucket].pieces) out.push_back(layout.pieces()[k].param);
  return out;
}

TEST(FlatLayout, ShardsHoldTheirOwnersParametersInReverseOrder) {
  const auto layout = FlatLayout::plan({param(4, 0), param(3, 1), param(2, 0), param(5, 1), param(1, 0)}, 2);
  ASSERT_EQ(layout.groups().size(), 1u);
  EXPECT_EQ(layout.groups()[0].used, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(layout.groups()[0].shard_numel, 8);
  // Owner 0: parameters 4, 2, 0; owner 1: parameters 3, 1.
  EXPECT_EQ(piece_of(layout, 4).in_shard, (Range{0, 1}));
  EXPECT_EQ(piece_of(layout, 2).in_shard, (Range{1, 3}));
  EXPECT_EQ(piece_of(layout, 0).in_shard, (Range{3, 7}));
  EXPECT_EQ(piece_of(layout, 3).in_shard, (Range{0, 5}));
  EXPECT_EQ(piece_of(layout, 1).in_shard, (Range{5, 8}));
  // The buffer is the owners' shards side by side.
  EXPECT_EQ(layout.in_buffer(piece_of(layout, 1)), (Range{13, 16}));
  EXPECT_EQ(layout.in_buffer(piece_of(layout, 0)), (Range{3, 7}));
  // bucket_bytes 0: one bucket per parameter, launched in reverse parameter order.
  ASSERT_EQ(layout.buckets().size(), 5u);
  for (size_t b = 0; b < 5; ++b) {
    EXPECT_EQ(params_of_bucket(layout, b), std::vector<size_t>{4 - b});
    EXPECT_EQ(layout.buckets()[b].owner, piece_of(layout, 4 - b).owner);
    EXPECT_EQ(piece_of(layout, 4 - b).in_bucket, (Range{0, piece_of(layout, 4 - b).in_param.size()}));
  }
}

TEST(FlatLayout, BucketsCloseBeforeTheyPassTheCap) {
  std::vector<LayoutParam> params(6, param(10, 0));
  params[2].numel = 30;  // larger than the cap on its own
  const auto layout = FlatLayout::plan(params, 1, LayoutOptions().bucket_bytes(80));  // 20 floats
  ASSERT_EQ(layout.buckets().size(), 4u);
  EXPECT_EQ(params_of_bucket(layout, 0), (std::vector<size_t>{5, 4}));
  EXPECT_EQ(params_of_bucket(layout, 1), (std::vector<size_t>{3}));
  EXPECT_EQ(params_of_bucket(layout, 2), (std::vector<size_t>{2}));
  EXPECT_EQ(params_of_bucket(layout, 3), (std::vector<size_t>{1, 0}));
  // Buckets tile the shard in order; offsets inside a bucket are relative to the bucket.
  EXPECT_EQ(layout.buckets()[0].in_shard, (Range{0, 20}));
  EXPECT_EQ(layout.buckets()[1].in_shard, (Range{20, 30}));
  EXPECT_EQ(layout.buckets()[2].in_shard, (Range{30, 60}));
  EXPECT_EQ(layout.buckets()[3].in_shard, (Range{60, 80}));
  EXPECT_EQ(piece_of(layout, 0).in_bucket, (Range{10, 20}));
  EXPECT_EQ(piece_of(layout, 0).bucket, 3);
  // The cap counts bytes: doubles fill a bucket twice as fast.
  std::vector<LayoutParam> doubles(4, param(10, 0, true, c10::kDouble));
  EXPECT_EQ(FlatLayout::plan(doubles, 1, LayoutOptions().bucket_bytes(160)).buckets().size(), 2u);
}

TEST(FlatLayout, AlignmentPadsEveryParameterAndTheShard) {
  const auto layout = FlatLayout::plan({param(3, 0), param(5, 0), param(2, 0)}, 1,
                                       LayoutOptions().align(4).bucket_bytes(1 << 20));
  EXPECT_EQ(piece_of(layout, 2).in_shard, (Range{0, 2}));
  EXPECT_EQ(piece_of(layout, 1).in_shard, (Range{4, 9}));
  EXPECT_EQ(piece_of(layout, 0).in_shard, (Range{12, 15}));
  EXPECT_EQ(layout.groups()[0].shard_numel, 16);
  ASSERT_EQ(layout.buckets().size(), 1u);
  // The gaps inside a bucket belong to it.
  EXPECT_EQ(layout.buckets()[0].in_shard, (Range{0, 15}));
  EXPECT_EQ(piece_of(layout, 1).in_bucket, (Range{4, 9}));
}

TEST(FlatLayout, DeviceAndDtypeGroupsNeverShareABufferOrABucket) {
  const auto layout = FlatLayout::plan(
      {param(4, 0, true, c10::kDouble), param(4, 0), param(6, 1, true, c10::kDouble), param(2, 1)}, 2,
      LayoutOptions().bucket_bytes(1 << 20));
  ASSERT_EQ(layout.groups().size(), 2u);
  EXPECT_EQ(layout.groups()[0].dtype, c10::kDouble);  // order of first appearance
  EXPECT_EQ(layout.groups()[1].dtype, c10::kFloat);
  EXPECT_EQ(piece_of(layout, 0).group, 0u);
  EXPECT_EQ(piece_of(layout, 1).group, 1u);
  EXPECT_EQ(layout.groups()[0].shard_numel, 6);
  EXPECT_EQ(layout.groups()[1].shard_numel, 4);
  EXPECT_EQ(layout.in_buffer(piece_of(layout, 3)), (Range{4, 6}));
  ASSERT_EQ(layout.buckets().size(), 4u);  // (group, owner) pairs
  for (const auto& b : layout.buckets()) {
    for (size_t k : b.pieces) {
      EXPECT_EQ(layout.pieces()[k].group, b.group);
      EXPECT_EQ(layout.pieces()[k].owner, b.owner);
    }
  }
}

TEST(FlatLayout, AfterAFreezeFrozenParametersLeaveTheShardsAndTheBuckets) {
  std::vector<LayoutParam> params = {param(4, 0), param(3, 0), param(2, 0), param(5, 0)};
  const auto before = FlatLayout::plan(params, 1, LayoutOptions().bucket_bytes(1 << 20));
  params[2].trainable = false;
  const auto after = FlatLayout::plan(params, 1, LayoutOptions().bucket_bytes(1 << 20));
  EXPECT_FALSE(after.same_placement(before));
  EXPECT_EQ(piece_of(after, 2).bucket, -1);
  EXPECT_EQ(piece_of(after, 2).owner, -1);
  EXPECT_TRUE(after.owners_of(2).empty());
  ASSERT_EQ(after.buckets().size(), 1u);
  EXPECT_EQ(params_of_bucket(after, 0), (std::vector<size_t>{3, 1, 0}));
  EXPECT_EQ(after.buckets()[0].in_shard, (Range{0, 12}));
  // Frozen parameters never change: they live after the shards, which are all that is synced.
  EXPECT_EQ(after.groups()[0].shard_numel, 12);
  EXPECT_EQ(after.groups()[0].frozen_numel, 2);
  EXPECT_EQ(piece_of(after, 2).in_frozen, (Range{0, 2}));
  EXPECT_EQ(after.in_buffer(piece_of(after, 2)), (Range{12, 14}));
  EXPECT_EQ(after.groups()[0].buffer_numel(), 14);
  // Everything frozen: no buckets at all, every parameter still placed.
  for (auto& p : params) p.trainable = false;
  const auto frozen = FlatLayout::plan(params, 1);
  EXPECT_TRUE(frozen.buckets().empty());
  EXPECT_EQ(frozen.groups()[0].frozen_numel, 14);
  EXPECT_EQ(frozen.groups()[0].shard_numel, 1);
}

TEST(FlatLayout, SplitCutsTheTrainableRunIntoEqualRangesAcrossParameterBoundaries) {
  // Reverse order: 2 (10), 1 (4), 0 (16) = 30 elements; 3 ranks of 10.
  const auto layout = FlatLayout::plan({param(16, 0), param(4, 0), param(10, 0), param(6, 0, false)}, 3,
                                       LayoutOptions().split(true).bucket_bytes(1 << 20));
  const auto& group = layout.groups()[0];
  EXPECT_EQ(group.shard_numel, 10);
  EXPECT_EQ(group.used, (std::vector<int64_t>{10, 10, 10}));
  EXPECT_EQ(layout.owners_of(2), std::vector<int>{0});
  EXPECT_EQ(layout.owners_of(1), std::vector<int>{1});
  EXPECT_EQ(layout.owners_of(0), (std::vector<int>{1, 2}));  // 6 elements on rank 1, 10 on rank 2
  ASSERT_EQ(layout.pieces_of(0).size(), 2u);
  const Piece& head = layout.pieces()[layout.pieces_of(0)[0]];
  const Piece& tail = layout.pieces()[layout.pieces_of(0)[1]];
  EXPECT_EQ(head.in_param, (Range{0, 6}));
  EXPECT_EQ(head.in_shard, (Range{4, 10}));
  EXPECT_EQ(tail.in_param, (Range{6, 16}));
  EXPECT_EQ(tail.in_shard, (Range{0, 10}));
  EXPECT_FALSE(head.whole());
  EXPECT_TRUE(layout.pieces()[layout.pieces_of(1)[0]].whole());
  // A split parameter stays one contiguous view of the buffer.
  EXPECT_EQ(layout.param_in_buffer(0), (Range{14, 30}));
  EXPECT_EQ(layout.param_in_buffer(3), (Range{30, 36}));  // frozen, after the shards
  EXPECT_DOUBLE_EQ(layout.imbalance(), 0.0);
  // One row bucket (the cap holds the whole run): every rank's row of it is its whole shard, and
  // its pieces come row by row.
  ASSERT_EQ(layout.buckets().size(), 1u);
  const FlatBucket& bucket = layout.buckets()[0];
  EXPECT_TRUE(bucket.rows());
  EXPECT_EQ(bucket.in_shard, (Range{0, 10}));
  EXPECT_EQ(bucket.rows_in_buffer(3), (Range{0, 30}));
  EXPECT_EQ(params_of_bucket(layout, 0), (std::vector<size_t>{2, 1, 0, 0}));
  EXPECT_EQ(bucket.row_pieces, 2);  // row 1: parameter 1 and the head of parameter 0
  EXPECT_EQ(head.in_bucket, (Range{4, 10}));
  EXPECT_EQ(tail.in_bucket, (Range{0, 10}));
}

// Row buckets (Note [Row buckets]): the run is cut at parameter boundaries into buckets, each cut
// into one equal row per rank; a bucket's rows lie together in the buffer, and a rank's rows follow
// each other in its shard.
TEST(FlatLayout, RowBucketsCutEveryBucketIntoOneRowPerRank) {
  // Reverse order: 3 (8), 2 (6), 1 (12), 0 (4), 4 bytes each; a cap of 64 bytes = 16 elements.
  const auto layout = FlatLayout::plan({param(4, 0), param(12, 0), param(6, 0), param(8, 0)}, 2,
                                       LayoutOptions().split(true).bucket_bytes(64));
  // Buckets: {3, 2} (14 elements, rows of 7), {1, 0} (16, rows of 8).
  ASSERT_EQ(layout.buckets().size(), 2u);
  const FlatBucket &first = layout.buckets()[0], &second = layout.buckets()[1];
  EXPECT_EQ(first.in_shard, (Range{0, 7}));
  EXPECT_EQ(second.in_shard, (Range{7, 15}));
  EXPECT_EQ(layout.groups()[0].shard_numel, 15);
  EXPECT_EQ(first.rows_in_buffer(2), (Range{0, 14}));
  EXPECT_EQ(second.rows_in_buffer(2), (Range{14, 30}));
  EXPECT_EQ(params_of_bucket(layout, 0), (std::vector<size_t>{3, 3, 2}));
  EXPECT_EQ(params_of_bucket(layout, 1), (std::vector<size_t>{1, 1, 0}));
  // Parameter 3 (8 elements) opens the first bucket: 7 in rank 0's row, 1 in rank 1's; parameter 2
  // follows it in rank 1's row.
  ASSERT_EQ(layout.pieces_of(3).size(), 2u);
  const Piece& p3a = layout.pieces()[layout.pieces_of(3)[0]];
  const Piece& p3b = layout.pieces()[layout.pieces_of(3)[1]];
  EXPECT_EQ(p3a.owner, 0);
  EXPECT_EQ(p3a.in_shard, (Range{0, 7}));
  EXPECT_EQ(p3b.owner, 1);
  EXPECT_EQ(p3b.in_shard, (Range{0, 1}));
  EXPECT_EQ(layout.param_in_buffer(3), (Range{0, 8}));  // still one view: row 0 ends where row 1 begins
  EXPECT_EQ(layout.param_in_buffer(2), (Range{8, 14}));
  EXPECT_EQ(first.row_pieces, 2);
  // Parameter 1 (12 elements) opens the second bucket: 8 in rank 0's row, 4 in rank 1's.
  const Piece& p1a = layout.pieces()[layout.pieces_of(1)[0]];
  const Piece& p1b = layout.pieces()[layout.pieces_of(1)[1]];
  EXPECT_EQ(p1a.in_shard, (Range{7, 15}));
  EXPECT_EQ(p1b.in_shard, (Range{7, 11}));
  EXPECT_EQ(layout.param_in_buffer(1), (Range{14, 26}));
  EXPECT_EQ(layout.in_buffer(p1b), (Range{22, 26}));
  EXPECT_EQ(layout.groups()[0].used, (std::vector<int64_t>{15, 15}));
  // Each rank owns 15 of the 30 elements: exactly half, bucket by bucket.
  EXPECT_DOUBLE_EQ(layout.imbalance(), 0.0);
  // A parameter larger than the cap is a bucket of its own.
  const auto big = FlatLayout::plan({param(40, 0), param(4, 0)}, 4, LayoutOptions().split(true).bucket_bytes(64));
  ASSERT_EQ(big.buckets().size(), 2u);
  EXPECT_EQ(params_of_bucket(big, 1), (std::vector<size_t>{0, 0, 0, 0}));
  EXPECT_EQ(big.buckets()[1].numel(), 10);
}

// Parameters marked whole (a whole-tensor optimizer's) form a group of their own in a split
// layout: laid out per owner, one piece each, never cut; the others are cut into equal ranges as
// if the whole ones were not there. A frozen whole one keeps its state with its owner, not in the
// kept run.
TEST(FlatLayout, WholeMarkedParametersStayWholeInAGroupOfTheirOwn) {
  auto whole = [](LayoutParam p) { return p.whole = true, p; };
  LayoutParam kept = whole(param(9, 1, false));
  kept.keeps_state = true;
  // Element-wise: 0 (16), 2 (4), 4 (10) = 30 elements, 3 ranks of 10. Whole: 1 (12) on rank 2,
  // 3 (8) on rank 0, 5 frozen.
  const auto layout = FlatLayout::plan({param(16, 0), whole(param(12, 2)), param(4, 0), whole(param(8, 0)),
                                        param(10, 0), kept},
                                       3, LayoutOptions().split(true).bucket_bytes(1 << 20));
  ASSERT_EQ(layout.groups().size(), 2u);
  const size_t split_group = layout.groups()[0].split ? 0 : 1;
  EXPECT_TRUE(layout.groups()[split_group].split);
  EXPECT_FALSE(layout.groups()[1 - split_group].split);
  EXPECT_TRUE(layout.groups()[1 - split_group].rows);  // whole parameters in their owners' rows
  EXPECT_EQ(layout.groups()[split_group].shard_numel, 10);
  EXPECT_EQ(layout.groups()[1 - split_group].shard_numel, 12);  // the longest owner's whole parameters
  EXPECT_EQ(layout.owners_of(1), std::vector<int>{2});
  EXPECT_EQ(layout.owners_of(3), std::vector<int>{0});
  for (size_t i : {1, 3}) {
    ASSERT_EQ(layout.pieces_of(i).size(), 1u);
    EXPECT_TRUE(layout.pieces()[layout.pieces_of(i)[0]].whole());
    EXPECT_EQ(layout.pieces()[layout.pieces_of(i)[0]].group, 1 - split_group);
  }
  EXPECT_EQ(layout.owners_of(4), std::vector<int>{0});
  EXPECT_EQ(layout.owners_of(0), (std::vector<int>{1, 2}));
  EXPECT_TRUE(layout.keepers_of(5).empty());
  for (const auto& b : layout.buckets()) {
    for (size_t k : b.pieces) EXPECT_EQ(layout.pieces()[k].group, b.group);
  }
}

TEST(FlatLayout, SplitGivesEveryRankItsShareWhateverOneTensorWeighs) {
  // One tensor holds over 90% of the elements; whole parameters leave one rank with it.
  std::vector<LayoutParam> params = {param(1000, 0), param(30, 1), param(20, 1), param(10, 1)};
  for (int world : {2, 3, 4, 8}) {
    const auto whole = FlatLayout::plan(params, world);
    const auto split = FlatLayout::plan(params, world, LayoutOptions().split(true));
    EXPECT_GT(whole.imbalance(), 0.8) << "world " << world;
    EXPECT_LT(split.imbalance(), 0.03) << "world " << world;
    EXPECT_GE(split.owners_of(0).size(), static_cast<size_t>(world - 1)) << "world " << world;
  }
  // Three owners share one parameter, and a rank may own no whole parameter at all.
  const auto three = FlatLayout::plan({param(9, 0), param(30, 0)}, 4, LayoutOptions().split(true));
  EXPECT_EQ(three.owners_of(1), (std::vector<int>{0, 1, 2}));
  for (size_t k : three.pieces_of(1)) EXPECT_FALSE(three.pieces()[k].whole());
}

TEST(FlatLayout, SplitRangesAreAlignedAndEmptyParametersArePlaced) {
  const auto layout = FlatLayout::plan({param(5, 0), param(0, 0), param(7, 0)}, 2,
                                       LayoutOptions().split(true).align(4).bucket_bytes(0));
  // Run: 2 at [0, 7), 1 (empty) at [8, 8), 0 at [8, 13): 13 -> shards of 8.
  EXPECT_EQ(layout.groups()[0].shard_numel, 8);
  EXPECT_EQ(layout.param_in_buffer(0), (Range{8, 13}));
  ASSERT_EQ(layout.pieces_of(1).size(), 1u);
  EXPECT_EQ(layout.pieces()[layout.pieces_of(1)[0]].in_param.size(), 0);
}

TEST(FlatLayout, AfterARebalancePiecesFollowTheirNewOwners) {
  std::vector<LayoutParam> params = {param(8, 0), param(8, 0), param(2, 1), param(2, 1)};
  const auto before = FlatLayout::plan(params, 2);
  params[1].owner = 1;
  const auto after = FlatLayout::plan(params, 2);
  EXPECT_FALSE(after.same_placement(before));
  EXPECT_EQ(after.groups()[0].used, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(piece_of(after, 1).owner, 1);
  EXPECT_EQ(piece_of(after, 1).in_shard, (Range{4, 12}));  // behind 3 and 2: reverse order
  EXPECT_EQ(after.in_buffer(piece_of(after, 1)), (Range{16, 24}));
  // Other bucket cuts over the same owners move no data.
  EXPECT_TRUE(FlatLayout::plan(params, 2, LayoutOptions().bucket_bytes(1 << 20)).same_placement(after));
}

TEST(FlatLayout, IsAPureFunctionOfItsInputs) {
  std::vector<LayoutParam> params;
  for (int i = 0; i < 20; ++i) params.push_back(param(1 + (i * 7) % 13, i % 3, i % 5 != 0));
  const auto a = FlatLayout::plan(params, 3, LayoutOptions().bucket_bytes(64).align(4));
  const auto b = FlatLayout::plan(params, 3, LayoutOptions().bucket_bytes(64).align(4));
  EXPECT_EQ(a.describe(), b.describe());
  EXPECT_TRUE(a.same_placement(b));
}

// Every configuration: pieces disjoint and inside their shards, buckets tile their owner's
// trainable region in order and respect the cap, each trainable parameter in exactly one bucket.
TEST(FlatLayout, InvariantsHoldForManyConfigurations) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 5);
    const int64_t align = int64_t{1} << (rng() % 4);
    const int64_t cap = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 400);
    std::vector<LayoutParam> params;
    const int n = 1 + static_cast<int>(rng() % 30);
    const bool split = rng() % 2 == 0;
    for (int i = 0; i < n; ++i) {
      params.push_back(param(static_cast<int64_t>(rng() % 50), static_cast<int>(rng() % world), rng() % 4 != 0,
                             rng() % 3 == 0 ? c10::kDouble : c10::kFloat));
      params.back().whole = split && rng() % 3 == 0;  // a whole-tensor optimizer's: rows of whole parameters
    }
    const auto layout = FlatLayout::plan(params, world, LayoutOptions().bucket_bytes(cap).align(align).split(split));
    std::vector<std::vector<std::vector<int>>> used(layout.groups().size());
    for (size_t g = 0; g < layout.groups().size(); ++g) {
      used[g].assign(world, std::vector<int>(layout.groups()[g].shard_numel, 0));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      int64_t covered = 0;
      for (size_t k : layout.pieces_of(i)) {
        const Piece& p = layout.pieces()[k];
        ASSERT_EQ(p.param, i);
        ASSERT_EQ(p.in_param.begin, covered);
        covered = p.in_param.end;
        ASSERT_EQ(p.bucket >= 0, params[i].trainable);
        if (!params[i].trainable) {
          ASSERT_EQ(p.owner, -1);
          continue;
        }
        if (!split || params[i].whole) ASSERT_EQ(p.owner, params[i].owner);
        if (params[i].whole) ASSERT_TRUE(p.whole());
        for (int64_t e = p.in_shard.begin; e < p.in_shard.end; ++e) ASSERT_EQ(used[p.group][p.owner][e]++, 0);
      }
      ASSERT_EQ(covered, params[i].numel);
      ASSERT_EQ(layout.param_in_buffer(i).begin % align, 0);
      ASSERT_EQ(layout.param_in_buffer(i).size(), params[i].numel);
    }
    if (split) {
      // Every rank's shard is the same size, and none holds more than its share plus padding.
      for (const auto& g : layout.groups()) {
        int64_t run = 0;
        for (int64_t u : g.used) run = std::max(run, u);
        ASSERT_LE(g.shard_numel, run + align);
      }
    }
    std::vector<std::vector<int64_t>> last_end(layout.groups().size(), std::vector<int64_t>(world + 1, 0));
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      const auto& bucket = layout.buckets()[b];
      const FlatGroup& group = layout.groups()[bucket.group];
      ASSERT_EQ(bucket.rows(), group.rows);
      ASSERT_EQ(group.rows, split);
      const size_t slot = bucket.rows() ? static_cast<size_t>(world) : static_cast<size_t>(bucket.owner);
      ASSERT_GE(bucket.in_shard.begin, last_end[bucket.group][slot]);
      last_end[bucket.group][slot] = bucket.in_shard.end;
      const int64_t element = static_cast<int64_t>(c10::elementSize(layout.groups()[bucket.group].dtype));
      std::set<size_t> in_bucket;
      int64_t elements = 0;
      std::vector<int64_t> per_rank(world, 0);
      for (size_t k : bucket.pieces) {
        const Piece& p = layout.pieces()[k];
        in_bucket.insert(p.param);
        elements += p.in_param.size();
        per_rank[p.owner] += p.in_param.size();
        ASSERT_EQ(p.bucket, static_cast<int64_t>(b));
        ASSERT_EQ(p.in_bucket.begin + bucket.in_shard.begin, p.in_shard.begin);
        ASSERT_LE(p.in_bucket.end, bucket.numel());
      }
      if (bucket.rows() && !group.split) {
        // Rows of whole parameters: as long as the longest, which passes the bucket's share of one
        // rank only where one parameter is longer.
        int64_t longest = 0, largest = 0;
        for (size_t k : bucket.pieces) {
          const Piece& p = layout.pieces()[k];
          longest = std::max(longest, p.in_bucket.end);
          largest = std::max(largest, p.in_param.size());
        }
        ASSERT_EQ(bucket.numel(), (std::max<int64_t>(1, longest) + align - 1) / align * align);
        if (cap > 0) ASSERT_LT(bucket.numel(), std::max({cap / (world * element), largest, int64_t{1}}) + align);
      } else if (bucket.rows()) {
        // Several parameters only within the cap; every rank's row within `align` of its share.
        if (in_bucket.size() > 1 && cap > 0) ASSERT_LE(elements * element, cap);
        for (int r = 0; r < world; ++r) ASSERT_LE(per_rank[r], bucket.numel());
        ASSERT_LE(bucket.numel(), (elements + in_bucket.size() * align + world - 1) / world + align);
      } else if (bucket.pieces.size() > 1) {
        ASSERT_LE(bucket.numel() * element, cap);
      }
    }
    // Every trainable element has its own place in its group's buffer, inside the shards.
    std::vector<std::vector<int>> taken(layout.groups().size());
    for (size_t g = 0; g < layout.groups().size(); ++g) taken[g].assign(layout.groups()[g].buffer_numel(), 0);
    for (const auto& p : layout.pieces()) {
      const Range at = layout.in_buffer(p);
      ASSERT_EQ(at.size(), p.in_param.size());
      if (p.owner >= 0) ASSERT_LE(at.end, layout.groups()[p.group].shards_in_buffer().end);
      for (int64_t e = at.begin; e < at.end; ++e) ASSERT_EQ(taken[p.group][e]++, 0);
    }
  }
}

TEST(FlatLayout, BadInputIsNamed) {
  try {
    FlatLayout::plan({param(4, 0), param(4, 3)}, 2);
    ADD_FAILURE() << "owner 3 of 2 must throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 1 has owner 3, outside [0, 2)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(FlatLayout::plan({param(4, 0)}, 1, LayoutOptions().align(0)), c10::Error);
  EXPECT_THROW(FlatLayout::plan({param(4, 0)}, 0), c10::Error);
}

// Split mode: the frozen parameters with state form a kept run in reverse order, cut into equal
// ranges, one per rank; frozen ones without state and trainable ones keep nothing.
// With `align` (blocks of 8-bit state: Note [8-bit state]), every piece of a split parameter, and
// every range of its kept state, starts at a multiple of `align` elements of the parameter: each
// block has one owner and one keeper, whatever the world size and the trainable set.
TEST(FlatLayout, AlignedSplitsCutEveryParameterAtAMultipleOfTheAlignment) {
  std::mt19937 rng(5);
  int cuts = 0, kept_cuts = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 9);
    std::vector<LayoutParam> params;
    const int count = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      params.push_back(param(static_cast<int64_t>(rng() % 5000), 0, rng() % 3 != 0));
      params.back().keeps_state = !params.back().trainable && rng() % 2 == 0;
    }
    const auto bucket = static_cast<int64_t>(rng() % 3) * 4096;
    const auto layout = FlatLayout::plan(params, world, LayoutOptions().split(true).align(256).bucket_bytes(bucket));
    for (const Piece& piece : layout.pieces()) {
      EXPECT_EQ(piece.in_param.begin % 256, 0) << "trial " << trial << ", parameter " << piece.param;
      cuts += piece.in_param.begin > 0;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& keeping : layout.keepers_of(i)) {
        EXPECT_EQ(keeping.in_param.begin % 256, 0) << "trial " << trial << ", kept parameter " << i;
        kept_cuts += keeping.in_param.begin > 0;
      }
    }
  }
  EXPECT_GT(cuts, 100);  // parameters were cut, trainable and kept
  EXPECT_GT(kept_cuts, 20);
}

TEST(FlatLayout, KeptStateIsCutIntoEqualRangesAcrossTheRanks) {
  std::vector<LayoutParam> params = {param(6, 0, false), param(5, 0), param(4, 0, false), param(3, 0, false)};
  params[0].keeps_state = params[2].keeps_state = true;  // parameter 3 was never stepped
  const auto layout = FlatLayout::plan(params, 3, LayoutOptions().split(true));
  EXPECT_TRUE(layout.keepers_of(1).empty());
  EXPECT_TRUE(layout.keepers_of(3).empty());
  // The kept run is parameter 2 (elements 0-3), then parameter 0 (4-9): ranges of 4 per rank.
  ASSERT_EQ(layout.keepers_of(2).size(), 1u);
  EXPECT_EQ(layout.keepers_of(2)[0].rank, 0);
  EXPECT_EQ(layout.keepers_of(2)[0].in_param, (Range{0, 4}));
  ASSERT_EQ(layout.keepers_of(0).size(), 2u);
  EXPECT_EQ(layout.keepers_of(0)[0].rank, 1);
  EXPECT_EQ(layout.keepers_of(0)[0].in_param, (Range{0, 4}));
  EXPECT_EQ(layout.keepers_of(0)[1].rank, 2);
  EXPECT_EQ(layout.keepers_of(0)[1].in_param, (Range{4, 6}));
  // Whole parameters keep their state with their owner: no kept run.
  const auto whole = FlatLayout::plan(params, 3);
  EXPECT_TRUE(whole.keepers_of(0).empty());
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

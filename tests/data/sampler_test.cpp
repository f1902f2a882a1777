#include <shardopt/data/data_sampler.h>
#include <shardopt/data/sampler.h>

#include "harness.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/data/dataloader.h>
#include <torch/data/datasets/base.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

// Runs `fn` and expects a c10::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find(needle), std::string::npos) << "message: " << what;
  }
}

// One global step: the ranks' batches concatenated in rank order.
struct GlobalStep {
  std::vector<int64_t> indices;
  std::vector<uint8_t> real;
  int64_t global_real = 0;
  bool operator==(const GlobalStep& o) const {
    return indices == o.indices && real == o.real && global_real == o.global_real;
  }
  bool operator!=(const GlobalStep& o) const { return !(*this == o); }
};

// Every rank's sampler, each built on its own, over one epoch. Returns "" or the first violation
// of the lockstep contract: equal step counts, batches of exactly batch_size, one global_real.
std::string run_epoch(int64_t n, int world, const SamplerOptions& options, int64_t epoch,
                      std::vector<GlobalStep>* out) {
  std::vector<BalancedSampler> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back(n, r, world, options);
    ranks.back().set_epoch(epoch);
  }
  const int64_t steps = ranks[0].steps_per_epoch();
  const int64_t b = options.batch_size();
  out->assign(steps, GlobalStep{});
  for (int r = 0; r < world; ++r) {
    if (ranks[r].steps_per_epoch() != steps) return "rank " + std::to_string(r) + " has another step count";
    for (int64_t t = 0; t < steps; ++t) {
      const Batch batch = ranks[r].batch(t);
      if (static_cast<int64_t>(batch.indices.size()) != b || static_cast<int64_t>(batch.real.size()) != b) {
        return "rank " + std::to_string(r) + " step " + std::to_string(t) + ": batch of the wrong size";
      }
      GlobalStep& g = (*out)[t];
      if (r > 0 && g.global_real != batch.global_real) return "ranks disagree on global_real";
      g.global_real = batch.global_real;
      g.indices.insert(g.indices.end(), batch.indices.begin(), batch.indices.end());
      g.real.insert(g.real.end(), batch.real.begin(), batch.real.end());
    }
  }
  return "";
}

// The whole sequence of one epoch as a single process sees it (batch 1, padding mode).
std::vector<int64_t> sequence(int64_t n, SamplerOptions options, int64_t epoch) {
  options.batch_size(1).tail(Tail::kPad);
  BalancedSampler s(n, 0, 1, options);
  s.set_epoch(epoch);
  std::vector<int64_t> seq;
  for (int64_t t = 0; t < s.steps_per_epoch(); ++t) seq.push_back(s.batch(t).indices[0]);
  return seq;
}

// ---- properties over many small configurations --------------------------------------------------

// The checks of one configuration; "" when all hold.
std::string check_config(int64_t n, int world, const SamplerOptions& options, int64_t epoch) {
  std::vector<GlobalStep> steps;
  std::string error = run_epoch(n, world, options, epoch, &steps);
  if (!error.empty()) return error;
  const int64_t g = world * options.batch_size();
  const bool pad = options.tail() == Tail::kPad;
  const int64_t expected_steps = pad ? (n + g - 1) / g : n / g;
  if (static_cast<int64_t>(steps.size()) != expected_steps) return "wrong steps_per_epoch";

  std::vector<int> seen(n, 0);
  for (size_t t = 0; t < steps.size(); ++t) {
    const GlobalStep& step = steps[t];
    int64_t real = 0;
    for (size_t i = 0; i < step.indices.size(); ++i) {
      const int64_t index = step.indices[i];
      if (index < 0 || index >= n) return "index out of range at step " + std::to_string(t);
      if (step.real[i]) {
        ++real;
        ++seen[index];
      } else if (!pad) {
        return "padding in drop mode";
      }
    }
    if (real != step.global_real) return "global_real does not count the real entries";
    if (real == 0) return "empty global step " + std::to_string(t);
    if (real < g && t + 1 != steps.size()) return "padding before the last step";
  }
  int64_t covered = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (seen[i] > 1) return "index " + std::to_string(i) + " served twice";
    covered += seen[i];
  }
  if (pad && covered != n) return "pad mode does not cover range(N)";
  if (!pad && (n - covered >= g || covered != expected_steps * g)) return "drop mode drops G or more";

  // The global batch equals the single-process sampler's batch at the same G.
  SamplerOptions single = options;
  single.batch_size(g);
  BalancedSampler one(n, 0, 1, single);
  one.set_epoch(epoch);
  if (one.steps_per_epoch() != expected_steps) return "single-process step count differs";
  for (int64_t t = 0; t < expected_steps; ++t) {
    const Batch b = one.batch(t);
    if (GlobalStep{b.indices, b.real, b.global_real} != steps[t]) {
      return "global batch " + std::to_string(t) + " differs from the single-process batch";
    }
  }
  return "";
}

TEST(BalancedSampler, PropertySweep) {
  const std::pair<uint64_t, int64_t> seed_epochs[] = {{0, 0}, {42, 1}, {7, 5}};
  for (int64_t n = 0; n <= 200; ++n) {
    for (int world = 1; world <= 8; ++world) {
      for (int64_t b = 1; b <= 5; ++b) {
        for (Tail tail : {Tail::kPad, Tail::kDrop}) {
          for (auto [seed, epoch] : seed_epochs) {
            const std::string error = check_config(n, world, SamplerOptions(b).seed(seed).tail(tail), epoch);
            ASSERT_EQ(error, "") << "N=" << n << " world=" << world << " batch=" << b
                                 << " tail=" << (tail == Tail::kPad ? "pad" : "drop") << " seed=" << seed
                                 << " epoch=" << epoch;
          }
        }
      }
    }
  }
}

TEST(BalancedSampler, GlobalBatchDoesNotDependOnWorldSize) {
  // G = 12 split every possible way, also with chunks: same global batches, same padding.
  const std::vector<std::pair<int, int64_t>> splits = {{1, 12}, {2, 6}, {3, 4}, {4, 3}, {6, 2}, {12, 1}};
  for (int64_t n : {1, 11, 12, 13, 50, 143}) {
    for (bool chunked : {false, true}) {
      for (Tail tail : {Tail::kPad, Tail::kDrop}) {
        SamplerOptions options = SamplerOptions(1).seed(9).tail(tail);
        if (chunked) {
          std::vector<int64_t> sizes;  // uneven: 1, 3, 5, 7, 2, 4, ... with the rest last
          for (int64_t left = n, next = 1; left > 0; next = next % 7 + 2) {
            sizes.push_back(std::min(left, next));
            left -= sizes.back();
          }
          options.chunk_sizes(sizes).window_chunks(2);
        }
        std::vector<GlobalStep> reference;
        ASSERT_EQ(run_epoch(n, 1, SamplerOptions(options).batch_size(12), 3, &reference), "");
        for (auto [world, b] : splits) {
          std::vector<GlobalStep> got;
          ASSERT_EQ(run_epoch(n, world, SamplerOptions(options).batch_size(b), 3, &got), "");
          EXPECT_EQ(got, reference) << "N=" << n << " world=" << world << " chunked=" << chunked;
        }
      }
    }
  }
}

TEST(BalancedSampler, OrderChangesBetweenEpochs) {
  for (int64_t n = 8; n <= 200; n += 3) {
    for (uint64_t seed : {0, 1, 42}) {
      for (int64_t epoch = 0; epoch < 4; ++epoch) {
        EXPECT_NE(sequence(n, SamplerOptions(1).seed(seed), epoch),
                  sequence(n, SamplerOptions(1).seed(seed), epoch + 1))
            << "N=" << n << " seed=" << seed << " epoch=" << epoch;
      }
    }
    // Another seed, another order.
    EXPECT_NE(sequence(n, SamplerOptions(1).seed(1), 0), sequence(n, SamplerOptions(1).seed(2), 0));
  }
}

TEST(BalancedSampler, NoShuffleIsStorageOrder) {
  std::vector<int64_t> identity(57);
  for (int64_t i = 0; i < 57; ++i) identity[i] = i;
  EXPECT_EQ(sequence(57, SamplerOptions(1).shuffle(false), 4), identity);
  EXPECT_EQ(sequence(57, SamplerOptions(1).shuffle(false).chunk_sizes({20, 7, 30}).window_chunks(2), 4), identity);
}

TEST(BalancedSampler, DropModeExcludesNoSampleInEveryEpoch) {
  // N = 10 on 4 ranks: G = 4, two samples dropped per epoch; which two must change.
  for (uint64_t seed : {0, 1, 2, 3, 42}) {
    std::vector<int> served(10, 0);
    for (int64_t epoch = 0; epoch < 20; ++epoch) {
      for (int r = 0; r < 4; ++r) {
        BalancedSampler s(10, r, 4, SamplerOptions(1).seed(seed).tail(Tail::kDrop));
        s.set_epoch(epoch);
        ASSERT_EQ(s.steps_per_epoch(), 2);
        for (int64_t t = 0; t < 2; ++t) ++served[s.batch(t).indices[0]];
      }
    }
    for (int i = 0; i < 10; ++i) EXPECT_GT(served[i], 0) << "sample " << i << " dropped in every epoch, seed " << seed;
  }
}

TEST(BalancedSampler, PaddingIsFlaggedAndFetchable) {
  // N = 10, 4 ranks of 3: the last step has 2 real entries and 10 padding entries.
  for (int r = 0; r < 4; ++r) {
    BalancedSampler s(10, r, 4, SamplerOptions(3).seed(5));
    ASSERT_EQ(s.steps_per_epoch(), 1);
    const Batch b = s.batch(0);
    EXPECT_EQ(b.global_real, 10);
  }
  BalancedSampler last(10, 3, 4, SamplerOptions(3).seed(5));
  const Batch b = last.batch(0);
  EXPECT_EQ(b.real, (std::vector<uint8_t>{1, 0, 0}));
  // Padding carries valid indices that a loader can fetch.
  for (int64_t i : b.indices) EXPECT_TRUE(i >= 0 && i < 10);
}

// First 32 indices of N = 1000, seed 42, epochs 0-2: a change here changes every user's data
// order, and a checkpoint taken before it would resume on another sequence (such a change must
// bump SamplerState::kVersion).
TEST(BalancedSampler, GoldenVectors) {
  const std::vector<std::vector<int64_t>> golden = {
      {581, 228, 944, 965, 810, 393, 356, 582, 527, 501, 272, 97,  247, 352, 410, 543,
       750, 378, 608, 512, 995, 539, 595, 941, 372, 320, 56,  889, 30,  350, 269, 224},
      {539, 706, 271, 220, 502, 110, 798, 477, 381, 974, 658, 453, 674, 372, 326, 564,
       313, 171, 529, 850, 601, 933, 150, 912, 820, 738, 665, 261, 317, 513, 944, 885},
      {456, 459, 256, 493, 550, 819, 903, 804, 7,   275, 482, 571, 549, 999, 874, 35,
       927, 127, 93,  470, 696, 726, 762, 962, 668, 306, 441, 367, 619, 576, 716, 365},
  };
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    BalancedSampler s(1000, 0, 1, SamplerOptions(32).seed(42));
    s.set_epoch(epoch);
    EXPECT_EQ(s.batch(0).indices, golden[epoch]) << "epoch " << epoch;
  }
  // Chunked: the first window of epoch 1 holds chunks 1 and 2 (indices 100..399).
  BalancedSampler chunked(1000, 0, 1,
                          SamplerOptions(16).seed(42).chunk_sizes({100, 250, 50, 300, 200, 100}).window_chunks(2));
  chunked.set_epoch(1);
  EXPECT_EQ(chunked.batch(0).indices,
            (std::vector<int64_t>{318, 339, 360, 325, 216, 266, 105, 143, 151, 394, 284, 234, 287, 317, 305, 351}));
}

// ---- shuffle quality --------------------------------------------------------------------------

// Chi-square statistic of observed counts against a uniform expectation over `cells` cells.
double chi_square(const std::vector<int64_t>& counts, double expected) {
  double chi = 0;
  for (int64_t c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

// A bound that a uniform shuffle exceeds with negligible probability (5 standard deviations).
double chi_square_bound(double dof) {
  return dof + 5 * std::sqrt(2 * dof);
}

TEST(BalancedSampler, ShuffleIsUnbiased) {
  // Small N: every order equally often over seeds.
  for (int64_t n : {2, 3, 4, 5}) {
    int64_t orders = 1;
    for (int64_t i = 2; i <= n; ++i) orders *= i;
    const int64_t trials = 200 * orders;
    std::map<std::vector<int64_t>, int64_t> count;
    for (int64_t seed = 0; seed < trials; ++seed) count[sequence(n, SamplerOptions(1).seed(seed), 0)]++;
    ASSERT_EQ(static_cast<int64_t>(count.size()), orders) << "N=" << n << ": some orders never occur";
    std::vector<int64_t> counts;
    for (auto& kv : count) counts.push_back(kv.second);
    EXPECT_LT(chi_square(counts, 200.0), chi_square_bound(orders - 1)) << "N=" << n;
  }
  // Larger N: each sample equally likely at each position (over epochs).
  for (int64_t n : {10, 37}) {
    const int64_t trials = 400 * n;
    std::vector<int64_t> counts(n * n, 0);
    for (int64_t epoch = 0; epoch < trials; ++epoch) {
      const auto seq = sequence(n, SamplerOptions(1).seed(3), epoch);
      for (int64_t p = 0; p < n; ++p) counts[seq[p] * n + p]++;
    }
    EXPECT_LT(chi_square(counts, 400.0), chi_square_bound(double(n - 1) * (n - 1))) << "N=" << n;
  }
  // Chunk visit order: all 120 orders of 5 chunks equally often.
  std::map<std::vector<int64_t>, int64_t> count;
  for (int64_t epoch = 0; epoch < 24000; ++epoch) {
    count[sequence(5, SamplerOptions(1).seed(11).chunk_sizes({1, 1, 1, 1, 1}).window_chunks(1), epoch)]++;
  }
  ASSERT_EQ(count.size(), 120u);
  std::vector<int64_t> counts;
  for (auto& kv : count) counts.push_back(kv.second);
  EXPECT_LT(chi_square(counts, 200.0), chi_square_bound(119));
}

// ---- resume -----------------------------------------------------------------------------------

TEST(BalancedSampler, ResumeAtEveryStep) {
  struct Case {
    int64_t n;
    int world;
    SamplerOptions options;
  };
  const std::vector<Case> cases = {
      {37, 3, SamplerOptions(2).seed(4)},
      {37, 3, SamplerOptions(2).seed(4).tail(Tail::kDrop)},
      {64, 4, SamplerOptions(4)},
      {100, 2, SamplerOptions(3).seed(8).chunk_sizes({13, 1, 40, 6, 25, 15}).window_chunks(2)},
  };
  for (const Case& c : cases) {
    for (int r = 0; r < c.world; ++r) {
      BalancedSampler run(c.n, r, c.world, c.options);
      run.set_epoch(2);
      for (int64_t k = 0; k <= run.steps_per_epoch(); ++k) {
        const SamplerState state = run.state(k);
        EXPECT_EQ(state.epoch, 2);
        EXPECT_EQ(state.next_step, k);
        BalancedSampler resumed(c.n, r, c.world, c.options);  // starts at epoch 0
        resumed.restore(state);
        EXPECT_EQ(resumed.epoch(), 2);
        ASSERT_EQ(resumed.steps_per_epoch(), run.steps_per_epoch());
        for (int64_t t = k; t < run.steps_per_epoch(); ++t) {
          const Batch a = run.batch(t), b = resumed.batch(t);
          ASSERT_EQ(a.indices, b.indices) << "N=" << c.n << " rank " << r << " resumed at " << k << ", step " << t;
          ASSERT_EQ(a.real, b.real);
          ASSERT_EQ(a.global_real, b.global_real);
        }
      }
    }
  }
}

TEST(BalancedSampler, ResizeWithTheSameGlobalBatch) {
  const std::vector<std::pair<int, int64_t>> splits = {{1, 12}, {2, 6}, {3, 4}, {4, 3}, {6, 2}, {12, 1}};
  for (int64_t n : {0, 7, 12, 50, 97}) {
    for (bool chunked : {false, true}) {
      if (chunked && n < 2) continue;
      SamplerOptions base = SamplerOptions(1).seed(21);
      if (chunked) base.chunk_sizes({n / 2, n - n / 2}).window_chunks(1);
      std::vector<GlobalStep> reference;
      ASSERT_EQ(run_epoch(n, 1, SamplerOptions(base).batch_size(12), 3, &reference), "");
      const int64_t steps = static_cast<int64_t>(reference.size());
      for (auto [w1, b1] : splits) {
        for (auto [w2, b2] : splits) {
          for (int64_t k = 0; k <= steps; ++k) {
            std::vector<int> seen(n, 0);
            // Segment 1: steps [0, k) on w1 ranks; the state comes from rank 0.
            SamplerState state;
            for (int r = 0; r < w1; ++r) {
              BalancedSampler s(n, r, w1, SamplerOptions(base).batch_size(b1));
              s.set_epoch(3);
              if (r == 0) state = s.state(k);
              for (int64_t t = 0; t < k; ++t) {
                const Batch b = s.batch(t);
                for (int64_t i = 0; i < b1; ++i) seen[b.indices[i]] += b.real[i];
              }
            }
            // Segment 2: steps [k, steps) on w2 ranks, resumed from the state.
            std::vector<GlobalStep> got(steps);
            for (int r = 0; r < w2; ++r) {
              BalancedSampler s(n, r, w2, SamplerOptions(base).batch_size(b2));
              s.restore(state);
              ASSERT_EQ(s.steps_per_epoch(), steps);
              for (int64_t t = k; t < steps; ++t) {
                const Batch b = s.batch(t);
                got[t].global_real = b.global_real;
                got[t].indices.insert(got[t].indices.end(), b.indices.begin(), b.indices.end());
                got[t].real.insert(got[t].real.end(), b.real.begin(), b.real.end());
                for (int64_t i = 0; i < b2; ++i) seen[b.indices[i]] += b.real[i];
              }
            }
            for (int64_t t = k; t < steps; ++t) {
              ASSERT_EQ(got[t], reference[t]) << "N=" << n << " (" << w1 << "x" << b1 << ") -> (" << w2 << "x" << b2
                                              << ") at " << k << ", step " << t;
            }
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "index " << i << " N=" << n << " k=" << k;
          }
        }
      }
    }
  }
}

TEST(BalancedSampler, RestoreRejectsAnotherDatasetOrOptions) {
  BalancedSampler a(100, 0, 2, SamplerOptions(5).seed(1));
  a.set_epoch(3);
  const SamplerState s = a.state(4);

  BalancedSampler other_size(101, 0, 2, SamplerOptions(5).seed(1));
  expect_error([&] { other_size.restore(s); }, "dataset of 100 samples, this sampler has 101");
  BalancedSampler other_seed(100, 0, 2, SamplerOptions(5).seed(2));
  expect_error([&] { other_seed.restore(s); }, "fingerprint");
  BalancedSampler other_tail(100, 0, 2, SamplerOptions(5).seed(1).tail(Tail::kDrop));
  expect_error([&] { other_tail.restore(s); }, "fingerprint");
  BalancedSampler chunked(100, 0, 2, SamplerOptions(5).seed(1).chunk_sizes({50, 50}));
  expect_error([&] { chunked.restore(s); }, "fingerprint");
  BalancedSampler other_window(100, 0, 2, SamplerOptions(5).seed(1).chunk_sizes({50, 50}).window_chunks(2));
  expect_error([&] { other_window.restore(chunked.state(0)); }, "fingerprint");
  BalancedSampler other_chunks(100, 0, 2, SamplerOptions(5).seed(1).chunk_sizes({40, 60}));
  expect_error([&] { other_chunks.restore(chunked.state(0)); }, "fingerprint");
  BalancedSampler other_global(100, 0, 2, SamplerOptions(4).seed(1));
  expect_error([&] { other_global.restore(s); }, "world_size * batch_size = 10, this sampler has 2 * 4 = 8");

  SamplerState future = s;
  future.version = SamplerState::kVersion + 1;
  expect_error([&] { a.restore(future); }, "state format version 2");
  SamplerState past_end = s;
  past_end.next_step = a.steps_per_epoch() + 1;
  expect_error([&] { a.restore(past_end); }, "next_step 11");

  // A failed restore leaves the sampler as it was.
  EXPECT_EQ(other_seed.epoch(), 0);
  // The same dataset and options on another world size with the same G: accepted.
  BalancedSampler resized(100, 3, 5, SamplerOptions(2).seed(1));
  resized.restore(s);
  EXPECT_EQ(resized.epoch(), 3);
}

// ---- chunked datasets -------------------------------------------------------------------------

// Maximum number of chunks a reader must hold when it loads a chunk at its first use and frees
// it after its last use, over the sequence of indices `seq`.
int64_t max_resident_chunks(const std::vector<int64_t>& seq, const std::vector<int64_t>& chunk_begin) {
  auto chunk_of = [&](int64_t index) {
    return std::upper_bound(chunk_begin.begin(), chunk_begin.end(), index) - chunk_begin.begin() - 1;
  };
  std::map<int64_t, size_t> last_use;
  for (size_t p = 0; p < seq.size(); ++p) last_use[chunk_of(seq[p])] = p;
  std::set<int64_t> resident;
  int64_t most = 0;
  for (size_t p = 0; p < seq.size(); ++p) {
    const int64_t c = chunk_of(seq[p]);
    resident.insert(c);
    most = std::max<int64_t>(most, resident.size());
    if (last_use[c] == p) resident.erase(c);
  }
  return most;
}

TEST(BalancedSampler, ChunkLocalityBound) {
  const std::vector<int64_t> sizes = {1, 17, 3, 40, 2, 2, 9, 1, 25, 5, 13, 8, 31, 4};
  std::vector<int64_t> chunk_begin = {0};
  for (int64_t s : sizes) chunk_begin.push_back(chunk_begin.back() + s);
  const int64_t n = chunk_begin.back();
  const int64_t chunks = static_cast<int64_t>(sizes.size());
  for (int64_t window : {1, 2, 3, 5, 14, 20}) {
    std::set<std::vector<int64_t>> orders;
    for (int64_t epoch = 0; epoch < 4; ++epoch) {
      for (auto [world, b] : std::vector<std::pair<int, int64_t>>{{1, 1}, {3, 4}, {4, 7}}) {
        for (Tail tail : {Tail::kPad, Tail::kDrop}) {
          const auto options = SamplerOptions(b).seed(13).tail(tail).chunk_sizes(sizes).window_chunks(window);
          std::string error = check_config(n, world, options, epoch);
          ASSERT_EQ(error, "") << "window " << window << " world " << world;
          std::vector<GlobalStep> steps;
          ASSERT_EQ(run_epoch(n, world, options, epoch, &steps), "");
          std::vector<int64_t> global;
          std::vector<std::vector<int64_t>> per_rank(world);
          for (const GlobalStep& g : steps) {
            global.insert(global.end(), g.indices.begin(), g.indices.end());
            for (int r = 0; r < world; ++r) {
              per_rank[r].insert(per_rank[r].end(), g.indices.begin() + r * b, g.indices.begin() + (r + 1) * b);
            }
          }
          // Padding included: it is read from the chunks of the last window.
          EXPECT_LE(max_resident_chunks(global, chunk_begin), window) << "window " << window << " world " << world;
          for (int r = 0; r < world; ++r) EXPECT_LE(max_resident_chunks(per_rank[r], chunk_begin), window);
        }
      }
      orders.insert(sequence(n, SamplerOptions(1).seed(13).chunk_sizes(sizes).window_chunks(window), epoch));
    }
    EXPECT_EQ(orders.size(), 4u) << "the order must change with the epoch, window " << window;
  }
  // Rows are mixed across the chunks of a window, and shuffled inside a lone chunk.
  const auto mixed = sequence(n, SamplerOptions(1).seed(13).chunk_sizes(sizes).window_chunks(chunks), 0);
  int64_t switches = 0;
  for (size_t p = 1; p < mixed.size(); ++p) {
    auto chunk_of = [&](int64_t i) {
      return std::upper_bound(chunk_begin.begin(), chunk_begin.end(), i) - chunk_begin.begin();
    };
    switches += chunk_of(mixed[p]) != chunk_of(mixed[p - 1]);
  }
  EXPECT_GT(switches, 3 * chunks);
  const auto lone = sequence(40, SamplerOptions(1).seed(13).chunk_sizes({40}).window_chunks(1), 0);
  EXPECT_FALSE(std::is_sorted(lone.begin(), lone.end()));
}

// ---- scale ------------------------------------------------------------------------------------

TEST(BalancedSampler, HugeDatasetConstructsInstantlyAndServesRandomSteps) {
  const int64_t n = int64_t{1} << 40;
  std::vector<int64_t> sizes;
  for (int c = 0; c < 4096; ++c) sizes.push_back((int64_t{1} << 28) + (c % 2 ? 1000 : -1000));
  for (bool chunked : {false, true}) {
    const auto start = std::chrono::steady_clock::now();
    SamplerOptions options = SamplerOptions(3).seed(99);
    if (chunked) options.chunk_sizes(sizes).window_chunks(4);
    BalancedSampler s(n, 5, 8, options);
    s.set_epoch(7);
    const int64_t steps = s.steps_per_epoch();
    ASSERT_EQ(steps, (n + 23) / 24);
    std::set<int64_t> visited, served;
    int64_t real = 0;
    for (int64_t i = 0; i < 2000; ++i) {
      // Steps spread over the epoch, the last one first.
      const int64_t step = steps - 1 - static_cast<int64_t>((static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ULL) % steps);
      if (!visited.insert(step).second) continue;
      const Batch b = s.batch(step);
      ASSERT_EQ(b.indices.size(), 3u);
      for (size_t j = 0; j < 3; ++j) {
        ASSERT_TRUE(b.indices[j] >= 0 && b.indices[j] < n);
        if (b.real[j]) served.insert(b.indices[j]), ++real;
      }
      if (step == steps - 1) {
        EXPECT_EQ(b.global_real, n % 24);  // 2^40 = 16 mod 24: rank 5 holds position 15 and two pads
        EXPECT_EQ(b.real, (std::vector<uint8_t>{1, 0, 0}));
      }
    }
    EXPECT_EQ(static_cast<int64_t>(served.size()), real) << "a bijection serves no index twice";
    EXPECT_GT(real, 5000);
    // Anything that materialised N = 2^40 indices would take hours and terabytes.
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 2.0) << "chunked=" << chunked;
  }
}

// ---- bad input --------------------------------------------------------------------------------

TEST(BalancedSampler, BadInputIsAClearError) {
  expect_error([] { BalancedSampler(10, 0, 1, SamplerOptions(0)); }, "batch_size must be >= 1, got 0");
  expect_error([] { BalancedSampler(10, 0, 1, SamplerOptions(-3)); }, "batch_size must be >= 1, got -3");
  expect_error([] { BalancedSampler(10, 0, 0, SamplerOptions(1)); }, "world_size must be >= 1, got 0");
  expect_error([] { BalancedSampler(10, 0, -2, SamplerOptions(1)); }, "world_size must be >= 1, got -2");
  expect_error([] { BalancedSampler(10, 4, 4, SamplerOptions(1)); }, "rank must be in [0, world_size = 4), got 4");
  expect_error([] { BalancedSampler(10, -1, 4, SamplerOptions(1)); }, "rank must be in [0, world_size = 4), got -1");
  expect_error([] { BalancedSampler(-1, 0, 1, SamplerOptions(1)); }, "dataset_size must be >= 0, got -1");
  expect_error([] { BalancedSampler(int64_t{1} << 62 | 1, 0, 1, SamplerOptions(1)); }, "at most 2^62");
  expect_error([] { BalancedSampler(10, 0, 1 << 30, SamplerOptions(int64_t{1} << 40)); }, "exceeds 2^62");
  expect_error(
      [] {
        BalancedSampler(10, 0, 1, SamplerOptions(1).chunk_sizes({4, 0, 6}));
      },
      "chunk_sizes[1] must be >= 1");
  expect_error(
      [] {
        BalancedSampler(10, 0, 1, SamplerOptions(1).chunk_sizes({14, -4}));
      },
      "chunk_sizes[1] must be >= 1 (no empty or negative chunks), got -4");
  expect_error(
      [] {
        BalancedSampler(10, 0, 1, SamplerOptions(1).chunk_sizes({4, 5}));
      },
      "sum to 9 but dataset_size is 10");
  expect_error(
      [] {
        BalancedSampler(10, 0, 1, SamplerOptions(1).chunk_sizes({4, 6}).window_chunks(0));
      },
      "window_chunks must be >= 1, got 0");

  BalancedSampler s(10, 1, 2, SamplerOptions(2));  // 3 steps
  expect_error([&] { s.batch(3); }, "step 3 is outside the epoch: steps_per_epoch() is 3");
  expect_error([&] { s.batch(-1); }, "step -1 is outside the epoch");
  expect_error([&] { s.state(4); }, "next_step must be in [0, 3]");
  expect_error([&] { s.set_epoch(-1); }, "epoch must be >= 0, got -1");
  BalancedSampler empty(0, 0, 1, SamplerOptions(2));
  EXPECT_EQ(empty.steps_per_epoch(), 0);
  expect_error([&] { empty.batch(0); }, "step 0 is outside the epoch");
}

// ---- the group constructor --------------------------------------------------------------------

TEST(BalancedSampler, GroupConstructorChecksAgreement) {
  // Agreement: the same batches as the rank/world_size constructor.
  testing::run_ranks(3, [](std::shared_ptr<ProcessGroup> group) {
    BalancedSampler s(50, *group, SamplerOptions(4).seed(6));
    BalancedSampler plain(50, group->rank(), 3, SamplerOptions(4).seed(6));
    EXPECT_EQ(s.rank(), group->rank());
    EXPECT_EQ(s.world_size(), 3);
    ASSERT_EQ(s.steps_per_epoch(), plain.steps_per_epoch());
    for (int64_t t = 0; t < s.steps_per_epoch(); ++t) EXPECT_EQ(s.batch(t).indices, plain.batch(t).indices);
  });
  // One rank differs: every rank throws, naming the field.
  auto seeds = testing::run_ranks_collect_errors(3, [](std::shared_ptr<ProcessGroup> group) {
    BalancedSampler(50, *group, SamplerOptions(4).seed(group->rank() == 2 ? 7 : 6));
  });
  for (const auto& e : seeds)
    EXPECT_NE(e.find("ranks disagree on seed: 6 on ranks 0, 1 but 7 on rank 2"), std::string::npos) << e;
  auto sizes = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> group) {
    BalancedSampler(group->rank() == 0 ? 50 : 51, *group, SamplerOptions(4));
  });
  for (const auto& e : sizes) EXPECT_NE(e.find("ranks disagree on dataset_size"), std::string::npos) << e;
  // Invalid options on one rank only: still an agreement error everywhere, no rank left waiting.
  auto batch = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> group) {
    BalancedSampler(50, *group, SamplerOptions(group->rank() == 1 ? 0 : 4));
  });
  for (const auto& e : batch) EXPECT_NE(e.find("ranks disagree on batch_size"), std::string::npos) << e;
  auto chunks = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> group) {
    BalancedSampler(50, *group,
                    SamplerOptions(4).chunk_sizes(group->rank() == 1 ? std::vector<int64_t>{20, 30}
                                                                     : std::vector<int64_t>{30, 20}));
  });
  for (const auto& e : chunks) EXPECT_NE(e.find("ranks disagree on chunk_sizes"), std::string::npos) << e;
}

// ---- the torch::data adapter ------------------------------------------------------------------

// Example i is the number i, so a batch shows which indices the loader fetched.
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset, int64_t> {
 public:
  explicit IndexDataset(size_t size) : size_(size) {}
  int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  std::optional<size_t> size() const override { return size_; }

 private:
  size_t size_;
};

template <typename Loader>
std::vector<std::vector<int64_t>> one_pass(Loader& loader) {
  std::vector<std::vector<int64_t>> batches;
  for (auto& batch : loader) batches.push_back(batch);
  return batches;
}

std::vector<std::vector<int64_t>> expected_batches(const BalancedSampler& s, int64_t from = 0) {
  std::vector<std::vector<int64_t>> batches;
  for (int64_t t = from; t < s.steps_per_epoch(); ++t) batches.push_back(s.batch(t).indices);
  return batches;
}

TEST(DataSampler, MakeDataLoaderYieldsTheBalancedBatchesAndFollowsSetEpoch) {
  const auto options = SamplerOptions(4).seed(3);
  for (size_t workers : {0, 2}) {
    DataSampler sampler(23, 1, 3, options);
    auto loader =
        torch::data::make_data_loader(IndexDataset(23), sampler, torch::data::DataLoaderOptions(4).workers(workers));
    BalancedSampler reference(23, 1, 3, options);
    const auto epoch0 = one_pass(*loader);
    EXPECT_EQ(epoch0, expected_batches(reference));
    EXPECT_EQ(epoch0.size(), 2u);  // ceil(23 / 12): the same on every rank

    sampler.set_epoch(1);  // on our copy: reaches the loader's
    reference.set_epoch(1);
    const auto epoch1 = one_pass(*loader);
    EXPECT_EQ(epoch1, expected_batches(reference));
    EXPECT_NE(epoch1, epoch0);
    EXPECT_EQ(one_pass(*loader), epoch1) << "without set_epoch a pass repeats the epoch";
  }
}

TEST(DataSampler, PaddingReachesTheLoaderAsFlaggedEntries) {
  // N = 10 on 4 ranks of 3: rank 3's only batch has one real entry and two padding entries.
  DataSampler sampler(10, 3, 4, SamplerOptions(3).seed(5));
  auto loader = torch::data::make_data_loader(IndexDataset(10), sampler, torch::data::DataLoaderOptions(3));
  const auto batches = one_pass(*loader);
  ASSERT_EQ(batches.size(), 1u);
  const Batch b = sampler.batch(sampler.first_step());
  EXPECT_EQ(batches[0], b.indices);
  EXPECT_EQ(b.real, (std::vector<uint8_t>{1, 0, 0}));
  EXPECT_EQ(b.global_real, 10);
}

TEST(DataSampler, RestoreResumesTheLoader) {
  const auto options = SamplerOptions(2).seed(8);
  BalancedSampler reference(31, 0, 2, options);
  reference.set_epoch(4);
  DataSampler sampler(31, 0, 2, options);
  auto loader = torch::data::make_data_loader(IndexDataset(31), sampler, torch::data::DataLoaderOptions(2));
  sampler.restore(reference.state(5));
  sampler.set_epoch(4);  // the restored epoch: keeps the resume point
  EXPECT_EQ(sampler.first_step(), 5);
  EXPECT_EQ(one_pass(*loader), expected_batches(reference, 5));
  EXPECT_EQ(one_pass(*loader), expected_batches(reference, 0)) << "the pass after a resumed one is whole";
  EXPECT_EQ(sampler.first_step(), 0);

  sampler.restore(reference.state(3));
  sampler.set_epoch(5);  // another epoch: the resume point is dropped
  reference.set_epoch(5);
  EXPECT_EQ(one_pass(*loader), expected_batches(reference, 0));
}

TEST(DataSampler, SaveAndLoadThroughArchives) {
  DataSampler a(40, 1, 2, SamplerOptions(3).seed(2));
  a.set_epoch(6);
  a.reset();
  a.next(3);
  a.next(3);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream stream;
  out.save_to(stream);

  torch::serialize::InputArchive in;
  in.load_from(stream);
  DataSampler b(40, 1, 2, SamplerOptions(3).seed(2));
  b.load(in);
  EXPECT_EQ(b.epoch(), 6);
  b.reset();
  BalancedSampler reference(40, 1, 2, SamplerOptions(3).seed(2));
  reference.set_epoch(6);
  for (int64_t t = 2; t < reference.steps_per_epoch(); ++t) {
    auto got = b.next(3);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(std::vector<int64_t>(got->begin(), got->end()), reference.batch(t).indices);
  }
  EXPECT_FALSE(b.next(3).has_value());

  // Another dataset: refused.
  DataSampler c(41, 1, 2, SamplerOptions(3).seed(2));
  torch::serialize::InputArchive again;
  std::stringstream copy(stream.str());
  again.load_from(copy);
  expect_error([&] { c.load(again); }, "dataset of 40 samples, this sampler has 41");
}

TEST(DataSampler, BadUseIsAClearError) {
  DataSampler sampler(20, 0, 2, SamplerOptions(4));
  auto loader = torch::data::make_data_loader(IndexDataset(20), sampler, torch::data::DataLoaderOptions(5));
  expect_error([&] { one_pass(*loader); }, "asked for 5 indices but the sampler's batch_size is 4");
  expect_error([&] { sampler.reset(21); }, "size is fixed at 20, got a new size of 21");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt

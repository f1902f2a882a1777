// One check for the parity tests: every parameter matches the reference within `tolerance`
// (relative), and every rank holds bitwise the same parameters. Every rank calls the same
// collectives whatever it found, so a rank that fails tolerance fails at once, on every rank,
// instead of leaving the others waiting in a collective until the group's timeout.
#pragma once

#include "model.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardopt::testing {

inline ::testing::AssertionResult matches_reference(const std::vector<at::Tensor>& mine,
                                                    const std::vector<at::Tensor>& ref, ProcessGroup& group,
                                                    double tolerance) {
  std::string mismatch;
  for (size_t i = 0; i < ref.size() && mismatch.empty(); ++i) {
    const double d = rel_diff(mine[i], ref[i]);
    if (!(d <= tolerance)) {
      mismatch = "parameter " + std::to_string(i) + " differs from the reference by " + std::to_string(d);
    }
  }
  // How many ranks are out of tolerance, then whether the ranks agree: the same two collectives on
  // every rank.
  at::Tensor failing = at::full({1}, mismatch.empty() ? 0.0 : 1.0, at::kDouble);
  group.allreduce(failing);
  const bool same = same_on_all_ranks(mine, group);
  if (!mismatch.empty()) return ::testing::AssertionFailure() << mismatch;
  if (failing.item<double>() > 0) {
    return ::testing::AssertionFailure() << failing.item<double>() << " other rank(s) differ from the reference";
  }
  if (!same) return ::testing::AssertionFailure() << "ranks diverged";
  return ::testing::AssertionSuccess();
}

}  // namespace shardopt::testing

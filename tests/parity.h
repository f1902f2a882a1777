// One check for the parity tests: every parameter matches the reference within `tolerance`
// (relative), and every rank holds bitwise the same parameters.
#pragma once

#include "model.h"

#include <gtest/gtest.h>

#include <vector>

namespace shardopt::testing {

inline ::testing::AssertionResult matches_reference(const std::vector<at::Tensor>& mine,
                                                    const std::vector<at::Tensor>& ref, ProcessGroup& group,
                                                    double tolerance) {
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = rel_diff(mine[i], ref[i]);
    if (!(d <= tolerance)) return ::testing::AssertionFailure() << "parameter " << i << " differs from the reference by " << d;
  }
  if (!same_on_all_ranks(mine, group)) return ::testing::AssertionFailure() << "ranks diverged";
  return ::testing::AssertionSuccess();
}

}  // namespace shardopt::testing

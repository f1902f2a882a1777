// The median the benchmarks report: the middle of the sorted values (the upper one of an even
// count), 0 for none.
#pragma once

#include <algorithm>
#include <vector>

namespace shardopt::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace shardopt::bench

// The median of timing samples, as every benchmark here reports it (NaN
// for none; the mean of the middle two for an even count).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace hp::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace hp::bench

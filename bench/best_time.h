// The timing rule of the C++ benchmarks: the best of `repeats` runs of a
// function, in seconds. The best, not the mean: on a shared machine every
// disturbance only adds time, so the minimum is the closest to the code's own.
#pragma once

#include <algorithm>
#include <chrono>

namespace bagua_bench {

template <typename Fn>
double best_seconds(Fn&& fn, int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count());
  }
  return best;
}

}  // namespace bagua_bench

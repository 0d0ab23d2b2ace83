// Host loops on the widest vectors the CPU has. The build targets the
// x86-64 baseline (SSE2: 4 floats a register) so one binary runs anywhere;
// with_widest_host_vectors(fn) runs fn compiled again for AVX2 (8 floats)
// where the CPU has it. Inside, every call fn makes is inlined (flatten),
// so the template loops it reaches are compiled for AVX2 too. fn gets the
// width of the vectors it runs on, in bytes, as a std::integral_constant
// (32 with AVX2, else 16), for loops written with GCC vectors of that width.
//
// The bits do not change: AVX2 without FMA does the same IEEE multiplies and
// adds as SSE2, and loops that vectorize keep their sums' order (the 8-lane
// partial sums of low_rank_steps.h). Nothing here enables FMA, which would
// round once where the baseline rounds twice. tests/cpp/test_low_rank_steps.cc
// checks both builds give the same bits.
#pragma once

#include <type_traits>

namespace bagua {

// Whether with_widest_host_vectors runs the AVX2 build: the CPU has it and
// it was not turned off by set_host_avx2 (tests and benchmarks compare
// both). False where the whole library is built for AVX2 (or not for x86):
// there is one build then.
bool host_avx2_enabled();

// Turns the AVX2 loops off (false) or back on where the CPU has them (true).
// For tests and benchmarks; takes effect for calls that start afterwards.
void set_host_avx2(bool enabled);

namespace host_vectors_detail {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
#define BAGUA_HOST_AVX2_BUILD 1
template <typename Fn>
__attribute__((target("avx2"), flatten)) void run_avx2(Fn& fn) {
  fn(std::integral_constant<int, 32>{});
}
#endif
}  // namespace host_vectors_detail

template <typename Fn>
void with_widest_host_vectors(Fn&& fn) {
#if defined(BAGUA_HOST_AVX2_BUILD)
  if (host_avx2_enabled()) {
    host_vectors_detail::run_avx2(fn);
    return;
  }
#endif
  // A build for AVX2 already (-mavx2, -march=native) runs 32-byte vectors.
#if defined(__AVX2__)
  fn(std::integral_constant<int, 32>{});
#else
  fn(std::integral_constant<int, 16>{});
#endif
}

}  // namespace bagua

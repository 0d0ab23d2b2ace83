// The switch of core/host_vectors.h: the CPU is asked once; tests and
// benchmarks may turn the AVX2 loops off and on again.
#include "bagua/core/host_vectors.h"

#include <atomic>

namespace bagua {
namespace {

bool cpu_has_avx2() {
#if defined(BAGUA_HOST_AVX2_BUILD)
  return __builtin_cpu_supports("avx2") != 0;
#else
  return false;
#endif
}

std::atomic<bool>& avx2_wanted() {
  static std::atomic<bool> wanted{true};
  return wanted;
}

}  // namespace

bool host_avx2_enabled() {
  static const bool available = cpu_has_avx2();
  return available && avx2_wanted().load(std::memory_order_relaxed);
}

void set_host_avx2(bool enabled) { avx2_wanted().store(enabled, std::memory_order_relaxed); }

}  // namespace bagua

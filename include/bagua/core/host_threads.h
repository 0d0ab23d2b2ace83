// Host loops on several threads. PyTorch runs a CPU step's matrix products
// on all the threads it is given (torch.get_num_threads()); a pass of ours
// that stays on one thread next to them, such as PowerSGD's factor passes
// over every gradient, becomes the longest part of the step on a host with
// many cores. for_each_range cuts such a pass into contiguous ranges that run
// on a small pool of threads, the calling thread taking one of them.
//
// Callers cut where every output element is still computed by one thread in
// the same order (rows of P, columns of Q = M^T P), so the bits do not depend
// on the thread count; tests/cpp/test_low_rank_steps.cc compares them.
//
// The count is one thread (no pool) until set_host_threads says otherwise:
// PowerSGD sets torch's count when it is set up (torchrun gives every process
// of a multi-process host 1), BAGUA_HOST_THREADS overrides it.
#pragma once

#include <cstdint>
#include <functional>

namespace bagua {

// Threads a host pass may use (1 to 256); 1 unless set.
int host_threads();

// Sets the count for calls that start afterwards. InvalidArgument below 1 or
// above 256.
void set_host_threads(int threads);

// Runs fn(begin, end) over [0, n) cut into at most host_threads() contiguous
// ranges of at least `grain` items each (one range when n < 2 * grain), in no
// particular order, and returns when all are done. The first exception a
// range throws is rethrown here once every range has ended. A call made while
// another thread's call is running, or from inside a range, runs its ranges
// on the calling thread alone.
void for_each_range(std::int64_t n, std::int64_t grain,
                    const std::function<void(std::int64_t begin, std::int64_t end)>& fn);

// Calls of for_each_range so far that were cut into more than one range (for
// tests and benchmarks: whether a pass was cut at all).
std::int64_t host_ranges_cut();

}  // namespace bagua

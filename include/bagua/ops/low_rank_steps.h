// The matrix steps of low-rank gradient compression (PowerSGD,
// ops/powersgd.h) on a Compute: host loops for CPU buckets, the kernels of
// kernels/low_rank_kernels.cu for CUDA buckets (Compute::run_custom picks).
//
// A gradient is an n x m row-major matrix M; its factors are P (n x r) and
// Q (m x r), row-major, of M's dtype; sums run in compute_type_t (float for
// 16-bit types). The factors are thin (r is 1 to a few), so every step is
// one pass over M at memory speed: a general GEMM library gains nothing here,
// and PyTorch's CPU mm of a 2048 x 2048 matrix by a 2048 x 2 one took
// 13-22 ms where this pass takes about 2 (docs/algorithms.md, PowerSGD).
// The host passes run inside with_widest_host_vectors (core/host_vectors.h):
// compiled for AVX2 where the CPU has it, with the same bits; the deferred
// project, the project back and the reconstruction cut their rows (columns
// for the project back) over the host threads (core/host_threads.h), again
// with the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bagua/core/elementwise.h"
#include "bagua/core/errors.h"
#include "bagua/core/host_threads.h"
#include "bagua/core/host_vectors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/runtime/compute.h"

namespace bagua {

// The shape of one compressed gradient: rows x cols, factors of `rank` columns.
struct LowRankShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t rank = 1;
};

// The kernels (CUDA buffers of one floating dtype, on `stream`; without CUDA
// in the build they throw InvalidArgument, lib/ops/op_kernels_absent.cc).
// `error` may have no elements (no error feedback).
void cuda_low_rank_project(LowRankShape s, const TensorView& m, const TensorView& error,
                           const TensorView& q, const TensorView& p, void* stream);
void cuda_low_rank_project_back(LowRankShape s, const TensorView& m, const TensorView& p,
                                const TensorView& accumulator, const TensorView& q, void* stream);
void cuda_low_rank_reconstruct(LowRankShape s, const TensorView& m, const TensorView& error,
                               const TensorView& p, const TensorView& q, void* stream);
void cuda_orthogonalize_columns(LowRankShape s, const TensorView& p, double epsilon, void* stream);

namespace low_rank_detail {

// Calls fn(T{}) for a floating dtype; InvalidArgument naming `what` otherwise.
template <typename Fn>
void dispatch_floating(DType dtype, const char* what, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      fn(tag);
    } else {
      throw InvalidArgument(
          fmt::format("{} needs a floating point tensor, got {}", what, to_string(dtype)));
    }
  });
}

// Q (cols x rank) transposed into compute type: column k of Q is
// qt[k * cols .. (k + 1) * cols), contiguous for the row loops.
template <typename T>
std::vector<compute_type_t<T>> transposed(const T* q, std::int64_t cols, std::int64_t rank) {
  std::vector<compute_type_t<T>> qt(static_cast<std::size_t>(cols * rank));
  for (std::int64_t j = 0; j < cols; ++j) {
    for (std::int64_t k = 0; k < rank; ++k) qt[k * cols + j] = load(q[j * rank + k]);
  }
  return qt;
}

// sum of row[j] * column[j], in 8 independent partial sums so the compiler
// vectorizes the loop without reassociating a single sum.
template <typename T, typename C>
C dot(const T* row, const C* column, std::int64_t n) {
  constexpr int kLanes = 8;
  C lanes[kLanes] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += load(row[j + l]) * column[j + l];
  }
  C total = 0;
  for (; j < n; ++j) total += load(row[j]) * column[j];
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// Row i of P Q^T into `approx` (cols values): `factors` is P's row i, `qt`
// Q transposed (see transposed). Every step that forms the approximation
// forms it this way, so they agree to the bit.
template <typename T, typename C>
void approximate_row(LowRankShape s, const T* factors, const C* __restrict qt,
                     C* __restrict approx) {
  const std::int64_t cols = s.cols;
  std::fill(approx, approx + cols, C{0});
  for (std::int64_t k = 0; k < s.rank; ++k) {
    const C weight = load(factors[k]);
    const C* __restrict column = qt + k * cols;
    for (std::int64_t j = 0; j < cols; ++j) approx[j] += weight * column[j];
  }
}

// Calls fn(std::integral_constant<int, r>{}) for the ranks the row loops
// are compiled for (1 to 4: the per-element sum over the rank then stays in
// registers, one pass over the row); false for other ranks, which go
// through a row buffer. At rank 4 on the issue 43 MLP the three passes took
// 25 ms a step that way, against 14 at rank 2 (docs/benchmarks.md).
template <typename Fn>
bool with_compiled_rank(std::int64_t rank, Fn&& fn) {
  switch (rank) {
    case 1: fn(std::integral_constant<int, 1>{}); return true;
    case 2: fn(std::integral_constant<int, 2>{}); return true;
    case 3: fn(std::integral_constant<int, 3>{}); return true;
    case 4: fn(std::integral_constant<int, 4>{}); return true;
    default: return false;
  }
}

// row = g + store(row - approximation), the approximation of P's row
// `factors` formed as approximate_row does (the same sums in the same
// order). Ranks 1 to 4 in one pass with the rank known to the compiler;
// others through the `approx` buffer.
template <int kRank, typename T, typename C>
void add_deferred_error_row_of_rank(std::int64_t cols, const T* __restrict g, const T* factors,
                                    const C* __restrict qt, T* __restrict row) {
  C weight[kRank];
  for (int k = 0; k < kRank; ++k) weight[k] = load(factors[k]);
  for (std::int64_t j = 0; j < cols; ++j) {
    C a = 0;
    for (int k = 0; k < kRank; ++k) a += weight[k] * qt[k * cols + j];
    const T error = store<T>(load(row[j]) - a);
    row[j] = store<T>(load(g[j]) + load(error));
  }
}

template <typename T, typename C>
void add_deferred_error_row(LowRankShape s, const T* g, const T* factors, const C* qt, C* approx,
                            T* row) {
  if (with_compiled_rank(s.rank, [&](auto r) {
        add_deferred_error_row_of_rank<decltype(r)::value>(s.cols, g, factors, qt, row);
      }))
    return;
  approximate_row(s, factors, qt, approx);
  for (std::int64_t j = 0; j < s.cols; ++j) {
    const T error = store<T>(load(row[j]) - approx[j]);
    row[j] = store<T>(load(g[j]) + load(error));
  }
}

// add_deferred_error_row_of_rank, then dots into `out`, in one pass, for
// float and double rows (T == C): each block of 8 new elements of the row
// goes into the kRank sums while it is still in registers, and the kRank
// sums run side by side instead of one after the other (one sum's 8 lanes
// fill one AVX2 register, whose adds would wait on each other). The blocks
// are GCC vectors of kVectorBytes (the width with_widest_host_vectors runs
// at), as the compiler did not vectorize a lanes[kRank][8] array. Every lane
// takes dot's and add_deferred_error_row_of_rank's operations in their
// order (8 lanes per k over the whole blocks, the tail in order from 0, then
// the lanes in order), so the bits are those of the two passes.
template <int kRank, int kVectorBytes, typename C>
void project_deferred_row_of_rank(std::int64_t cols, const C* __restrict g, const C* factors,
                                  const C* __restrict qt_prev, const C* __restrict qt,
                                  C* __restrict row, C* out) {
  constexpr int kLanes = 8;
  constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(C));
  constexpr int kParts = kLanes / kPerVector;  // vectors per block of 8
  static_assert(kPerVector >= 1 && kLanes % kPerVector == 0);
  typedef C Vector __attribute__((vector_size(kVectorBytes)));
  const auto load_vector = [](Vector& v, const C* x) { std::memcpy(&v, x, sizeof v); };
  C weight[kRank];
  for (int k = 0; k < kRank; ++k) weight[k] = factors[k];
  Vector lanes[kRank][kParts] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= cols; j += kLanes) {
    for (int part = 0; part < kParts; ++part) {
      const std::int64_t at = j + std::int64_t{part} * kPerVector;
      Vector a = {};
      Vector q;
      for (int k = 0; k < kRank; ++k) {
        load_vector(q, qt_prev + k * cols + at);
        a += weight[k] * q;
      }
      Vector x, gradient;
      load_vector(x, row + at);
      load_vector(gradient, g + at);
      x = gradient + (x - a);
      std::memcpy(row + at, &x, sizeof x);
      for (int k = 0; k < kRank; ++k) {
        load_vector(q, qt + k * cols + at);
        lanes[k][part] += x * q;
      }
    }
  }
  C total[kRank] = {};
  for (; j < cols; ++j) {
    C a = 0;
    for (int k = 0; k < kRank; ++k) a += weight[k] * qt_prev[k * cols + j];
    row[j] = g[j] + (row[j] - a);
    for (int k = 0; k < kRank; ++k) total[k] += row[j] * qt[k * cols + j];
  }
  for (int k = 0; k < kRank; ++k) {
    for (int l = 0; l < kLanes; ++l) total[k] += lanes[k][l / kPerVector][l % kPerVector];
    out[k] = total[k];
  }
}

// row = store(approximation) of P's row `factors`, as approximate_row forms
// it; ranks 1 to 4 in one pass, as add_deferred_error_row.
template <int kRank, typename T, typename C>
void write_approximation_row_of_rank(std::int64_t cols, const T* factors, const C* __restrict qt,
                                     T* __restrict row) {
  C weight[kRank];
  for (int k = 0; k < kRank; ++k) weight[k] = load(factors[k]);
  for (std::int64_t j = 0; j < cols; ++j) {
    C a = 0;
    for (int k = 0; k < kRank; ++k) a += weight[k] * qt[k * cols + j];
    row[j] = store<T>(a);
  }
}

template <typename T, typename C>
void write_approximation_row(LowRankShape s, const T* factors, const C* qt, C* approx, T* row) {
  if (with_compiled_rank(s.rank, [&](auto r) {
        write_approximation_row_of_rank<decltype(r)::value>(s.cols, factors, qt, row);
      }))
    return;
  approximate_row(s, factors, qt, approx);
  for (std::int64_t j = 0; j < s.cols; ++j) row[j] = store<T>(approx[j]);
}

inline void require_host(const TensorView& v, const char* what) {
  BAGUA_CHECK_ARG(v.device.type == DeviceType::kCPU, "{} runs on host memory, got {}", what,
                  v.describe());
}

// out[k] = dot(row, qt + k * cols, cols) for every k < rank, one k after
// the other. (A lane array per k was not vectorized by the compiler;
// project_deferred_row_of_rank runs all k at once with GCC vectors.)
template <typename T, typename C>
void dots(LowRankShape s, const T* row, const C* qt, T* out) {
  for (std::int64_t k = 0; k < s.rank; ++k) out[k] = store<T>(dot(row, qt + k * s.cols, s.cols));
}

// sums[k * cols + j] += P[i, k] * M[i, j] for every k, the kBlock
// consecutive rows i from `rows` (`factors`: the first one's row of P) and
// the columns j in [first, last), the rank known to the compiler. Each sum is
// loaded and stored once per block instead of once per row and still takes
// the rows' terms one by one in row order, so the bits are those of the
// row-by-row loop, whatever columns a call takes. (Row by row, Q = M^T P ran
// at 4-5 GB/s of M here, bound by those loads and stores of the sums.)
template <int kRank, int kBlock, typename T, typename C>
void accumulate_rows_of_rank(const T* __restrict rows, const T* factors, std::int64_t cols,
                             std::int64_t first, std::int64_t last, C* __restrict sums) {
  C weight[kBlock][kRank];
  for (int b = 0; b < kBlock; ++b) {
    for (int k = 0; k < kRank; ++k) weight[b][k] = load(factors[b * kRank + k]);
  }
  for (std::int64_t j = first; j < last; ++j) {
    C x[kBlock];
    for (int b = 0; b < kBlock; ++b) x[b] = load(rows[b * cols + j]);
    for (int k = 0; k < kRank; ++k) {
      C sum = sums[k * cols + j];
      for (int b = 0; b < kBlock; ++b) sum += weight[b][k] * x[b];
      sums[k * cols + j] = sum;
    }
  }
}

// sums += M^T P over all of M's rows (`m`: rows x cols, `factors`: P), for
// the columns in [first, last): every column's sums run over the rows in
// order, so column ranges may run on different threads with the same bits.
template <typename T, typename C>
void accumulate_rows(LowRankShape s, const T* m, const T* factors, std::int64_t first,
                     std::int64_t last, C* sums) {
  if (with_compiled_rank(s.rank, [&](auto r) {
        constexpr int kRank = decltype(r)::value;
        constexpr int kBlock = 4;
        std::int64_t i = 0;
        for (; i + kBlock <= s.rows; i += kBlock) {
          accumulate_rows_of_rank<kRank, kBlock>(m + i * s.cols, factors + i * kRank, s.cols, first,
                                                 last, sums);
        }
        for (; i < s.rows; ++i) {
          accumulate_rows_of_rank<kRank, 1>(m + i * s.cols, factors + i * kRank, s.cols, first,
                                            last, sums);
        }
      }))
    return;
  for (std::int64_t i = 0; i < s.rows; ++i) {
    const T* row = m + i * s.cols;
    for (std::int64_t k = 0; k < s.rank; ++k) {
      const C weight = load(factors[i * s.rank + k]);
      C* column = sums + k * s.cols;
      for (std::int64_t j = first; j < last; ++j) column[j] += weight * load(row[j]);
    }
  }
}

// Rows (or columns) per range of for_each_range (core/host_threads.h) for a
// pass over `per_item` elements each: ranges of at least 64 Ki elements, so
// a small matrix stays on one thread.
inline std::int64_t grain_for(std::int64_t per_item) {
  constexpr std::int64_t kElementsPerRange = std::int64_t{1} << 16;
  return std::max<std::int64_t>(1, kElementsPerRange / std::max<std::int64_t>(1, per_item));
}

}  // namespace low_rank_detail

// M += error (when `error` has elements), then P = M Q.
inline void low_rank_project(Compute& c, LowRankShape s, const TensorView& m,
                             const TensorView& error, const TensorView& q, const TensorView& p) {
  const auto on_host = [&] {
    with_widest_host_vectors([&](auto /*vector_bytes*/) {
      low_rank_detail::dispatch_floating(m.dtype, "low_rank_project", [&](auto tag) {
        using T = decltype(tag);
        const auto qt = low_rank_detail::transposed(q.data_as<T>(), s.cols, s.rank);
        T* out = p.data_as<T>();
        for (std::int64_t i = 0; i < s.rows; ++i) {
          T* row = m.data_as<T>() + i * s.cols;
          if (error.numel > 0) {
            const T* e = error.data_as<T>() + i * s.cols;
            for (std::int64_t j = 0; j < s.cols; ++j) row[j] = store<T>(load(row[j]) + load(e[j]));
          }
          low_rank_detail::dots(s, row, qt.data(), out + i * s.rank);
        }
      });
    });
  };
  c.run_custom(on_host, [&](void* stream) { cuda_low_rank_project(s, m, error, q, p, stream); });
}

// Q = M^T P.
inline void low_rank_project_back(Compute& c, LowRankShape s, const TensorView& m,
                                  const TensorView& p, const TensorView& q) {
  if (c.device().type == DeviceType::kCUDA) {
    // The kernel sums row slices with atomics into a compute-type buffer.
    const DType acc = m.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    const auto block = c.scratch(static_cast<std::size_t>(s.cols * s.rank) * dtype_size(acc));
    const TensorView accumulator = c.view(block, s.cols * s.rank, acc);
    c.zero(accumulator.data, accumulator.nbytes());
    c.run_custom(
        [] {}, [&](void* stream) { cuda_low_rank_project_back(s, m, p, accumulator, q, stream); });
    return;
  }
  // Column ranges on the host threads: each column's sums over the rows stay
  // on one thread, in row order.
  low_rank_detail::dispatch_floating(m.dtype, "low_rank_project_back", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_type_t<T>;
    std::vector<C> sums(static_cast<std::size_t>(s.cols * s.rank), C{0});
    const T* factors = p.data_as<T>();
    T* out = q.data_as<T>();
    for_each_range(
        s.cols, low_rank_detail::grain_for(s.rows), [&](std::int64_t first, std::int64_t last) {
          with_widest_host_vectors([&](auto /*vector_bytes*/) {
            low_rank_detail::accumulate_rows(s, m.data_as<T>(), factors, first, last, sums.data());
            for (std::int64_t j = first; j < last; ++j) {
              for (std::int64_t k = 0; k < s.rank; ++k)
                out[j * s.rank + k] = store<T>(sums[k * s.cols + j]);
            }
          });
        });
  });
}

// A = P Q^T; error = M - A (when `error` has elements); M = A.
inline void low_rank_reconstruct(Compute& c, LowRankShape s, const TensorView& m,
                                 const TensorView& error, const TensorView& p,
                                 const TensorView& q) {
  const auto on_host = [&] {
    with_widest_host_vectors([&](auto /*vector_bytes*/) {
      low_rank_detail::dispatch_floating(m.dtype, "low_rank_reconstruct", [&](auto tag) {
        using T = decltype(tag);
        using C = compute_type_t<T>;
        const auto qt = low_rank_detail::transposed(q.data_as<T>(), s.cols, s.rank);
        std::vector<C> approx(static_cast<std::size_t>(s.cols));
        const T* factors = p.data_as<T>();
        for (std::int64_t i = 0; i < s.rows; ++i) {
          low_rank_detail::approximate_row(s, factors + i * s.rank, qt.data(), approx.data());
          T* row = m.data_as<T>() + i * s.cols;
          if (error.numel > 0) {
            T* e = error.data_as<T>() + i * s.cols;
            for (std::int64_t j = 0; j < s.cols; ++j) e[j] = store<T>(load(row[j]) - approx[j]);
          }
          for (std::int64_t j = 0; j < s.cols; ++j) row[j] = store<T>(approx[j]);
        }
      });
    });
  };
  c.run_custom(on_host,
               [&](void* stream) { cuda_low_rank_reconstruct(s, m, error, p, q, stream); });
}

// Gram-Schmidt on the columns of P (rows x rank), in place: each column is
// divided by its norm plus `epsilon`, then removed from the later ones. A
// column of zeros stays zero instead of turning into NaN.
inline void orthogonalize_columns(Compute& c, LowRankShape s, const TensorView& p, double epsilon) {
  const auto on_host = [&] {
    low_rank_detail::dispatch_floating(p.dtype, "orthogonalize_columns", [&](auto tag) {
      using T = decltype(tag);
      using C = compute_type_t<T>;
      T* x = p.data_as<T>();
      const std::int64_t r = s.rank;
      for (std::int64_t i = 0; i < r; ++i) {
        C squares = 0;
        for (std::int64_t row = 0; row < s.rows; ++row)
          squares += load(x[row * r + i]) * load(x[row * r + i]);
        const C norm = std::sqrt(squares);
        if (norm > 0) {
          const C divisor = norm + static_cast<C>(epsilon);
          for (std::int64_t row = 0; row < s.rows; ++row)
            x[row * r + i] = store<T>(load(x[row * r + i]) / divisor);
        }
        for (std::int64_t later = i + 1; later < r; ++later) {
          C overlap = 0;
          for (std::int64_t row = 0; row < s.rows; ++row)
            overlap += load(x[row * r + i]) * load(x[row * r + later]);
          for (std::int64_t row = 0; row < s.rows; ++row) {
            x[row * r + later] =
                store<T>(load(x[row * r + later]) - overlap * load(x[row * r + i]));
          }
        }
      }
    });
  };
  c.run_custom(on_host, [&](void* stream) { cuda_orthogonalize_columns(s, p, epsilon, stream); });
}

// Deferred error feedback (host memory). Instead of the error
// E = M - P Q^T, the op keeps M itself (`base`) and the factors that
// approximated it (`p_prev`, `q_prev`), and forms E row by row when the next
// step adds it to the gradient. The error is then never written and the
// reconstruction only writes the average: per step 3 passes of reads and 2
// of writes over the gradient's size instead of 4 and 3. E is rounded to T
// as the materialized error is, so both schemes give the same bits. With
// p_prev all zeros (the start, or a loaded checkpoint's error put in
// `base`), E is `base` exactly.

// base = grad + (base - p_prev q_prev^T), then P = base Q.
inline void low_rank_project_deferred(LowRankShape s, const TensorView& grad,
                                      const TensorView& base, const TensorView& p_prev,
                                      const TensorView& q_prev, const TensorView& q,
                                      const TensorView& p) {
  low_rank_detail::require_host(grad, "low_rank_project_deferred");
  low_rank_detail::dispatch_floating(grad.dtype, "low_rank_project_deferred", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_type_t<T>;
    const auto qt = low_rank_detail::transposed(q.data_as<T>(), s.cols, s.rank);
    const auto qt_prev = low_rank_detail::transposed(q_prev.data_as<T>(), s.cols, s.rank);
    T* out = p.data_as<T>();
    // Row ranges on the host threads: a row's elements and dot products are
    // one thread's, in their order.
    for_each_range(
        s.rows, low_rank_detail::grain_for(s.cols), [&](std::int64_t first, std::int64_t last) {
          with_widest_host_vectors([&](auto vector_bytes) {
            std::vector<C> approx(static_cast<std::size_t>(s.cols));
            for (std::int64_t i = first; i < last; ++i) {
              const T* g = grad.data_as<T>() + i * s.cols;
              T* row = base.data_as<T>() + i * s.cols;
              const T* factors = p_prev.data_as<T>() + i * s.rank;
              if constexpr (std::is_same_v<T, C>) {
                if (low_rank_detail::with_compiled_rank(s.rank, [&](auto r) {
                      low_rank_detail::project_deferred_row_of_rank<decltype(r)::value,
                                                                    decltype(vector_bytes)::value>(
                          s.cols, g, factors, qt_prev.data(), qt.data(), row, out + i * s.rank);
                    }))
                  continue;
              }
              low_rank_detail::add_deferred_error_row(s, g, factors, qt_prev.data(), approx.data(),
                                                      row);
              low_rank_detail::dots(s, row, qt.data(), out + i * s.rank);
            }
          });
        });
  });
}

// grad = P Q^T (the average), the only pass of the reconstruction.
inline void low_rank_write_approximation(LowRankShape s, const TensorView& grad,
                                         const TensorView& p, const TensorView& q) {
  low_rank_detail::require_host(grad, "low_rank_write_approximation");
  low_rank_detail::dispatch_floating(grad.dtype, "low_rank_write_approximation", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_type_t<T>;
    const auto qt = low_rank_detail::transposed(q.data_as<T>(), s.cols, s.rank);
    for_each_range(s.rows, low_rank_detail::grain_for(s.cols),
                   [&](std::int64_t first, std::int64_t last) {
                     with_widest_host_vectors([&](auto /*vector_bytes*/) {
                       std::vector<C> approx(static_cast<std::size_t>(s.cols));
                       for (std::int64_t i = first; i < last; ++i) {
                         low_rank_detail::write_approximation_row(s, p.data_as<T>() + i * s.rank,
                                                                  qt.data(), approx.data(),
                                                                  grad.data_as<T>() + i * s.cols);
                       }
                     });
                   });
  });
}

// error = base - p_prev q_prev^T: the error the deferred scheme stands for
// (for checkpoints, which keep the materialized error).
inline void low_rank_deferred_error(LowRankShape s, const TensorView& base,
                                    const TensorView& p_prev, const TensorView& q_prev,
                                    const TensorView& error) {
  low_rank_detail::require_host(base, "low_rank_deferred_error");
  low_rank_detail::dispatch_floating(base.dtype, "low_rank_deferred_error", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_type_t<T>;
    const auto qt_prev = low_rank_detail::transposed(q_prev.data_as<T>(), s.cols, s.rank);
    std::vector<C> approx(static_cast<std::size_t>(s.cols));
    for (std::int64_t i = 0; i < s.rows; ++i) {
      low_rank_detail::approximate_row(s, p_prev.data_as<T>() + i * s.rank, qt_prev.data(),
                                       approx.data());
      const T* row = base.data_as<T>() + i * s.cols;
      T* e = error.data_as<T>() + i * s.cols;
      for (std::int64_t j = 0; j < s.cols; ++j) e[j] = store<T>(load(row[j]) - approx[j]);
    }
  });
}

}  // namespace bagua

// The matrix steps of low-rank compression (bagua/ops/low_rank_steps.h) as
// kernels; the host loops there apply the same formulas. M is rows x cols,
// P rows x rank, Q cols x rank, all row-major in one floating dtype; sums run
// in compute_type_t (float for 16-bit types):
// - project: one block per row, M += error, then P[i] = M[i] Q, kTile
//   columns of Q per pass over the row, block reductions in shared memory;
// - project_back: thread j owns column j of M over a slice of rows and adds
//   its slice's M^T P into a compute-type accumulator with atomics; a second
//   kernel stores the accumulator into Q;
// - reconstruct: element-wise, A = P Q^T, error = M - A, M = A;
// - orthogonalize: Gram-Schmidt in one block (P is thin and short).
#include <cuda_runtime.h>

#include "bagua/core/dtype.h"
#include "bagua/core/element_math.h"
#include "launch_helpers.cuh"
#include "launchers.h"

namespace bagua::kernels {
namespace {

constexpr int kTile = 4;                 // columns of Q per pass over a row
constexpr std::int64_t kSliceRows = 64;  // rows per block in project_back

// The block's sum of `value` (every thread gets it). Uses shared[0..blockDim).
template <typename C>
__device__ C block_sum(C value, C* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  const C total = shared[0];
  __syncthreads();
  return total;
}

template <typename T>
__global__ void project_kernel(T* m, const T* error, const T* q, T* p, std::int64_t rows,
                               std::int64_t cols, std::int64_t rank) {
  using C = compute_type_t<T>;
  __shared__ C shared[kThreads];
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    T* row = m + i * cols;
    for (std::int64_t k0 = 0; k0 < rank; k0 += kTile) {
      C sums[kTile] = {};
      for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        // the first pass adds the error; later passes re-read this thread's own writes
        if (k0 == 0 && error != nullptr)
          row[j] = store<T>(load(row[j]) + load(error[i * cols + j]));
        const C v = load(row[j]);
        for (int t = 0; t < kTile && k0 + t < rank; ++t) sums[t] += v * load(q[j * rank + k0 + t]);
      }
      for (int t = 0; t < kTile && k0 + t < rank; ++t) {
        const C total = block_sum(sums[t], shared);
        if (threadIdx.x == 0) p[i * rank + k0 + t] = store<T>(total);
      }
    }
  }
}

template <typename T>
__global__ void project_back_kernel(const T* m, const T* p, compute_type_t<T>* accumulator,
                                    std::int64_t rows, std::int64_t cols, std::int64_t rank) {
  using C = compute_type_t<T>;
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  for (std::int64_t begin = blockIdx.y * kSliceRows; begin < rows;
       begin += static_cast<std::int64_t>(gridDim.y) * kSliceRows) {
    const std::int64_t end = begin + kSliceRows < rows ? begin + kSliceRows : rows;
    for (std::int64_t k0 = 0; k0 < rank; k0 += kTile) {
      C sums[kTile] = {};
      for (std::int64_t i = begin; i < end; ++i) {
        const C v = load(m[i * cols + j]);
        for (int t = 0; t < kTile && k0 + t < rank; ++t) sums[t] += v * load(p[i * rank + k0 + t]);
      }
      for (int t = 0; t < kTile && k0 + t < rank; ++t)
        atomicAdd(&accumulator[j * rank + k0 + t], sums[t]);
    }
  }
}

template <typename T>
__global__ void store_kernel(const compute_type_t<T>* from, T* to, std::int64_t count) {
  for_each_index(count, [&](std::int64_t i) { to[i] = store<T>(from[i]); });
}

template <typename T>
__global__ void reconstruct_kernel(T* m, T* error, const T* p, const T* q, std::int64_t rows,
                                   std::int64_t cols, std::int64_t rank) {
  using C = compute_type_t<T>;
  for_each_index(rows * cols, [&](std::int64_t index) {
    const std::int64_t i = index / cols;
    const std::int64_t j = index % cols;
    C approx = 0;
    for (std::int64_t k = 0; k < rank; ++k) approx += load(p[i * rank + k]) * load(q[j * rank + k]);
    if (error != nullptr) error[index] = store<T>(load(m[index]) - approx);
    m[index] = store<T>(approx);
  });
}

template <typename T>
__global__ void orthogonalize_kernel(T* x, std::int64_t rows, std::int64_t rank, double epsilon) {
  using C = compute_type_t<T>;
  __shared__ C shared[kThreads];
  for (std::int64_t i = 0; i < rank; ++i) {
    C squares = 0;
    for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
      const C v = load(x[r * rank + i]);
      squares += v * v;
    }
    const C norm = sqrt(block_sum(squares, shared));
    if (norm > 0) {
      const C divisor = norm + static_cast<C>(epsilon);
      for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        x[r * rank + i] = store<T>(load(x[r * rank + i]) / divisor);
      }
    }
    __syncthreads();
    for (std::int64_t later = i + 1; later < rank; ++later) {
      C overlap = 0;
      for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        overlap += load(x[r * rank + i]) * load(x[r * rank + later]);
      }
      const C total = block_sum(overlap, shared);
      for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        x[r * rank + later] = store<T>(load(x[r * rank + later]) - total * load(x[r * rank + i]));
      }
      __syncthreads();
    }
  }
}

// launch(T{}) for a floating dtype, then the launch status.
template <typename Launch>
const char* launch_for_floating(int dtype, const char* what, Launch&& launch) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: launch(float{}); break;
    case DType::kFloat64: launch(double{}); break;
    case DType::kFloat16: launch(Half{}); break;
    case DType::kBFloat16: launch(BFloat16{}); break;
    default: return what;
  }
  return last_launch_error();
}

unsigned grid_for(std::int64_t count) {
  return count < 65535 ? static_cast<unsigned>(count) : 65535u;
}

}  // namespace

const char* low_rank_project(void* m, const void* error, const void* q, void* p, std::int64_t rows,
                             std::int64_t cols, std::int64_t rank, int dtype,
                             void* stream) noexcept {
  if (rows == 0) return nullptr;
  return launch_for_floating(dtype, "low_rank_project: not a floating dtype", [&](auto tag) {
    using T = decltype(tag);
    project_kernel<T><<<grid_for(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(m), static_cast<const T*>(error), static_cast<const T*>(q),
        static_cast<T*>(p), rows, cols, rank);
  });
}

const char* low_rank_project_back(const void* m, const void* p, void* accumulator, void* q,
                                  std::int64_t rows, std::int64_t cols, std::int64_t rank,
                                  int dtype, void* stream) noexcept {
  if (cols == 0) return nullptr;
  return launch_for_floating(dtype, "low_rank_project_back: not a floating dtype", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_type_t<T>;
    const auto s = static_cast<cudaStream_t>(stream);
    const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
                    grid_for((rows + kSliceRows - 1) / kSliceRows));
    if (rows > 0) {
      project_back_kernel<T>
          <<<grid, kThreads, 0, s>>>(static_cast<const T*>(m), static_cast<const T*>(p),
                                     static_cast<C*>(accumulator), rows, cols, rank);
    }
    store_kernel<T><<<blocks_for(cols * rank), kThreads, 0, s>>>(static_cast<const C*>(accumulator),
                                                                 static_cast<T*>(q), cols * rank);
  });
}

const char* low_rank_reconstruct(void* m, void* error, const void* p, const void* q,
                                 std::int64_t rows, std::int64_t cols, std::int64_t rank, int dtype,
                                 void* stream) noexcept {
  if (rows * cols == 0) return nullptr;
  return launch_for_floating(dtype, "low_rank_reconstruct: not a floating dtype", [&](auto tag) {
    using T = decltype(tag);
    reconstruct_kernel<T>
        <<<blocks_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<T*>(m), static_cast<T*>(error), static_cast<const T*>(p),
            static_cast<const T*>(q), rows, cols, rank);
  });
}

const char* orthogonalize_columns(void* p, std::int64_t rows, std::int64_t rank, double epsilon,
                                  int dtype, void* stream) noexcept {
  if (rows == 0) return nullptr;
  return launch_for_floating(dtype, "orthogonalize_columns: not a floating dtype", [&](auto tag) {
    using T = decltype(tag);
    orthogonalize_kernel<T><<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(p), rows, rank, epsilon);
  });
}

}  // namespace bagua::kernels

// Host entry points of the CUDA kernels. Compiled by nvcc, called from the
// C++ runtime (lib/runtime/cuda_compute.cc for Compute's generic kernels,
// lib/ops/op_kernels.cc for the ops' own), which turns their status into
// exceptions: this header stays free of C++ library dependencies so both
// compilers read it the same way.
//
// Every launcher enqueues on `stream` (a cudaStream_t; nullptr is the legacy
// default stream), takes `dtype` as a bagua::DType value, and returns
// nullptr on success, else the CUDA error string (or what was wrong).
#pragma once

#include <cstdint>

namespace bagua::kernels {

// ---- Compute's generic kernels (elementwise_kernels.cu, reduce_kernels.cu,
// minmax_uint8_kernels.cu) ----------------------------------------------------

// x[0:numel] /= divisor.
const char* divide_inplace(void* x, std::int64_t numel, int dtype, std::int64_t divisor,
                           void* stream) noexcept;

// MinMaxUInt8 over consecutive chunks of `chunk_elements` (the last may be
// shorter): `out` receives, per chunk, [min f32][max f32][codes]. The codes
// equal the CPU path's (bagua/compression/minmax_uint8.h) bit for bit.
const char* minmax_uint8_compress(const void* x, std::int64_t numel, int dtype,
                                  std::int64_t chunk_elements, void* out, void* stream) noexcept;

// Decodes what minmax_uint8_compress wrote into `out` (adding when
// `accumulate`).
const char* minmax_uint8_decompress(const void* in, std::int64_t numel, int dtype,
                                    std::int64_t chunk_elements, void* out, bool accumulate,
                                    void* stream) noexcept;

// out[i] = sum over j < chunk_count of chunks[j * chunk_elements + i], divided
// by chunk_count when `mean` (the local step of the scatter-reduce).
const char* chunked_reduce(const void* chunks, std::int64_t chunk_count,
                           std::int64_t chunk_elements, int dtype, bool mean, void* out,
                           void* stream) noexcept;

// out[i] = a[i] (op) b[i], `op` a bagua::ReduceOp value (kAvg adds: the
// caller divides once every operand is in); `out` may alias `a` or `b`. The
// pairwise step of a ring reduction (the NCCL P-Reduce's).
const char* pairwise_reduce(void* out, const void* a, const void* b, std::int64_t numel, int dtype,
                            int op, void* stream) noexcept;

// y[i] = a * x[i] + b * y[i] for floating dtypes (error feedback residuals).
const char* axpby(double a, const void* x, double b, void* y, std::int64_t numel, int dtype,
                  void* stream) noexcept;

// to[i] = from[i] converted between any two dtypes.
const char* convert(const void* from, int from_dtype, void* to, int to_dtype, std::int64_t numel,
                    void* stream) noexcept;

// ---- The comm ops' own kernels (op_kernels.cu, formulas of
// bagua/ops/op_math.h) -------------------------------------------------------

// w[i] = async_average_update(w[i], sum[i], snapshot[i], ranks).
const char* async_average_update(void* w, const void* sum, const void* snapshot, std::int64_t numel,
                                 std::int64_t ranks, int dtype, void* stream) noexcept;

// out[0] += sum over i of (snapshot[i] - sum[i] / ranks)^2 and out[1] += sum
// over i of (sum[i] / ranks)^2, in double (`out`: two doubles on the device,
// zeroed by the caller).
const char* async_average_drift(const void* sum, const void* snapshot, std::int64_t numel,
                                std::int64_t ranks, int dtype, double* out, void* stream) noexcept;

// diff[i] (fp32) = low_precision_ring_diff(x[i], w[i], l[i], r[i]).
const char* ring_diff(const void* x, const void* w, const void* l, const void* r, float* diff,
                      std::int64_t numel, int dtype, void* stream) noexcept;

// ---- Low-rank compression (low_rank_kernels.cu, bagua/ops/low_rank_steps.h):
// M rows x cols, P rows x rank, Q cols x rank, row-major, floating dtypes ----

// M += error (error may be null), then P = M Q.
const char* low_rank_project(void* m, const void* error, const void* q, void* p, std::int64_t rows,
                             std::int64_t cols, std::int64_t rank, int dtype,
                             void* stream) noexcept;

// Q = M^T P, summed in `accumulator` (cols x rank of float, double for
// float64, zeroed by the caller).
const char* low_rank_project_back(const void* m, const void* p, void* accumulator, void* q,
                                  std::int64_t rows, std::int64_t cols, std::int64_t rank,
                                  int dtype, void* stream) noexcept;

// A = P Q^T, error = M - A (error may be null), M = A.
const char* low_rank_reconstruct(void* m, void* error, const void* p, const void* q,
                                 std::int64_t rows, std::int64_t cols, std::int64_t rank, int dtype,
                                 void* stream) noexcept;

// Gram-Schmidt on P's columns, in place.
const char* orthogonalize_columns(void* p, std::int64_t rows, std::int64_t rank, double epsilon,
                                  int dtype, void* stream) noexcept;

}  // namespace bagua::kernels

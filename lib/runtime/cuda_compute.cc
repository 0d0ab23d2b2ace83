// CudaCompute and the kernel wrappers of bagua/runtime/cuda_compute.h in a
// build with CUDA: argument checks around the launchers of kernels/, their
// status turned into exceptions (core/cuda_checks.h).
#include "bagua/runtime/cuda_compute.h"

#include <cuda_runtime_api.h>

#include <memory>

#include "bagua/core/cuda.h"
#include "bagua/core/errors.h"
#include "core/cuda_checks.h"
#include "launchers.h"

namespace bagua {

void cuda_divide_inplace(const TensorView& x, std::int64_t divisor, void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA,
                  "cuda_divide_inplace needs a CUDA tensor, got {}", x.describe());
  BAGUA_CHECK_ARG(divisor != 0, "cuda_divide_inplace: divisor is 0");
  detail::check_launch(
      kernels::divide_inplace(x.data, x.numel, static_cast<int>(x.dtype), divisor, stream),
      "cuda_divide_inplace", x);
}

void cuda_minmax_uint8_compress(const TensorView& x, std::int64_t chunk_elements, void* out,
                                void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA,
                  "cuda_minmax_uint8_compress needs a CUDA tensor, got {}", x.describe());
  BAGUA_CHECK_ARG(chunk_elements > 0, "chunk_elements must be positive, got {}", chunk_elements);
  detail::check_launch(kernels::minmax_uint8_compress(x.data, x.numel, static_cast<int>(x.dtype),
                                                      chunk_elements, out, stream),
                       "cuda_minmax_uint8_compress", x);
}

void cuda_minmax_uint8_decompress(const void* in, std::int64_t chunk_elements,
                                  const TensorView& out, bool accumulate, void* stream) {
  BAGUA_CHECK_ARG(out.device.type == DeviceType::kCUDA,
                  "cuda_minmax_uint8_decompress needs a CUDA tensor, got {}", out.describe());
  BAGUA_CHECK_ARG(chunk_elements > 0, "chunk_elements must be positive, got {}", chunk_elements);
  detail::check_launch(
      kernels::minmax_uint8_decompress(in, out.numel, static_cast<int>(out.dtype), chunk_elements,
                                       out.data, accumulate, stream),
      "cuda_minmax_uint8_decompress", out);
}

void cuda_chunked_reduce(const TensorView& chunks, std::int64_t chunk_count, const TensorView& out,
                         bool mean, void* stream) {
  BAGUA_CHECK_ARG(chunks.device.type == DeviceType::kCUDA && out.device.type == DeviceType::kCUDA,
                  "cuda_chunked_reduce needs CUDA tensors, got {} and {}", chunks.describe(),
                  out.describe());
  BAGUA_CHECK_ARG(
      chunk_count > 0 && chunks.numel == chunk_count * out.numel && chunks.dtype == out.dtype,
      "cuda_chunked_reduce: {} is not {} chunks of {}", chunks.describe(), chunk_count,
      out.describe());
  detail::check_launch(kernels::chunked_reduce(chunks.data, chunk_count, out.numel,
                                               static_cast<int>(out.dtype), mean, out.data, stream),
                       "cuda_chunked_reduce", out);
}

void cuda_pairwise_reduce(ReduceOp op, const TensorView& out, const TensorView& a,
                          const TensorView& b, void* stream) {
  BAGUA_CHECK_ARG(out.device.type == DeviceType::kCUDA && a.device.type == DeviceType::kCUDA &&
                      b.device.type == DeviceType::kCUDA,
                  "cuda_pairwise_reduce needs CUDA tensors, got {}, {} and {}", out.describe(),
                  a.describe(), b.describe());
  BAGUA_CHECK_ARG(
      out.numel == a.numel && out.numel == b.numel && out.dtype == a.dtype && out.dtype == b.dtype,
      "cuda_pairwise_reduce: operands differ ({}, {}, {})", out.describe(), a.describe(),
      b.describe());
  detail::check_launch(
      kernels::pairwise_reduce(out.data, a.data, b.data, out.numel, static_cast<int>(out.dtype),
                               static_cast<int>(op), stream),
      "cuda_pairwise_reduce", out);
}

namespace {

// y = a * x + b * y (floating dtypes, same numel and dtype), computed in
// float (double for fp64) and rounded once per element.
void cuda_axpby(double a, const TensorView& x, double b, const TensorView& y, void* stream) {
  BAGUA_CHECK_ARG(x.device.type == DeviceType::kCUDA && y.device.type == DeviceType::kCUDA &&
                      x.numel == y.numel && x.dtype == y.dtype && is_floating_point(x.dtype),
                  "cuda_axpby needs two CUDA tensors of one floating dtype and size, got {} and {}",
                  x.describe(), y.describe());
  detail::check_launch(
      kernels::axpby(a, x.data, b, y.data, y.numel, static_cast<int>(y.dtype), stream),
      "cuda_axpby", y);
}

// to = from converted to to's dtype (same numel).
void cuda_convert(const TensorView& from, const TensorView& to, void* stream) {
  BAGUA_CHECK_ARG(from.device.type == DeviceType::kCUDA && to.device.type == DeviceType::kCUDA &&
                      from.numel == to.numel,
                  "cuda_convert needs two CUDA tensors of one size, got {} and {}", from.describe(),
                  to.describe());
  detail::check_launch(kernels::convert(from.data, static_cast<int>(from.dtype), to.data,
                                        static_cast<int>(to.dtype), to.numel, stream),
                       "cuda_convert", to);
}

class CudaCompute final : public Compute {
 public:
  CudaCompute(int device, void* stream)
      : device_(device), stream_(stream != nullptr ? stream : cuda_communication_stream(device)) {}

  Device device() const override { return Device{DeviceType::kCUDA, device_}; }

  CachingAllocator::Block scratch(std::size_t bytes) override {
    return cuda_device_pool(device_).allocate(bytes);
  }
  void copy(void* destination, const void* source, std::size_t bytes) override {
    launch([&](void* s) { cuda_copy_async(destination, source, bytes, s); });
  }
  void zero(void* destination, std::size_t bytes) override {
    if (bytes == 0) return;
    launch([&](void* s) {
      detail::check_cuda(cudaMemsetAsync(destination, 0, bytes, static_cast<cudaStream_t>(s)),
                         "cudaMemsetAsync");
    });
  }
  void convert(const TensorView& from, const TensorView& to) override {
    if (from.dtype == to.dtype) {
      copy(to.data, from.data, to.nbytes());
      return;
    }
    launch([&](void* s) { cuda_convert(from, to, s); });
  }
  void compress(const TensorView& x, std::int64_t chunk_elements, std::byte* out) override {
    launch([&](void* s) { cuda_minmax_uint8_compress(x, chunk_elements, out, s); });
  }
  void decompress(const std::byte* in, std::int64_t chunk_elements, const TensorView& out,
                  bool accumulate) override {
    launch([&](void* s) { cuda_minmax_uint8_decompress(in, chunk_elements, out, accumulate, s); });
  }
  void divide(const TensorView& x, std::int64_t divisor) override {
    launch([&](void* s) { cuda_divide_inplace(x, divisor, s); });
  }
  void axpby(double a, const TensorView& x, double b, const TensorView& y) override {
    launch([&](void* s) { cuda_axpby(a, x, b, y, s); });
  }
  void run_custom(const std::function<void()>& /*on_host*/,
                  const std::function<void(void*)>& on_device) override {
    launch(on_device);
  }
  void finish(std::string_view what, std::chrono::milliseconds timeout) override {
    cuda_stream_wait(stream_, timeout, what);
  }

 private:
  // Makes the compute's device current for one launch only: the caller may
  // be the training thread, whose current device stays PyTorch's.
  template <typename Launch>
  void launch(Launch&& enqueue) {
    const DeviceGuard guard(device_);
    enqueue(stream_);
  }

  int device_;
  void* stream_;
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(int device, void* stream) {
  return std::make_unique<CudaCompute>(detail::checked_device(device), stream);
}

}  // namespace bagua

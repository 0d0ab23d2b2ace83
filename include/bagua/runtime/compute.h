// Compute: where a comm op's element-wise work runs.
//
// An op is written once against this interface; `compute_for(device)` gives
// the host loops for CPU buckets (HostCompute, below) and the CUDA kernels
// for GPU buckets (CudaCompute, cuda_compute.h). On the GPU every call is
// enqueued on one stream, by default the device's communication stream
// (bagua/core/cuda.h), the stream the communicators also use, so kernels,
// staging copies and collectives run in the order the op issues them
// without the host waiting in between. `finish` is the one host wait, for an
// op that must read a result on the host.
//
// The interface holds the generic steps (copy, convert, compress, divide,
// axpby...). A step whose formula belongs to one op is written with that op
// (bagua/ops/op_steps.h) and run through `run_custom`.
//
// Scratch memory comes from a caching pool per device (caching_allocator.h),
// so an op that needs temporaries every step allocates them once.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string_view>
#include <type_traits>

#include "bagua/compression/chunked_layout.h"
#include "bagua/core/caching_allocator.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

class Compute {
 public:
  virtual ~Compute() = default;
  virtual Device device() const = 0;

  // Scratch memory on this device (contents undefined).
  virtual CachingAllocator::Block scratch(std::size_t bytes) = 0;
  // A view of `count` elements of `dtype` over a scratch block.
  TensorView view(const CachingAllocator::Block& block, std::int64_t count, DType dtype) const {
    BAGUA_CHECK_INTERNAL(static_cast<std::size_t>(count) * dtype_size(dtype) <= block.bytes(),
                         "scratch block of {} bytes holds fewer than {} elements of {}",
                         block.bytes(), count, to_string(dtype));
    return TensorView{block.data(), count, dtype, device()};
  }

  // Both pointers on this device.
  virtual void copy(void* destination, const void* source, std::size_t bytes) = 0;
  virtual void zero(void* destination, std::size_t bytes) = 0;
  // to = from converted to to's dtype (same numel).
  virtual void convert(const TensorView& from, const TensorView& to) = 0;
  // MinMaxUInt8 over consecutive chunks of `chunk_elements` (the last may be
  // shorter): out receives compressed_bytes(count) per chunk.
  virtual void compress(const TensorView& x, std::int64_t chunk_elements, std::byte* out) = 0;
  virtual void decompress(const std::byte* in, std::int64_t chunk_elements, const TensorView& out,
                          bool accumulate) = 0;
  virtual void divide(const TensorView& x, std::int64_t divisor) = 0;
  // y = a * x + b * y (floating dtypes).
  virtual void axpby(double a, const TensorView& x, double b, const TensorView& y) = 0;
  // A step an op defines itself: `on_host()` runs its host loop; on a
  // device, `on_device(stream)` enqueues its kernel on this compute's stream
  // (a cudaStream_t), with the compute's device current.
  virtual void run_custom(const std::function<void()>& on_host,
                          const std::function<void(void* stream)>& on_device) = 0;
  // The host waits for the work issued so far (TimeoutError naming `what`).
  virtual void finish(std::string_view what, std::chrono::milliseconds timeout) = 0;
};

// The host: plain loops (the compression loops are vectorized), scratch from
// a malloc-backed pool, nothing to wait for.
class HostCompute final : public Compute {
 public:
  Device device() const override { return Device{}; }

  CachingAllocator::Block scratch(std::size_t bytes) override { return pool().allocate(bytes); }

  void copy(void* destination, const void* source, std::size_t bytes) override {
    if (bytes > 0) std::memmove(destination, source, bytes);
  }
  void zero(void* destination, std::size_t bytes) override {
    if (bytes > 0) std::memset(destination, 0, bytes);
  }
  void convert(const TensorView& from, const TensorView& to) override {
    BAGUA_CHECK_INTERNAL(from.numel == to.numel, "convert: {} into {}", from.describe(),
                         to.describe());
    if (from.dtype == to.dtype) {
      if (from.data != to.data) std::memcpy(to.data, from.data, to.nbytes());
      return;
    }
    dispatch_dtype(from.dtype, [&](auto from_tag) {
      using From = decltype(from_tag);
      dispatch_dtype(to.dtype, [&](auto to_tag) {
        using To = decltype(to_tag);
        const From* in = from.data_as<From>();
        To* out = to.data_as<To>();
        for (std::int64_t i = 0; i < to.numel; ++i) {
          out[i] = store<To>(static_cast<compute_type_t<To>>(load(in[i])));
        }
      });
    });
  }
  void compress(const TensorView& x, std::int64_t chunk_elements, std::byte* out) override {
    minmax_uint8::compress_chunked(x, {x.numel, chunk_elements}, out);
  }
  void decompress(const std::byte* in, std::int64_t chunk_elements, const TensorView& out,
                  bool accumulate) override {
    minmax_uint8::decompress_chunked(in, {out.numel, chunk_elements}, out, accumulate);
  }
  void divide(const TensorView& x, std::int64_t divisor) override { divide_inplace(x, divisor); }
  void axpby(double a, const TensorView& x, double b, const TensorView& y) override {
    BAGUA_CHECK_INTERNAL(x.numel == y.numel && x.dtype == y.dtype, "axpby: {} and {}", x.describe(),
                         y.describe());
    dispatch_dtype(y.dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
        using C = compute_type_t<T>;
        const T* in = x.data_as<T>();
        T* out = y.data_as<T>();
        for (std::int64_t i = 0; i < y.numel; ++i) {
          out[i] = store<T>(static_cast<C>(a) * load(in[i]) + static_cast<C>(b) * load(out[i]));
        }
      } else {
        throw InvalidArgument("axpby needs a floating point tensor, got " + y.describe());
      }
    });
  }
  void run_custom(const std::function<void()>& on_host,
                  const std::function<void(void*)>& /*on_device*/) override {
    on_host();
  }
  void finish(std::string_view /*what*/, std::chrono::milliseconds /*timeout*/) override {}

  static CachingAllocator& pool() {
    static auto* host_pool = new CachingAllocator(
        "host scratch pool", [](std::size_t bytes) { return ::operator new(bytes); },
        [](void* pointer) { ::operator delete(pointer); });
    return *host_pool;
  }
};

// A float32 version of `data` to work on: `data` itself when it is float32,
// else a float32 copy in c's scratch memory (`block` holds it), which the
// caller converts back into `data` (c.convert(view, data)) when done.
struct Float32Work {
  CachingAllocator::Block block;
  TensorView view;
  bool is_copy() const { return block.data() != nullptr; }
};
inline Float32Work float32_work(Compute& c, const TensorView& data) {
  if (data.dtype == DType::kFloat32) return {{}, data};
  Float32Work work{c.scratch(static_cast<std::size_t>(data.numel) * sizeof(float)), {}};
  work.view = c.view(work.block, data.numel, DType::kFloat32);
  c.convert(data, work.view);
  return work;
}

// The compute of `device`: a HostCompute for the CPU, a CudaCompute on the
// device's communication stream for a GPU (InvalidArgument in a build
// without CUDA or for a device that does not exist).
std::unique_ptr<Compute> compute_for(Device device);

}  // namespace bagua

// `bagua_core._testing`: hooks used only by tests and benchmarks, kept out of
// the runtime's API: the raw CUDA kernels and the host compressor (compared
// against references), pool statistics, the in-process store (ranks as
// threads), running a bucket's ops without a backend, the shift_one
// schedule, and re-reading the environment.
//
// `stream` arguments are a cudaStream_t as an integer
// (torch.cuda.current_stream().cuda_stream).
#include <pybind11/stl.h>

#include <cstdint>
#include <string_view>

#include "bagua/comm/store.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/core/cuda.h"
#include "bagua/core/env.h"
#include "bagua/ops/op_steps.h"
#include "bagua/ops/peer_selection.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/comm_op.h"
#include "bagua/runtime/cuda_compute.h"
#include "bindings.h"

namespace bagua::python {
namespace {

void bind_cuda_kernels(py::module_& t) {
  t.def(
      "cuda_divide_inplace",
      [](const TensorView& x, std::int64_t divisor, std::uintptr_t stream) {
        cuda_divide_inplace(x, divisor, as_stream(stream));
      },
      py::arg("x"), py::arg("divisor"), py::arg("stream") = 0);
  t.def(
      "cuda_minmax_uint8_compress",
      [](const TensorView& x, std::int64_t chunk_elements, std::uintptr_t out,
         std::uintptr_t stream) {
        cuda_minmax_uint8_compress(x, chunk_elements, reinterpret_cast<void*>(out),
                                   as_stream(stream));
      },
      py::arg("x"), py::arg("chunk_elements"), py::arg("out"), py::arg("stream") = 0);
  t.def(
      "cuda_minmax_uint8_decompress",
      [](std::uintptr_t in, std::int64_t chunk_elements, const TensorView& out, bool accumulate,
         std::uintptr_t stream) {
        cuda_minmax_uint8_decompress(reinterpret_cast<const void*>(in), chunk_elements, out,
                                     accumulate, as_stream(stream));
      },
      py::arg("input"), py::arg("chunk_elements"), py::arg("out"), py::arg("accumulate") = false,
      py::arg("stream") = 0);
  t.def(
      "cuda_chunked_reduce",
      [](const TensorView& chunks, std::int64_t chunk_count, const TensorView& out, bool mean,
         std::uintptr_t stream) {
        cuda_chunked_reduce(chunks, chunk_count, out, mean, as_stream(stream));
      },
      py::arg("chunks"), py::arg("chunk_count"), py::arg("out"), py::arg("mean"),
      py::arg("stream") = 0);
  t.def(
      "cuda_pairwise_reduce",
      [](const std::string& op, const TensorView& out, const TensorView& a, const TensorView& b,
         std::uintptr_t stream) {
        cuda_pairwise_reduce(parse_reduce_op(op), out, a, b, as_stream(stream));
      },
      py::arg("op"), py::arg("out"), py::arg("a"), py::arg("b"), py::arg("stream") = 0);
  t.def(
      "cuda_async_average_update",
      [](const TensorView& w, const TensorView& sum, const TensorView& snapshot, std::int64_t ranks,
         std::uintptr_t stream) {
        cuda_async_average_update(w, sum, snapshot, ranks, as_stream(stream));
      },
      py::arg("w"), py::arg("sum"), py::arg("snapshot"), py::arg("ranks"), py::arg("stream") = 0);
  // out: a CUDA float64 tensor of 2 elements (zeroed by the caller).
  t.def(
      "cuda_async_average_drift",
      [](const TensorView& sum, const TensorView& snapshot, std::int64_t ranks,
         const TensorView& out, std::uintptr_t stream) {
        BAGUA_CHECK_ARG(out.dtype == DType::kFloat64 && out.numel == 2 && out.device == sum.device,
                        "cuda_async_average_drift: out must be 2 float64 on {}, got {}",
                        sum.device.str(), out.describe());
        cuda_async_average_drift(sum, snapshot, ranks, static_cast<double*>(out.data),
                                 as_stream(stream));
      },
      py::arg("sum"), py::arg("snapshot"), py::arg("ranks"), py::arg("out"), py::arg("stream") = 0);
}

// Pool statistics, to check that steady-state iterations reuse memory and
// events (device -1: the pinned host staging pool).
void bind_pools(py::module_& t) {
  t.def("cuda_event_pool_created", [](int device) { return cuda_event_pool(device).created(); });
  t.def("scratch_pool_stats", [](int device) {
    const CachingAllocatorStats stats =
        (device < 0 ? pinned_host_pool() : cuda_device_pool(device)).stats();
    return py::dict(py::arg("blocks_in_use") = stats.blocks_in_use,
                    py::arg("bytes_in_use") = stats.bytes_in_use,
                    py::arg("blocks_cached") = stats.blocks_cached,
                    py::arg("bytes_cached") = stats.bytes_cached,
                    py::arg("system_allocations") = stats.system_allocations,
                    py::arg("cache_hits") = stats.cache_hits);
  });
}

// The host compressor reads and writes through plain pointers: a CUDA view
// would be dereferenced on the host (a crash), so it is refused up front.
void check_host_view(const TensorView& view, std::string_view op, std::string_view which) {
  BAGUA_CHECK_ARG(view.device.type == DeviceType::kCPU,
                  "{}: {} is {}: the host compressor takes host memory only (the CUDA kernels "
                  "are cuda_minmax_uint8_compress / cuda_minmax_uint8_decompress)",
                  op, which, view.describe());
}

// The views of one host (de)compression: both in host memory, the values of
// a compressible dtype, the codes exactly compressed_bytes(values) long.
void check_host_codec(std::string_view op, const TensorView& values, std::string_view values_name,
                      const TensorView& codes, std::string_view codes_name) {
  check_host_view(values, op, values_name);
  check_host_view(codes, op, codes_name);
  check_compressible(values.dtype, op);
  BAGUA_CHECK_ARG(codes.nbytes() == minmax_uint8::compressed_bytes(values.numel),
                  "{}: {} has {} bytes, {} needed", op, codes_name, codes.nbytes(),
                  minmax_uint8::compressed_bytes(values.numel));
}

// The host MinMaxUInt8 compressor on one chunk.
void bind_host_compressor(py::module_& t) {
  t.def("minmax_uint8_compressed_bytes",
        [](std::int64_t numel) { return minmax_uint8::compressed_bytes(numel); });
  t.def(
      "minmax_uint8_compress",
      [](const TensorView& input, const TensorView& output) {
        check_host_codec("minmax_uint8_compress", input, "input", output, "output");
        minmax_uint8::compress_view(input, output.bytes());
      },
      ReleaseGil());
  t.def(
      "minmax_uint8_decompress",
      [](const TensorView& input, const TensorView& output, bool accumulate) {
        check_host_codec("minmax_uint8_decompress", output, "output", input, "input");
        minmax_uint8::decompress_view(input.bytes(), output, accumulate);
      },
      py::arg("input"), py::arg("output"), py::arg("accumulate") = false, ReleaseGil());
}

}  // namespace

void bind_testing(py::module_& t) {
  bind_cuda_kernels(t);
  bind_pools(t);
  bind_host_compressor(t);
  t.def("hash_store", &make_hash_store, "A store in this process's memory (ranks as threads).");
  // A bucket's ops in order on the calling thread, without a backend.
  t.def(
      "execute_ops",
      [](Bucket& bucket) {
        for (const auto& op : bucket.ops()) op->execute(bucket);
      },
      py::arg("bucket"), ReleaseGil());
  t.def("shift_one_peer", &shift_one_peer, py::arg("rank"), py::arg("size"), py::arg("step"));
  // Re-reads the BAGUA_* variables after a test changed them in its process
  // (call with no communicator or backend running).
  t.def("reload_env", [] { return reload_env(); });
}

}  // namespace bagua::python

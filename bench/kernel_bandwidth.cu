// GPU kernel bandwidth: MinMaxUInt8 compress and decompress in the runtime's
// real chunkings (C_LP_S: one chunk per rank, here 8 ranks; D_LP_S: chunks of
// 65536 elements), for fp32, fp16 and bf16, and the chunked reduce, in GB/s
// of bytes read plus written once, against a device-to-device cudaMemcpy of
// the same input measured in the same run. Sizes 1 MiB to 1 GiB of input.
// Every launch's status is checked: a failed launch stops the bench instead
// of timing as a very fast kernel. The last line puts ByteGrad's kernels per
// step (two compressions and two decompressions of the bucket, an upper
// bound) against the byte time of an 8-rank ring allreduce of the same fp32
// bucket over a 100 Gbit/s link.
//
//   build/bench_kernels [--json path]
//
// Without a CUDA device it says so and exits 0 (nothing to measure).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bagua/compression/minmax_uint8.h"
#include "bagua/core/dtype.h"
#include "launchers.h"

namespace {

#define CHECK_CUDA(call)                                                           \
  do {                                                                             \
    cudaError_t status_ = (call);                                                  \
    if (status_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(status_)); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

// Fails the bench on a launch error: launchers return nullptr on success.
bool launched(const char* error, const char* what) {
  if (error == nullptr) return true;
  std::fprintf(stderr, "%s failed: %s\n", what, error);
  return false;
}

// The best of `repeats` timings of fn() in ms, or a negative value when a
// launch failed. fn returns the launcher's status.
template <typename Fn>
float best_ms(Fn&& fn, int repeats, const char* what) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float best = 1e30f;
  for (int r = 0; r < repeats && best >= 0; ++r) {
    cudaEventRecord(start);
    if (!launched(fn(), what)) best = -1;
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (best >= 0) best = ms < best ? ms : best;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t sync = cudaDeviceSynchronize();  // an error the launch did not report
  if (best >= 0 && sync != cudaSuccess) best = launched(cudaGetErrorString(sync), what) ? best : -1;
  return best;
}

struct Row {
  std::string dtype;
  std::string layout;
  std::int64_t mib;
  double copy_gbps, compress_gbps, decompress_gbps;
  float compress_ms, decompress_ms;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "bench/results/kernel_bandwidth.json";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to measure (bench_kernels runs on a GPU machine)\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s\n", prop.name);
  std::printf("%6s %8s %6s %10s %10s %10s %8s %8s\n", "dtype", "layout", "MiB", "copy GB/s",
              "compress", "decompress", "c/copy", "d/copy");
  struct DtypeCase {
    const char* name;
    bagua::DType dtype;
    int bytes;
  };
  const DtypeCase dtypes[] = {{"fp32", bagua::DType::kFloat32, 4},
                              {"fp16", bagua::DType::kFloat16, 2},
                              {"bf16", bagua::DType::kBFloat16, 2}};
  constexpr int kRanks = 8;                   // C_LP_S: one chunk per rank
  constexpr std::int64_t kDlpsChunk = 65536;  // D_LP_S's kChunkElements
  std::vector<Row> rows;
  std::string reduce_json;
  for (std::int64_t mib = 1; mib <= 1024; mib *= 4) {
    const std::size_t input_bytes = static_cast<std::size_t>(mib) << 20;
    void *d_x = nullptr, *d_y = nullptr, *d_packed = nullptr;
    CHECK_CUDA(cudaMalloc(&d_x, input_bytes));
    CHECK_CUDA(cudaMalloc(&d_y, input_bytes));
    // at most one header per 2-byte element... far more than any layout needs
    CHECK_CUDA(cudaMalloc(&d_packed, input_bytes));
    const int repeats = mib >= 256 ? 5 : 20;
    const float copy_ms = best_ms(
        [&] {
          const cudaError_t e = cudaMemcpyAsync(d_y, d_x, input_bytes, cudaMemcpyDeviceToDevice);
          return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
        },
        repeats, "copy");
    if (copy_ms < 0) return 1;
    const double copy_gbps = 2.0 * input_bytes / (copy_ms / 1e3) / 1e9;
    for (const auto& dt : dtypes) {
      const std::int64_t n = static_cast<std::int64_t>(input_bytes) / dt.bytes;
      // a smooth ramp with a few outliers, written through the convert kernel
      std::vector<float> host(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i)
        host[static_cast<std::size_t>(i)] = static_cast<float>((i * 7919) % 1000) / 100.0f;
      float* staging = nullptr;
      CHECK_CUDA(cudaMalloc(&staging, n * 4));
      CHECK_CUDA(cudaMemcpy(staging, host.data(), n * 4, cudaMemcpyHostToDevice));
      const int code = static_cast<int>(dt.dtype);
      if (!launched(bagua::kernels::convert(staging, static_cast<int>(bagua::DType::kFloat32), d_x,
                                            code, n, nullptr),
                    "convert"))
        return 1;
      CHECK_CUDA(cudaDeviceSynchronize());
      cudaFree(staging);
      const std::pair<const char*, std::int64_t> layouts[] = {
          {"c_lp_s/8", (n + kRanks - 1) / kRanks}, {"d_lp_s", kDlpsChunk}};
      for (const auto& [layout, chunk] : layouts) {
        const std::int64_t chunks = (n + chunk - 1) / chunk;
        const double packed_bytes = static_cast<double>(n) + chunks * 8.0;
        const float c_ms = best_ms(
            [&] {
              return bagua::kernels::minmax_uint8_compress(d_x, n, code, chunk, d_packed, nullptr);
            },
            repeats, "compress");
        const float d_ms = best_ms(
            [&] {
              return bagua::kernels::minmax_uint8_decompress(d_packed, n, code, chunk, d_y, false,
                                                             nullptr);
            },
            repeats, "decompress");
        if (c_ms < 0 || d_ms < 0) return 1;
        const double moved = static_cast<double>(input_bytes) + packed_bytes;
        Row row{
            dt.name, layout, mib, copy_gbps, moved / (c_ms / 1e3) / 1e9, moved / (d_ms / 1e3) / 1e9,
            c_ms,    d_ms};
        std::printf("%6s %8s %6lld %10.1f %10.1f %10.1f %8.2f %8.2f\n", row.dtype.c_str(),
                    row.layout.c_str(), static_cast<long long>(mib), copy_gbps, row.compress_gbps,
                    row.decompress_gbps, row.compress_gbps / copy_gbps,
                    row.decompress_gbps / copy_gbps);
        rows.push_back(row);
      }
    }
    // fp32: 4 chunks of n/4 reduced into one reads n and writes n/4.
    const std::int64_t n32 = static_cast<std::int64_t>(input_bytes) / 4;
    const float reduce_ms = best_ms(
        [&] {
          return bagua::kernels::chunked_reduce(
              d_x, 4, n32 / 4, static_cast<int>(bagua::DType::kFloat32), true, d_y, nullptr);
        },
        repeats, "chunked_reduce");
    if (reduce_ms < 0) return 1;
    const double reduce_gbps = (n32 * 4.0 + n32) / (reduce_ms / 1e3) / 1e9;
    std::printf("%6s %8s %6lld %10.1f %10.1f %10s %8.2f\n", "fp32", "reduce/4",
                static_cast<long long>(mib), copy_gbps, reduce_gbps, "", reduce_gbps / copy_gbps);
    char entry[160];
    std::snprintf(entry, sizeof(entry), "%s{\"mib\": %lld, \"reduce_gbps\": %.2f}",
                  reduce_json.empty() ? "" : ", ", static_cast<long long>(mib), reduce_gbps);
    reduce_json += entry;
    cudaFree(d_x);
    cudaFree(d_y);
    cudaFree(d_packed);
  }
  // ByteGrad (C_LP_S) per step on a 64 MiB fp32 bucket against the byte time
  // of its uncompressed ring allreduce over 100 Gbit/s at 8 ranks.
  for (const auto& row : rows) {
    if (row.dtype == "fp32" && row.layout == "c_lp_s/8" && row.mib == 64) {
      const double kernels_ms = 2.0 * (row.compress_ms + row.decompress_ms);
      const double link_ms = 2.0 * (kRanks - 1) / kRanks * (64.0 * (1 << 20)) / 12.5e9 * 1e3;
      std::printf(
          "bytegrad kernels per step, 64 MiB fp32 bucket: %.3f ms; 8-rank ring "
          "allreduce over 100 Gbit/s: %.2f ms; ratio %.3f\n",
          kernels_ms, link_ms, kernels_ms / link_ms);
    }
  }
  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"rows\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    char entry[400];
    std::snprintf(entry, sizeof(entry),
                  "%s{\"dtype\": \"%s\", \"layout\": \"%s\", \"mib\": %lld, \"copy_gbps\": %.2f, "
                  "\"compress_gbps\": %.2f, \"decompress_gbps\": %.2f, \"compress_ms\": %.4f, "
                  "\"decompress_ms\": %.4f}",
                  i ? ", " : "", r.dtype.c_str(), r.layout.c_str(), static_cast<long long>(r.mib),
                  r.copy_gbps, r.compress_gbps, r.decompress_gbps, r.compress_ms, r.decompress_ms);
    json += entry;
  }
  json += "], \"reduce\": [" + reduce_json + "]}";
  if (FILE* f = std::fopen(json_path.c_str(), "w")) {
    std::fputs(json.c_str(), f);
    std::fclose(f);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}

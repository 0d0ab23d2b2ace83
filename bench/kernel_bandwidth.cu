// GPU kernel bandwidth: MinMaxUInt8 compress and decompress and the chunked
// reduce, in GB/s of bytes read plus written, against a device-to-device
// cudaMemcpy of the same size measured in the same run (which reads and
// writes its size once). Sizes 1 MiB to 1 GiB of fp32 input.
//
//   build/bench_kernels [--json path]
//
// Without a CUDA device it says so and exits 0 (nothing to measure).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
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

template <typename Fn>
float best_ms(Fn&& fn, int repeats) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float best = 1e30f;
  for (int r = 0; r < repeats; ++r) {
    cudaEventRecord(start);
    fn();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

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
  std::printf("%10s %10s %10s %10s %10s %9s %9s %9s\n", "MiB", "copy GB/s", "compress",
              "decompress", "reduce", "c/copy", "d/copy", "r/copy");
  const std::int64_t chunk = 1 << 20;  // elements per min/max chunk
  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"rows\": [";
  bool first = true;
  for (std::int64_t mib = 1; mib <= 1024; mib *= 4) {
    const std::int64_t n = mib * 1024 * 1024 / 4;
    const std::int64_t chunks = (n + chunk - 1) / chunk;
    const std::size_t packed_bytes = static_cast<std::size_t>(n) + chunks * 8;
    float *d_x = nullptr, *d_y = nullptr, *d_out = nullptr;
    void* d_packed = nullptr;
    CHECK_CUDA(cudaMalloc(&d_x, n * 4));
    CHECK_CUDA(cudaMalloc(&d_y, n * 4));
    CHECK_CUDA(cudaMalloc(&d_out, n / 4 * 4 + 4));
    CHECK_CUDA(cudaMalloc(&d_packed, packed_bytes));
    std::vector<float> host(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      host[static_cast<std::size_t>(i)] = static_cast<float>((i * 7919) % 1000) / 100.0f;
    CHECK_CUDA(cudaMemcpy(d_x, host.data(), n * 4, cudaMemcpyHostToDevice));
    const int repeats = mib >= 256 ? 5 : 20;
    const int f32 = static_cast<int>(bagua::DType::kFloat32);
    const float copy_ms =
        best_ms([&] { cudaMemcpy(d_y, d_x, n * 4, cudaMemcpyDeviceToDevice); }, repeats);
    const float compress_ms = best_ms(
        [&] { bagua::kernels::minmax_uint8_compress(d_x, n, f32, chunk, d_packed, nullptr); },
        repeats);
    const float decompress_ms = best_ms(
        [&] {
          bagua::kernels::minmax_uint8_decompress(d_packed, n, f32, chunk, d_y, false, nullptr);
        },
        repeats);
    // 4 chunks of n/4 reduced into one: reads n, writes n/4.
    const float reduce_ms = best_ms(
        [&] { bagua::kernels::chunked_reduce(d_x, 4, n / 4, f32, true, d_out, nullptr); }, repeats);
    CHECK_CUDA(cudaDeviceSynchronize());
    const double gb = 1e9;
    const double copy_bw = 2.0 * n * 4 / (copy_ms / 1e3) / gb;
    const double compress_bw = (n * 4.0 + packed_bytes) / (compress_ms / 1e3) / gb;
    const double decompress_bw = (packed_bytes + n * 4.0) / (decompress_ms / 1e3) / gb;
    const double reduce_bw = (n * 4.0 + n) / (reduce_ms / 1e3) / gb;
    std::printf("%10lld %10.1f %10.1f %10.1f %10.1f %9.2f %9.2f %9.2f\n",
                static_cast<long long>(mib), copy_bw, compress_bw, decompress_bw, reduce_bw,
                compress_bw / copy_bw, decompress_bw / copy_bw, reduce_bw / copy_bw);
    char row[512];
    std::snprintf(row, sizeof(row),
                  "%s{\"mib\": %lld, \"copy_gbps\": %.2f, \"compress_gbps\": %.2f, "
                  "\"decompress_gbps\": %.2f, \"reduce_gbps\": %.2f}",
                  first ? "" : ", ", static_cast<long long>(mib), copy_bw, compress_bw,
                  decompress_bw, reduce_bw);
    json += row;
    first = false;
    cudaFree(d_x);
    cudaFree(d_y);
    cudaFree(d_out);
    cudaFree(d_packed);
  }
  json += "]}";
  if (FILE* f = std::fopen(json_path.c_str(), "w")) {
    std::fputs(json.c_str(), f);
    std::fclose(f);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}

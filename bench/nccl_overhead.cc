// NCCL allreduce through bagua's Communicator against a raw ncclAllReduce
// call, world size 1: what the Communicator adds per call (argument checks,
// counters, the timed stream wait with abort on timeout) on top of NCCL's
// own launch and completion. Both run on the same GPU in the same process,
// alternating per size; the raw call waits with cudaStreamSynchronize. In
// place, a world-1 allreduce moves no data (NCCL returns at once): those rows
// give the fixed cost per call; out of place NCCL copies the buffer, so those
// rows give the ratio at sizes where the allreduce itself takes time.
//
//   build/bench_nccl_overhead [--json path]
//
// Without a CUDA device it says so and exits 0 (nothing to measure).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bagua/comm/nccl_communicator.h"
#include "bagua/comm/store.h"
#include "bagua/core/cuda.h"

namespace {

template <typename Fn>
double median_us(Fn&& fn, int calls) {
  std::vector<double> samples;
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    samples.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "bench/results/nccl_overhead.json";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];
  }
  if (bagua::cuda_device_count() == 0) {
    std::printf("no CUDA device: nothing to measure (bench_nccl_overhead runs on a GPU machine)\n");
    return 0;
  }
  if (!bagua::nccl_available()) {
    std::printf("NCCL cannot be used here: %s\n", bagua::nccl_unavailable_reason().c_str());
    return 0;
  }
  cudaSetDevice(0);
  auto ours = bagua::make_nccl_communicator(bagua::make_hash_store(), 0, 1,
                                            bagua::NcclOptions{.prefix = "bench", .device = 0});
  ncclUniqueId id;
  ncclComm_t raw = nullptr;
  cudaStream_t stream = nullptr;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&raw, 1, id, 0) != ncclSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "raw NCCL setup failed\n");
    return 1;
  }

  nlohmann::json results = nlohmann::json::array();
  std::printf("%12s %8s %12s %12s %10s %12s\n", "bytes", "mode", "raw us", "bagua us", "ratio",
              "extra us");
  for (std::size_t bytes : {std::size_t{4}, std::size_t{4} << 10, std::size_t{64} << 10,
                            std::size_t{1} << 20, std::size_t{16} << 20, std::size_t{64} << 20}) {
    const std::int64_t numel = static_cast<std::int64_t>(bytes / sizeof(float));
    void* data = nullptr;
    void* out = nullptr;
    if (cudaMalloc(&data, bytes) != cudaSuccess || cudaMalloc(&out, bytes) != cudaSuccess) return 1;
    cudaMemset(data, 0, bytes);
    for (const bool in_place : {true, false}) {
      void* target = in_place ? data : out;
      const bagua::TensorView view{data, numel, bagua::DType::kFloat32,
                                   bagua::Device{bagua::DeviceType::kCUDA, 0}};
      const bagua::TensorView target_view{target, numel, bagua::DType::kFloat32,
                                          bagua::Device{bagua::DeviceType::kCUDA, 0}};
      const int calls = bytes >= (std::size_t{16} << 20) ? 50 : 500;
      const auto raw_call = [&] {
        ncclAllReduce(data, target, static_cast<std::size_t>(numel), ncclFloat32, ncclSum, raw,
                      stream);
        cudaStreamSynchronize(stream);
      };
      const auto our_call = [&] { ours->allreduce(view, target_view, bagua::ReduceOp::kSum); };
      for (int i = 0; i < 20; ++i) {  // warm up both paths
        raw_call();
        our_call();
      }
      const double raw_us = median_us(raw_call, calls);
      const double our_us = median_us(our_call, calls);
      const char* mode = in_place ? "in place" : "copy";
      std::printf("%12zu %8s %12.1f %12.1f %10.3f %12.1f\n", bytes, mode, raw_us, our_us,
                  our_us / raw_us, our_us - raw_us);
      results.push_back({{"bytes", bytes},
                         {"mode", mode},
                         {"calls", calls},
                         {"raw_median_us", raw_us},
                         {"bagua_median_us", our_us},
                         {"ratio", our_us / raw_us}});
    }
    cudaFree(data);
    cudaFree(out);
  }
  ncclCommDestroy(raw);
  cudaStreamDestroy(stream);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::ofstream(json_path)
      << nlohmann::json{{"gpu", prop.name}, {"world_size", 1}, {"results", results}}.dump(2)
      << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}

// MinMaxUInt8 throughput on the CPU, one thread, against memcpy of the same
// buffer measured in the same run.
//
//   build/bench_compression [--json path]
//
// For each size: compress (fp32 -> codes) and decompress (codes -> fp32) in
// GB/s of fp32 data handled, and the bytes read plus written per second; the
// ratio is against memcpy of the fp32 buffer (which reads and writes it once).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bagua/compression/minmax_uint8.h"
#include "best_time.h"

namespace {

using bagua_bench::best_seconds;

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "bench/results/compression_throughput.json";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];
  }
  namespace q = bagua::minmax_uint8;
  nlohmann::json results = nlohmann::json::array();
  fmt::print("{:>10} {:>12} {:>12} {:>12} {:>10} {:>10}\n", "size", "memcpy GB/s", "compress",
             "decompress", "c/memcpy", "d/memcpy");
  for (std::int64_t mib : {1, 4, 16, 64}) {
    const std::int64_t n = mib * 1024 * 1024 / 4;
    std::vector<float> x(static_cast<std::size_t>(n)), y(static_cast<std::size_t>(n)),
        copy(static_cast<std::size_t>(n));
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& v : x) v = normal(rng);
    std::vector<std::byte> packed(q::compressed_bytes(n));
    const int repeats = mib >= 64 ? 5 : 20;
    const double t_copy =
        best_seconds([&] { std::memcpy(copy.data(), x.data(), x.size() * 4); }, repeats);
    const double t_compress =
        best_seconds([&] { q::compress_f32(x.data(), n, packed.data()); }, repeats);
    const double t_decompress =
        best_seconds([&] { q::decompress_f32(packed.data(), n, y.data(), false); }, repeats);
    const double bytes = static_cast<double>(n) * 4;
    const double gb = 1e9;
    // Bytes moved: memcpy reads and writes 4n; compress reads 4n (twice: min/max,
    // then codes) and writes n; decompress reads n and writes 4n.
    nlohmann::json row{{"size_mib", mib},
                       {"memcpy_gbps", bytes / t_copy / gb},
                       {"compress_gbps", bytes / t_compress / gb},
                       {"decompress_gbps", bytes / t_decompress / gb},
                       {"compress_over_memcpy", t_copy / t_compress},
                       {"decompress_over_memcpy", t_copy / t_decompress}};
    fmt::print("{:>7} MiB {:>12.2f} {:>12.2f} {:>12.2f} {:>10.2f} {:>10.2f}\n", mib,
               row["memcpy_gbps"].get<double>(), row["compress_gbps"].get<double>(),
               row["decompress_gbps"].get<double>(), row["compress_over_memcpy"].get<double>(),
               row["decompress_over_memcpy"].get<double>());
    results.push_back(row);
  }
  std::ofstream(json_path) << nlohmann::json{
      {"benchmark", "minmax_uint8_cpu_single_thread"},
      {"unit", "GB/s of fp32 data"},
      {"results", results}}.dump(2);
  fmt::print("wrote {}\n", json_path);
  return 0;
}

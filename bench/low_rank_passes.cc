// PowerSGD's host passes (include/bagua/ops/low_rank_steps.h) on one core,
// for the gradients of issue 43's MLP (512-1536-1536-1024-10: 1536 x 512,
// 1536 x 1536, 1024 x 1536, 10 x 1024), at ranks 1, 2 and 4: the deferred
// project (M = G + e, P = M Q), the project back (Q = M^T P) and the
// reconstruction (G = P Q^T), best of 20, in ms per step and in GB/s of M;
// the baseline (SSE2) build of the loops and the AVX2 one (core/host_vectors.h)
// by turns.
//
// With --cold every timed pass starts after a sweep over 512 MB, so the
// matrices come from memory as in a training step, where the backward, the
// optimizer and other models run between two passes over the same buffers.
// Hot, the matrices of this MLP (19 MB) stay in a large last-level cache
// and the passes run several times faster than inside a step
// (docs/benchmarks.md, "The passes at memory speed").
//
// --threads N runs the passes on N host threads (core/host_threads.h; the
// passes cut their rows or columns, the bits stay those of one thread).
//
//   build/bench_low_rank_passes [--cold] [--threads N] [--json path]
#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bagua/core/host_threads.h"
#include "bagua/core/host_vectors.h"
#include "bagua/ops/low_rank_steps.h"
#include "best_time.h"

namespace {

using bagua::LowRankShape;

using bagua_bench::best_seconds;

bagua::TensorView view_of(std::vector<float>& v) {
  return bagua::TensorView{v.data(), static_cast<std::int64_t>(v.size()), bagua::DType::kFloat32,
                           bagua::Device{}};
}

// One gradient's buffers: G, the state M, the factors and last step's.
struct Matrix {
  LowRankShape s;
  std::vector<float> grad, state, p, q, p_prev, q_prev;
  Matrix(std::int64_t rows, std::int64_t cols, std::int64_t rank, std::mt19937& rng)
      : s{rows, cols, rank},
        grad(rows * cols),
        state(rows * cols),
        p(rows * rank),
        q(cols * rank),
        p_prev(rows * rank),
        q_prev(cols * rank) {
    std::normal_distribution<float> normal;
    for (auto* v : {&grad, &state, &p, &q, &p_prev, &q_prev})
      for (float& x : *v) x = normal(rng);
  }
};

using Passes = std::array<std::function<void(Matrix&)>, 3>;

// Writes one float of every cache line of a buffer larger than any cache:
// what the passes read afterwards comes from memory.
void evict_caches() {
  static std::vector<float> sweep(std::size_t{128} << 20);  // 512 MB
  for (std::size_t i = 0; i < sweep.size(); i += 16) sweep[i] += 1.0f;
}

// Each pass over all matrices, best of 20 runs, in ms: the baseline build and
// (with `avx2`) the AVX2 one, run by turns so both see the same machine;
// `cold`: each run after evict_caches.
std::vector<std::pair<std::string, std::array<double, 3>>> time_builds(
    const Passes& passes, std::vector<Matrix>& matrices, bool avx2, bool cold) {
  std::vector<std::pair<std::string, std::array<double, 3>>> timings = {{"baseline", {}}};
  if (avx2) timings.push_back({"avx2", {}});
  for (auto& [build, ms] : timings) ms.fill(1e30);
  for (int round = 0; round < 20; ++round) {
    for (std::size_t b = 0; b < timings.size(); ++b) {
      bagua::set_host_avx2(b == 1);
      for (std::size_t pass = 0; pass < passes.size(); ++pass) {
        if (cold) evict_caches();
        const double seconds = best_seconds(
            [&] {
              for (Matrix& m : matrices) passes[pass](m);
            },
            1);
        timings[b].second[pass] = std::min(timings[b].second[pass], seconds * 1e3);
      }
    }
  }
  return timings;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path = "bench/results/low_rank_passes.json";
  bool cold = false;
  int threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--cold") cold = true;
    if (std::string(argv[i]) == "--threads" && i + 1 < argc) threads = std::stoi(argv[i + 1]);
    if (std::string(argv[i]) == "--json" && i + 1 < argc) json_path = argv[i + 1];
  }
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {1536, 512}, {1536, 1536}, {1024, 1536}, {10, 1024}};
  auto compute = bagua::compute_for(bagua::Device{});
  nlohmann::json report = nlohmann::json::array();
  const bool avx2 = bagua::host_avx2_enabled();
  bagua::set_host_threads(threads);
  fmt::print("host loops: the baseline build{}, caches {}, {} thread(s)\n",
             avx2 ? " and AVX2, alternated" : " (no AVX2)", cold ? "cold" : "hot", threads);
  fmt::print("{:>5} {:>8} {:>14} {:>14} {:>14}   (ms per step; GB/s of M)\n", "rank", "build",
             "project", "project back", "reconstruct");
  for (const std::int64_t rank : {1, 2, 4}) {
    std::mt19937 rng(5);
    std::vector<Matrix> matrices;
    double bytes = 0;
    for (auto [rows, cols] : shapes) {
      matrices.emplace_back(rows, cols, rank, rng);
      bytes += 4.0 * static_cast<double>(rows * cols);
    }
    const Passes passes = {
        [](Matrix& m) {
          bagua::low_rank_project_deferred(m.s, view_of(m.grad), view_of(m.state),
                                           view_of(m.p_prev), view_of(m.q_prev), view_of(m.q),
                                           view_of(m.p));
        },
        [&](Matrix& m) {
          bagua::low_rank_project_back(*compute, m.s, view_of(m.state), view_of(m.p), view_of(m.q));
        },
        [](Matrix& m) {
          bagua::low_rank_write_approximation(m.s, view_of(m.grad), view_of(m.p), view_of(m.q));
        }};
    const auto timings = time_builds(passes, matrices, avx2, cold);
    for (const auto& [build, ms] : timings) {
      fmt::print("{:>5} {:>8} {:>7.2f} {:>5.1f}  {:>7.2f} {:>5.1f}  {:>7.2f} {:>5.1f}\n", rank,
                 build, ms[0], bytes / ms[0] / 1e6, ms[1], bytes / ms[1] / 1e6, ms[2],
                 bytes / ms[2] / 1e6);
      report.push_back({{"rank", rank},
                        {"build", build},
                        {"caches", cold ? "cold" : "hot"},
                        {"threads", threads},
                        {"m_bytes", bytes},
                        {"project_ms", ms[0]},
                        {"project_back_ms", ms[1]},
                        {"reconstruct_ms", ms[2]}});
    }
  }
  bagua::set_host_avx2(true);
  std::ofstream(json_path) << report.dump(2) << "\n";
  fmt::print("wrote {}\n", json_path);
} catch (const std::exception& e) {
  fmt::print(stderr, "bench_low_rank_passes: {}\n", e.what());
  return 1;
}

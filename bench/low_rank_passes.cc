// PowerSGD's host passes (include/bagua/ops/low_rank_steps.h) on one core,
// for the gradients of issue 43's MLP (512-1536-1536-1024-10: 1536 x 512,
// 1536 x 1536, 1024 x 1536, 10 x 1024), at ranks 1, 2 and 4: the deferred
// project (M = G + e, P = M Q), the project back (Q = M^T P) and the
// reconstruction (G = P Q^T), best of 20, in ms per step and in GB/s of M.
//
//   build/bench_low_rank_passes [--json path]
#include <algorithm>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

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

}  // namespace

int main(int argc, char** argv) {
  std::string json_path = "bench/results/low_rank_passes.json";
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--json") json_path = argv[i + 1];
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {1536, 512}, {1536, 1536}, {1024, 1536}, {10, 1024}};
  auto compute = bagua::compute_for(bagua::Device{});
  nlohmann::json report = nlohmann::json::array();
  fmt::print("{:>5} {:>14} {:>14} {:>14}   (ms per step; GB/s of M)\n", "rank", "project",
             "project back", "reconstruct");
  for (const std::int64_t rank : {1, 2, 4}) {
    std::mt19937 rng(5);
    std::vector<Matrix> matrices;
    double bytes = 0;
    for (auto [rows, cols] : shapes) {
      matrices.emplace_back(rows, cols, rank, rng);
      bytes += 4.0 * static_cast<double>(rows * cols);
    }
    const auto each = [&](auto&& pass) {
      return best_seconds(
          [&] {
            for (Matrix& m : matrices) pass(m);
          },
          20);
    };
    const double project = each([&](Matrix& m) {
      bagua::low_rank_project_deferred(m.s, view_of(m.grad), view_of(m.state), view_of(m.p_prev),
                                       view_of(m.q_prev), view_of(m.q), view_of(m.p));
    });
    const double back = each([&](Matrix& m) {
      bagua::low_rank_project_back(*compute, m.s, view_of(m.state), view_of(m.p), view_of(m.q));
    });
    const double reconstruct = each([&](Matrix& m) {
      bagua::low_rank_write_approximation(m.s, view_of(m.grad), view_of(m.p), view_of(m.q));
    });
    fmt::print("{:>5} {:>7.2f} {:>5.1f}  {:>7.2f} {:>5.1f}  {:>7.2f} {:>5.1f}\n", rank,
               project * 1e3, bytes / project / 1e9, back * 1e3, bytes / back / 1e9,
               reconstruct * 1e3, bytes / reconstruct / 1e9);
    report.push_back({{"rank", rank},
                      {"m_bytes", bytes},
                      {"project_ms", project * 1e3},
                      {"project_back_ms", back * 1e3},
                      {"reconstruct_ms", reconstruct * 1e3}});
  }
  std::ofstream(json_path) << report.dump(2) << "\n";
  fmt::print("wrote {}\n", json_path);
}

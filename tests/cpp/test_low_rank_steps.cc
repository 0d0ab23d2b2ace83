// PowerSGD's deferred error feedback (bagua/ops/low_rank_steps.h) against
// the materialized one: over several steps both give the same bits, in the
// averaged gradient, in P and Q, and in the error a checkpoint saves; and
// the AVX2 build of the host passes against the baseline build, bit for bit.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "bagua/core/host_threads.h"
#include "bagua/core/host_vectors.h"
#include "bagua/ops/low_rank_steps.h"
#include "typed_buffer.h"

using namespace bagua;
using bagua::testing::TypedBuffer;

namespace {

struct Buffers {
  TypedBuffer m, error, q, p;
  Buffers(DType dtype, LowRankShape s)
      : m(dtype, s.rows * s.cols),
        error(dtype, s.rows * s.cols),
        q(dtype, s.cols * s.rank),
        p(dtype, s.rows * s.rank) {}
};

bool same_bits(TypedBuffer& a, TypedBuffer& b) {
  const TensorView x = a.view();
  const TensorView y = b.view();
  return x.numel == y.numel && std::memcmp(x.data, y.data, x.nbytes()) == 0;
}

void fill_gradient(TypedBuffer& grad, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  for (std::int64_t i = 0; i < grad.numel(); ++i) grad.set(i, normal(rng));
}

// One PowerSGD step of each error scheme on the host, without the exchange.
// materialized: M += error, P = M Q, ..., error = M - P Q^T, M = P Q^T.
// deferred: M kept apart (in deferred.error), the gradient `grad` only
// written at the end, the factors kept in p_prev and q_prev.
void one_step_of_both_schemes(Compute& c, LowRankShape s, Buffers& materialized, Buffers& deferred,
                              TypedBuffer& grad, TypedBuffer& p_prev, TypedBuffer& q_prev) {
  low_rank_project(c, s, materialized.m.view(), materialized.error.view(), materialized.q.view(),
                   materialized.p.view());
  orthogonalize_columns(c, s, materialized.p.view(), 0.0);
  low_rank_project_back(c, s, materialized.m.view(), materialized.p.view(), materialized.q.view());
  low_rank_reconstruct(c, s, materialized.m.view(), materialized.error.view(),
                       materialized.p.view(), materialized.q.view());
  low_rank_project_deferred(s, grad.view(), deferred.error.view(), p_prev.view(), q_prev.view(),
                            deferred.q.view(), deferred.p.view());
  orthogonalize_columns(c, s, deferred.p.view(), 0.0);
  low_rank_project_back(c, s, deferred.error.view(), deferred.p.view(), deferred.q.view());
  low_rank_write_approximation(s, grad.view(), deferred.p.view(), deferred.q.view());
  std::memcpy(p_prev.view().data, deferred.p.view().data, p_prev.view().nbytes());
  std::memcpy(q_prev.view().data, deferred.q.view().data, q_prev.view().nbytes());
  c.finish("test", std::chrono::milliseconds(10000));
}

void run_deferred_against_materialized(DType dtype, LowRankShape s) {
  auto compute = compute_for(Device{});
  Compute& c = *compute;
  Buffers materialized(dtype, s);
  Buffers deferred(dtype, s);  // deferred.error holds M
  TypedBuffer p_prev(dtype, s.rows * s.rank), q_prev(dtype, s.cols * s.rank);
  TypedBuffer grad(dtype, s.rows * s.cols), error_of_state(dtype, s.rows * s.cols);
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  for (std::int64_t i = 0; i < s.cols * s.rank; ++i) {
    const double v = normal(rng);
    materialized.q.set(i, v);
    deferred.q.set(i, v);
  }
  for (int step = 0; step < 4; ++step) {
    CAPTURE(step);
    fill_gradient(materialized.m, rng);
    std::memcpy(grad.view().data, materialized.m.view().data, grad.view().nbytes());
    one_step_of_both_schemes(c, s, materialized, deferred, grad, p_prev, q_prev);

    CHECK(same_bits(materialized.p, deferred.p));
    CHECK(same_bits(materialized.q, deferred.q));
    CHECK(same_bits(materialized.m, grad));  // the average the optimizer gets
    low_rank_deferred_error(s, deferred.error.view(), p_prev.view(), q_prev.view(),
                            error_of_state.view());
    CHECK(same_bits(materialized.error, error_of_state));  // what a checkpoint saves
  }
}

}  // namespace

TEST_CASE("deferred error feedback gives the bits of the materialized error") {
  for (const DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (const LowRankShape s :
         {LowRankShape{37, 23, 1}, LowRankShape{5, 300, 3}, LowRankShape{64, 9, 2},
          LowRankShape{19, 41, 4},
          LowRankShape{11, 70, 5}}) {  // 1-4 compiled, 5 through the row buffer
      CAPTURE(to_string(dtype));
      CAPTURE(s.rows);
      CAPTURE(s.rank);
      run_deferred_against_materialized(dtype, s);
    }
  }
}

TEST_CASE("with p_prev all zeros the deferred error is the state itself") {
  const LowRankShape s{6, 4, 2};
  TypedBuffer base(DType::kFloat32, 24), p_prev(DType::kFloat32, 12), q_prev(DType::kFloat32, 8),
      error(DType::kFloat32, 24);
  std::mt19937 rng(3);
  fill_gradient(base, rng);
  fill_gradient(q_prev, rng);
  for (std::int64_t i = 0; i < 12; ++i) p_prev.set(i, 0.0);
  low_rank_deferred_error(s, base.view(), p_prev.view(), q_prev.view(), error.view());
  CHECK(same_bits(base, error));
}

TEST_CASE("the deferred steps refuse device memory") {
  const LowRankShape s{2, 2, 1};
  TypedBuffer a(DType::kFloat32, 4), b(DType::kFloat32, 2);
  TensorView on_device = a.view();
  on_device.device = Device{DeviceType::kCUDA, 0};
  CHECK_THROWS_AS(low_rank_write_approximation(s, on_device, b.view(), b.view()), InvalidArgument);
}

namespace {

// Q = M^T P summed the plain way: every sum takes row i's term after row
// i - 1's, in the compute type (float for 16-bit types).
template <typename C>
void reference_project_back(LowRankShape s, TypedBuffer& m, TypedBuffer& p, TypedBuffer& q) {
  std::vector<C> sums(static_cast<std::size_t>(s.cols * s.rank), C{0});
  for (std::int64_t i = 0; i < s.rows; ++i) {
    for (std::int64_t k = 0; k < s.rank; ++k) {
      const C weight = static_cast<C>(p.get(i * s.rank + k));
      for (std::int64_t j = 0; j < s.cols; ++j)
        sums[k * s.cols + j] += weight * static_cast<C>(m.get(i * s.cols + j));
    }
  }
  for (std::int64_t j = 0; j < s.cols; ++j) {
    for (std::int64_t k = 0; k < s.rank; ++k) q.set(j * s.rank + k, sums[k * s.cols + j]);
  }
}

}  // namespace

TEST_CASE("Q = M^T P, rows taken in blocks, gives the bits of the row-by-row sums") {
  auto compute = compute_for(Device{});
  for (const DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (const std::int64_t rows : {1, 3, 4, 9, 13}) {
      for (std::int64_t rank = 1; rank <= 5; ++rank) {
        const LowRankShape s{rows, 37, rank};
        CAPTURE(to_string(dtype));
        CAPTURE(rows);
        CAPTURE(rank);
        Buffers b(dtype, s);
        TypedBuffer expected(dtype, s.cols * s.rank);
        std::mt19937 rng(static_cast<unsigned>(rows * 10 + rank));
        fill_gradient(b.m, rng);
        fill_gradient(b.p, rng);
        low_rank_project_back(*compute, s, b.m.view(), b.p.view(), b.q.view());
        if (dtype == DType::kFloat64) {
          reference_project_back<double>(s, b.m, b.p, expected);
        } else {
          reference_project_back<float>(s, b.m, b.p, expected);
        }
        CHECK(same_bits(b.q, expected));
      }
    }
  }
}

namespace {

// Every host pass of both error schemes, three steps, on one shape: the bytes
// of all outputs (factors, averages, errors, state) one after another.
std::vector<unsigned char> outputs_of_all_passes(DType dtype, LowRankShape s) {
  auto compute = compute_for(Device{});
  Compute& c = *compute;
  Buffers materialized(dtype, s);
  Buffers deferred(dtype, s);
  TypedBuffer p_prev(dtype, s.rows * s.rank), q_prev(dtype, s.cols * s.rank);
  TypedBuffer grad(dtype, s.rows * s.cols);
  std::mt19937 rng(11);
  fill_gradient(materialized.q, rng);
  fill_gradient(deferred.q, rng);
  std::vector<unsigned char> bytes;
  const auto keep = [&](TypedBuffer& b) {
    const TensorView v = b.view();
    const auto* first = static_cast<const unsigned char*>(v.data);
    bytes.insert(bytes.end(), first, first + v.nbytes());
  };
  for (int step = 0; step < 3; ++step) {
    fill_gradient(materialized.m, rng);
    fill_gradient(grad, rng);
    one_step_of_both_schemes(c, s, materialized, deferred, grad, p_prev, q_prev);
    for (TypedBuffer* b : {&materialized.m, &materialized.error, &materialized.p, &materialized.q,
                           &grad, &deferred.error, &deferred.p, &deferred.q})
      keep(*b);
  }
  return bytes;
}

}  // namespace

TEST_CASE("with_widest_host_vectors runs the build that set_host_avx2 asks for") {
  const auto width_run = [] {
    int bytes = 0;
    with_widest_host_vectors([&](auto vector_bytes) { bytes = decltype(vector_bytes)::value; });
    return bytes;
  };
#if defined(__AVX2__)
  CHECK(width_run() == 32);  // built for AVX2 as a whole: one build
#else
  set_host_avx2(false);
  CHECK_FALSE(host_avx2_enabled());
  CHECK(width_run() == 16);
  set_host_avx2(true);
  if (host_avx2_enabled()) CHECK(width_run() == 32);
#endif
}

TEST_CASE("the AVX2 build of the host passes gives the bits of the baseline build") {
  if (!host_avx2_enabled()) {
    MESSAGE("this CPU has no AVX2: only the baseline build runs");
    return;
  }
  for (const DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (const LowRankShape s :
         {LowRankShape{37, 23, 1}, LowRankShape{5, 300, 3}, LowRankShape{64, 9, 2},
          LowRankShape{19, 41, 4}, LowRankShape{11, 70, 5}, LowRankShape{13, 1031, 2}}) {
      CAPTURE(to_string(dtype));
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      CAPTURE(s.rank);
      set_host_avx2(false);
      const auto baseline = outputs_of_all_passes(dtype, s);
      set_host_avx2(true);
      const auto avx2 = outputs_of_all_passes(dtype, s);
      CHECK(baseline == avx2);
    }
  }
}

TEST_CASE("the host passes give the same bits on one thread and on several") {
  const int before = host_threads();
  for (const DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16}) {
    for (const LowRankShape s : {LowRankShape{2000, 200, 3}, LowRankShape{777, 1031, 1},
                                 LowRankShape{1500, 131, 4}, LowRankShape{900, 300, 5}}) {
      CAPTURE(to_string(dtype));
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      CAPTURE(s.rank);
      set_host_threads(1);
      const auto one = outputs_of_all_passes(dtype, s);
      for (const int threads : {2, 3, 5}) {
        CAPTURE(threads);
        set_host_threads(threads);
        const std::int64_t cut = host_ranges_cut();
        CHECK(outputs_of_all_passes(dtype, s) == one);
        // The deferred project, the project back and the reconstruction each
        // cut every step (3 steps): the comparison is not of one thread twice.
        CHECK(host_ranges_cut() - cut >= 9);
      }
    }
  }
  set_host_threads(before);
}

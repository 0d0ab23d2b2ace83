// C_HP_S (Float16Grad's op, PyTorch DDP's fp16_compress_hook) at 1 to 5
// ranks as threads, against the hook's steps computed here from every
// rank's known input: float16(x), divided by the world size in float and
// rounded to float16 again, summed in float16, back to the bucket's dtype.
// Sizes 0, 1 and not divisible by the world size; flat, unflattened and
// hierarchical buckets; float32, float64 and float16 buckets; bfloat16 and
// integer buckets refused; half of C_FP_S's bytes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bagua/core/half.h"
#include "bagua/ops/centralized_half_precision.h"
#include "bagua/ops/centralized_synchronous.h"
#include "rank_threads.h"
#include "typed_buffer.h"

using namespace bagua;
using bagua::testing::TypedBuffer;

namespace {

const std::vector<std::int64_t> kSizes{0, 1, 7, 1001};
constexpr int kLocalSize = 2;  // ranks per node of the hierarchical runs

std::shared_ptr<Communicator> all_ranks(Communicator& comm) {
  std::vector<int> ranks(static_cast<std::size_t>(comm.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return comm.new_group(ranks);
}

// Rank `rank`'s n inputs as stored in a `dtype` tensor: signed, magnitudes
// from 2^-20 (float16 subnormals, more so once divided) to 2^12, so that
// the conversion, the division and the additions all round.
std::vector<double> stored_inputs(DType dtype, int rank, std::int64_t n) {
  std::mt19937 gen(static_cast<unsigned>(1000 * rank + n));
  std::uniform_int_distribution<int> exponent(-20, 12);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  TypedBuffer stored(dtype, 1);
  std::vector<double> x(static_cast<std::size_t>(n));
  for (auto& v : x) {
    const double sign = gen() % 2 == 0 ? 1.0 : -1.0;
    stored.set(0, sign * std::ldexp(mantissa(gen), exponent(gen)));
    v = stored.get(0);
  }
  return x;
}

// What a rank communicates for a stored value (the hook's
// buffer.to(float16).div_(world)); float64 goes through float, as
// PyTorch's conversion does.
float hook_half(double stored, int world, bool average) {
  Half h(static_cast<float>(stored));
  if (average) h = Half(static_cast<float>(h) / static_cast<float>(world));
  return static_cast<float>(h);
}

// a + b as the communicators add float16: in float, rounded to float16.
float half_add(float a, float b) { return static_cast<float>(Half(a + b)); }

// The ranks of each node: one node of every rank when flat.
std::vector<std::vector<int>> nodes_of(int world, bool hierarchical) {
  const int local = hierarchical ? kLocalSize : world;
  std::vector<std::vector<int>> nodes;
  for (int r = 0; r < world; ++r) {
    if (r % local == 0) nodes.emplace_back();
    nodes.back().push_back(r);
  }
  return nodes;
}

// Checks C_HP_S's result `got` from every rank's float16 value `halves`.
// With at most two terms per sum (two ranks per node, two nodes) the bits
// are determined: each node sums its ranks, the leaders sum the nodes'
// sums, every addition rounded to float16. Otherwise the collective chooses
// the order of the additions, and `got` must be a float16 value within the
// rounding of world - 1 float16 additions of the exact sum.
void check_reduced(double got, const std::vector<float>& halves,
                   const std::vector<std::vector<int>>& nodes) {
  CHECK(static_cast<double>(static_cast<float>(Half(static_cast<float>(got)))) == got);
  bool determined = nodes.size() <= 2;
  float total = 0.0f;
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    determined = determined && nodes[k].size() <= 2;
    float node_sum = halves[static_cast<std::size_t>(nodes[k].front())];
    for (std::size_t j = 1; j < nodes[k].size(); ++j)
      node_sum = half_add(node_sum, halves[static_cast<std::size_t>(nodes[k][j])]);
    total = k == 0 ? node_sum : half_add(total, node_sum);
  }
  if (determined) {
    REQUIRE(got == static_cast<double>(total));
    return;
  }
  double exact = 0.0, magnitude = 0.0;
  for (float h : halves) {
    exact += h;
    magnitude += std::abs(h);
  }
  const double additions = static_cast<double>(halves.size() - 1);
  REQUIRE(std::abs(got - exact) <= additions * (std::ldexp(magnitude, -11) + std::ldexp(1.0, -25)));
}

struct Run {
  DType dtype = DType::kFloat32;
  bool hierarchical = false;
  bool average = true;
  bool flattened = true;  // else each of the two tensors in its own memory
};

// Rank `comm.rank()`'s result of one C_HP_S execution over n elements: a
// bucket of two tensors of unequal sizes (one when n < 3).
std::vector<double> execute_on_rank(Communicator& comm, const Run& run, std::int64_t n) {
  auto bucket_comm = all_ranks(comm);
  auto hierarchy =
      run.hierarchical
          ? std::make_shared<HierarchicalComms>(make_hierarchical_comms(*bucket_comm, kLocalSize))
          : nullptr;
  const auto inputs = stored_inputs(run.dtype, comm.rank(), n);
  const std::int64_t first = n / 3;
  TypedBuffer whole(run.dtype, n), a(run.dtype, first), b(run.dtype, n - first);
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = inputs[static_cast<std::size_t>(i)];
    whole.set(i, v);
    i < first ? a.set(i, v) : b.set(i - first, v);
  }
  std::vector<BucketTensor> tensors;
  if (run.flattened) {
    tensors = {{"a", whole.view().slice(0, first)}, {"b", whole.view().slice(first, n - first)}};
  } else {
    tensors = {{"a", a.view()}, {"b", b.view()}};
  }
  if (first == 0) tensors.erase(tensors.begin());
  Bucket bucket("fp16", tensors);
  bucket.append_op(std::make_shared<CentralizedHalfPrecisionOp>(
      bucket_comm, hierarchy, run.dtype,
      CentralizedHalfPrecisionOptions{.hierarchical = run.hierarchical, .average = run.average}));
  bucket.ops().front()->execute(bucket);
  std::vector<double> result(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    result[static_cast<std::size_t>(i)] =
        run.flattened ? whole.get(i) : (i < first ? a.get(i) : b.get(i - first));
  }
  return result;
}

// Runs C_HP_S at `world` ranks over every size and checks each rank's
// result against the hook's reference, and that all ranks agree.
void check_world(int world, const Run& run) {
  std::vector<std::vector<std::vector<double>>> results(static_cast<std::size_t>(world));
  testing::run_ranks(world, [&](Communicator& comm) {
    for (std::int64_t n : kSizes)
      results[static_cast<std::size_t>(comm.rank())].push_back(execute_on_rank(comm, run, n));
  });
  const auto nodes = nodes_of(world, run.hierarchical);
  for (std::size_t s = 0; s < kSizes.size(); ++s) {
    const std::int64_t n = kSizes[s];
    CAPTURE(n);
    std::vector<std::vector<double>> inputs;
    for (int r = 0; r < world; ++r) inputs.push_back(stored_inputs(run.dtype, r, n));
    for (std::int64_t i = 0; i < n; ++i) {
      CAPTURE(i);
      std::vector<float> halves;
      for (const auto& x : inputs)
        halves.push_back(hook_half(x[static_cast<std::size_t>(i)], world, run.average));
      check_reduced(results[0][s][static_cast<std::size_t>(i)], halves, nodes);
      for (int r = 1; r < world; ++r)
        REQUIRE(results[static_cast<std::size_t>(r)][s][static_cast<std::size_t>(i)] ==
                results[0][s][static_cast<std::size_t>(i)]);
    }
  }
}

}  // namespace

TEST_CASE("C_HP_S equals DDP's fp16 hook on float32 buckets: flat, unflattened, hierarchical") {
  for (int world = 1; world <= 5; ++world) {
    for (bool hierarchical : {false, true}) {
      for (bool average : {true, false}) {
        for (bool flattened : {true, false}) {
          CAPTURE(world);
          CAPTURE(hierarchical);
          CAPTURE(average);
          CAPTURE(flattened);
          check_world(world, Run{.dtype = DType::kFloat32,
                                 .hierarchical = hierarchical,
                                 .average = average,
                                 .flattened = flattened});
        }
      }
    }
  }
}

TEST_CASE("C_HP_S on float64 buckets (through float16) and float16 buckets (in place)") {
  for (DType dtype : {DType::kFloat64, DType::kFloat16}) {
    for (int world = 1; world <= 5; ++world) {
      for (bool hierarchical : {false, true}) {
        CAPTURE(to_string(dtype));
        CAPTURE(world);
        CAPTURE(hierarchical);
        check_world(world, Run{.dtype = dtype, .hierarchical = hierarchical, .average = true});
      }
    }
  }
}

TEST_CASE("C_HP_S refuses bfloat16 and integer buckets when it is made") {
  testing::run_ranks(1, [&](Communicator& comm) {
    auto bucket_comm = all_ranks(comm);
    const auto make = [&](DType dtype) {
      return CentralizedHalfPrecisionOp(bucket_comm, nullptr, dtype, {});
    };
    CHECK_THROWS_WITH_AS(make(DType::kBFloat16), doctest::Contains("compression=None"),
                         InvalidArgument);
    for (DType dtype : {DType::kInt32, DType::kInt64, DType::kUInt8}) {
      CAPTURE(to_string(dtype));
      CHECK_THROWS_WITH_AS(make(dtype), doctest::Contains(std::string(to_string(dtype)).c_str()),
                           InvalidArgument);
    }
    CHECK_THROWS_AS(CentralizedHalfPrecisionOp(bucket_comm, nullptr, DType::kFloat32,
                                               {.hierarchical = true, .average = true}),
                    InvalidArgument);  // hierarchical without the node communicators
  });
}

TEST_CASE("C_HP_S moves half of C_FP_S's bytes for float32") {
  testing::run_ranks(4, [&](Communicator& comm) {
    auto bucket_comm = all_ranks(comm);
    std::vector<float> x(100'000, 1.0f);
    const TensorView view{x.data(), static_cast<std::int64_t>(x.size()), DType::kFloat32, {}};
    Bucket full("full", {{"x", view}});
    full.append_op(std::make_shared<CentralizedSynchronousOp>(bucket_comm, nullptr,
                                                              CentralizedSynchronousOptions{}));
    full.ops().front()->execute(full);
    Bucket half("half", {{"x", view}});
    half.append_op(std::make_shared<CentralizedHalfPrecisionOp>(
        bucket_comm, nullptr, DType::kFloat32, CentralizedHalfPrecisionOptions{}));
    half.ops().front()->execute(half);
    CHECK(full.ops().front()->bytes_sent() == 2 * half.ops().front()->bytes_sent());
  });
}

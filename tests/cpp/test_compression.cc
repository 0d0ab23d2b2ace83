// MinMaxUInt8: the error bound over random sizes and ranges, the rule for
// constant chunks and non-finite values, the byte layout; C_LP_S against an
// exact allreduce; error feedback; D_LP_S ring consistency and its
// generalisation to any static graph (low-precision neighbour allreduce).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/ops/centralized_low_precision.h"
#include "bagua/ops/centralized_synchronous.h"
#include "bagua/ops/decentralized_low_precision.h"
#include "bagua/ops/low_precision_neighbor_allreduce.h"
#include "rank_threads.h"
#include "typed_buffer.h"

using namespace bagua;
using bagua::testing::TypedBuffer;
namespace q = bagua::minmax_uint8;

namespace {

const std::vector<DType> kFloatTypes{DType::kFloat32, DType::kFloat64, DType::kFloat16,
                                     DType::kBFloat16};

// Rounding of storing a float into `dtype`, relative.
double storage_epsilon(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return 1.0 / 2048;
    case DType::kBFloat16: return 1.0 / 256;
    default: return 1.0 / (1 << 24);
  }
}

}  // namespace

TEST_CASE("MinMaxUInt8 round trip stays within (max - min) / 510 plus float rounding") {
  std::mt19937 rng(1234);
  std::vector<std::int64_t> sizes{0, 1, 2, 3, 7, 255, 256, 1000, 4097};
  for (int i = 0; i < 20; ++i) sizes.push_back(std::uniform_int_distribution<int>(1, 5000)(rng));
  for (DType dtype : kFloatTypes) {
    for (std::int64_t n : sizes) {
      for (double magnitude : {1e-3, 1.0, 37.0, 1e3}) {
        for (double offset : {0.0, 5.0, -100.0}) {
          CAPTURE(to_string(dtype));
          CAPTURE(n);
          CAPTURE(magnitude);
          CAPTURE(offset);
          TypedBuffer x(dtype, n), y(dtype, n);
          std::uniform_real_distribution<double> value(-magnitude, magnitude);
          for (std::int64_t i = 0; i < n; ++i) x.set(i, offset + value(rng));
          std::vector<std::byte> packed(q::compressed_bytes(n));
          q::compress_view(x.view(), packed.data());
          q::decompress_view(packed.data(), y.view(), false);
          double lo = 0, hi = 0, max_abs = 0;
          for (std::int64_t i = 0; i < n; ++i) {
            lo = i == 0 ? x.get(i) : std::min(lo, x.get(i));
            hi = i == 0 ? x.get(i) : std::max(hi, x.get(i));
            max_abs = std::max(max_abs, std::abs(x.get(i)));
          }
          // Header holds the float min and max.
          float header[2];
          std::memcpy(header, packed.data(), sizeof(header));
          if (n > 0) {
            CHECK(header[0] == static_cast<float>(lo));
            CHECK(header[1] == static_cast<float>(hi));
          }
          const double bound = (hi - lo) / 255.0 / 2.0 + 4.0 * max_abs / (1 << 24) + 1e-7 +
                               storage_epsilon(dtype) * max_abs;
          for (std::int64_t i = 0; i < n; ++i) REQUIRE(std::abs(y.get(i) - x.get(i)) <= bound);
          // Decompressing with accumulate adds to what is there.
          TypedBuffer z(DType::kFloat64, n);
          for (std::int64_t i = 0; i < n; ++i) z.set(i, 1.0);
          q::decompress_view(packed.data(), z.view(), true);
          for (std::int64_t i = 0; i < n; ++i) {
            REQUIRE(std::abs(z.get(i) - 1.0 - x.get(i)) <= bound + 1e-9);
          }
        }
      }
    }
  }
}

TEST_CASE("MinMaxUInt8 rules: constant chunks are exact, non-finite chunks decode to NaN") {
  std::vector<float> constant(17, 3.25f), out(17, 0.0f);
  std::vector<std::byte> packed(q::compressed_bytes(17));
  q::compress<float>(constant.data(), 17, packed.data());
  q::decompress<float>(packed.data(), 17, out.data(), false);
  for (float v : out) CHECK(v == 3.25f);

  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x{1.0f, 2.0f, bad, 4.0f};
    std::vector<float> y(4, 0.0f);
    std::vector<std::byte> bytes(q::compressed_bytes(4));
    q::compress<float>(x.data(), 4, bytes.data());
    q::decompress<float>(bytes.data(), 4, y.data(), false);
    for (float v : y) CHECK(std::isnan(v));
  }
  // The extremes decode to themselves within the bound (here exactly for 0 and 255 levels).
  std::vector<float> x{-1.0f, 0.0f, 1.0f};
  std::vector<float> y(3);
  std::vector<std::byte> bytes(q::compressed_bytes(3));
  q::compress<float>(x.data(), 3, bytes.data());
  q::decompress<float>(bytes.data(), 3, y.data(), false);
  for (int i = 0; i < 3; ++i) CHECK(std::abs(y[i] - x[i]) <= 2.0f / 510.0f + 1e-6f);
  CHECK_THROWS_AS(check_compressible(DType::kInt32, "test"), InvalidArgument);
}

namespace {

// Rank r's input: values in [-(r+1), r+1].
std::vector<float> lp_input(int rank, std::int64_t n, int seed) {
  std::mt19937 rng(static_cast<unsigned>(seed * 101 + rank));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = value(rng) * static_cast<float>(rank + 1);
  return x;
}

std::shared_ptr<Communicator> all_ranks(Communicator& comm) {
  std::vector<int> ranks(static_cast<std::size_t>(comm.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return comm.new_group(ranks);
}

TensorView view_of(std::vector<float>& v) {
  return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kFloat32, {}};
}

}  // namespace

TEST_CASE("C_LP_S matches an exact allreduce within the quantization bound") {
  for (int world = 1; world <= 5; ++world) {
    for (bool hierarchical : {false, true}) {
      for (bool average : {true, false}) {
        CAPTURE(world);
        CAPTURE(hierarchical);
        CAPTURE(average);
        testing::run_ranks(world, [&](Communicator& comm) {
          auto bucket_comm = all_ranks(comm);
          auto hierarchy =
              std::make_shared<HierarchicalComms>(make_hierarchical_comms(*bucket_comm, 2));
          for (std::int64_t n : {std::int64_t{1}, std::int64_t{13}, std::int64_t{1001}}) {
            // Two tensors of unequal size in one bucket, not flattened.
            const std::int64_t first = n / 3;
            auto x = lp_input(comm.rank(), n, static_cast<int>(n));
            std::vector<float> a(x.begin(), x.begin() + first), b(x.begin() + first, x.end());
            std::vector<BucketTensor> tensors{{"a", view_of(a)}, {"b", view_of(b)}};
            if (first == 0) tensors.erase(tensors.begin());
            Bucket bucket("lp", tensors);
            bucket.append_op(std::make_unique<CentralizedLowPrecisionOp>(
                bucket_comm, hierarchy, DType::kFloat32,
                CentralizedLowPrecisionOptions{
                    .hierarchical = hierarchical, .average = average, .error_feedback = false}));
            bucket.ops().front()->execute(bucket);
            std::vector<float> result(a);
            result.insert(result.end(), b.begin(), b.end());
            // Exact reference: every rank's input is known here.
            double range_sum = 0;
            for (int r = 0; r < world; ++r) range_sum += 2.0 * (r + 1);
            const double bound = 2.0 * range_sum / 510.0 / (average ? world : 1) + 1e-5;
            for (std::int64_t i = 0; i < n; ++i) {
              double exact = 0;
              for (int r = 0; r < world; ++r)
                exact += lp_input(r, n, static_cast<int>(n))[static_cast<std::size_t>(i)];
              if (average) exact /= world;
              REQUIRE(std::abs(result[static_cast<std::size_t>(i)] - exact) <= bound);
            }
          }
        });
      }
    }
  }
}

namespace {

// y = Q^-1(Q(x)) in chunks of `chunk` (MinMaxUInt8's round trip).
std::vector<float> round_trip(const std::vector<float>& x, std::int64_t chunk) {
  std::vector<float> y(x.size());
  for (std::size_t begin = 0; begin < x.size(); begin += static_cast<std::size_t>(chunk)) {
    const auto count = std::min(x.size() - begin, static_cast<std::size_t>(chunk));
    std::vector<std::byte> bytes(q::compressed_bytes(static_cast<std::int64_t>(count)));
    q::compress<float>(x.data() + begin, static_cast<std::int64_t>(count), bytes.data());
    q::decompress<float>(bytes.data(), static_cast<std::int64_t>(count), y.data() + begin, false);
  }
  return y;
}

// C_LP_S's result over elements [first, first + count) of every rank's input
// taken as a bucket of its own, computed serially: chunk j is reduced by rank
// j from its own exact copy plus the others' round trips in rank order,
// divided by the world when averaging, and round-tripped once more for the
// allgather.
std::vector<float> c_lp_s_reference(int world, std::int64_t n, int seed, bool average,
                                    std::int64_t first, std::int64_t count) {
  const std::int64_t chunk = (count + world - 1) / world;
  std::vector<float> out(static_cast<std::size_t>(count));
  for (int j = 0; j < world; ++j) {
    const std::int64_t begin = std::min<std::int64_t>(j * chunk, count);
    const std::int64_t length = std::min(chunk, count - begin);
    if (length == 0) continue;
    auto part = [&](int r) {
      const auto x = lp_input(r, n, seed);
      return std::vector<float>(x.begin() + first + begin, x.begin() + first + begin + length);
    };
    std::vector<float> acc = part(j);
    for (int r = 0; r < world; ++r) {
      if (r == j) continue;
      const auto decoded = round_trip(part(r), chunk);
      for (std::int64_t i = 0; i < length; ++i)
        acc[static_cast<std::size_t>(i)] += decoded[static_cast<std::size_t>(i)];
    }
    if (average) {
      for (auto& v : acc) v = v / static_cast<float>(world);
    }
    const auto reduced = round_trip(acc, chunk);
    std::copy(reduced.begin(), reduced.end(), out.begin() + begin);
  }
  return out;
}

std::vector<float> c_lp_s_reference(int world, std::int64_t n, int seed, bool average) {
  return c_lp_s_reference(world, n, seed, average, 0, n);
}

}  // namespace

TEST_CASE("C_LP_S equals its serial reference: the own chunk exact, the others round-tripped") {
  for (int world = 1; world <= 5; ++world) {
    for (bool average : {true, false}) {
      for (bool feedback : {false, true}) {  // the first step's residuals are zero
        CAPTURE(world);
        CAPTURE(average);
        CAPTURE(feedback);
        testing::run_ranks(world, [&](Communicator& comm) {
          auto bucket_comm = all_ranks(comm);
          for (std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}}) {
            CAPTURE(n);
            auto x = lp_input(comm.rank(), n, 3);
            Bucket bucket("exact", {{"x", view_of(x)}});
            bucket.append_op(std::make_unique<CentralizedLowPrecisionOp>(
                bucket_comm, nullptr, DType::kFloat32,
                CentralizedLowPrecisionOptions{
                    .hierarchical = false, .average = average, .error_feedback = feedback}));
            bucket.ops().front()->execute(bucket);
            const auto expected = c_lp_s_reference(world, n, 3, average);
            for (std::int64_t i = 0; i < n; ++i) {
              CAPTURE(i);
              REQUIRE(x[static_cast<std::size_t>(i)] == expected[static_cast<std::size_t>(i)]);
            }
          }
        });
      }
    }
  }
}

TEST_CASE(
    "C_LP_S in segments: each segment reduced as a bucket of its own, pipelined on the host") {
  struct Shape {
    std::int64_t n, segment;
  };
  // Short last segments, a segment of 1, a segment shorter than the world.
  const Shape shapes[] = {{1001, 100}, {1000, 333}, {7, 3}, {13, 1}, {1001, 1000}, {4096, 512}};
  for (int world = 1; world <= 5; ++world) {
    for (bool average : {true, false}) {
      CAPTURE(world);
      CAPTURE(average);
      testing::run_ranks(world, [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        for (const Shape& shape : shapes) {
          CAPTURE(shape.n);
          CAPTURE(shape.segment);
          auto x = lp_input(comm.rank(), shape.n, 11);
          Bucket bucket("segments", {{"x", view_of(x)}});
          auto op = std::make_shared<CentralizedLowPrecisionOp>(
              bucket_comm, nullptr, DType::kFloat32,
              CentralizedLowPrecisionOptions{.average = average,
                                             .segment_elements = shape.segment});
          bucket.append_op(op);
          op->execute(bucket);
          const std::int64_t segments = (shape.n + shape.segment - 1) / shape.segment;
          CHECK(op->pipelined_segments() == (segments > 1 ? segments : 0));
          for (std::int64_t first = 0; first < shape.n; first += shape.segment) {
            const std::int64_t count = std::min(shape.segment, shape.n - first);
            const auto expected = c_lp_s_reference(world, shape.n, 11, average, first, count);
            for (std::int64_t i = 0; i < count; ++i) {
              CAPTURE(first + i);
              REQUIRE(x[static_cast<std::size_t>(first + i)] ==
                      expected[static_cast<std::size_t>(i)]);
            }
          }
        }
      });
    }
  }
}

TEST_CASE("C_LP_S: a segment that differs between ranks is an error on every rank") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      auto bucket_comm = all_ranks(comm);
      auto x = lp_input(comm.rank(), 1000, 5);
      const auto before = x;
      Bucket bucket("mismatched", {{"x", view_of(x)}});
      // rank 1 alone cuts the bucket in two; the others would send it whole
      auto op = std::make_shared<CentralizedLowPrecisionOp>(
          bucket_comm, nullptr, DType::kFloat32,
          CentralizedLowPrecisionOptions{.segment_elements = comm.rank() == 1 ? 500 : 4096});
      bucket.append_op(op);
      CHECK_THROWS_WITH_AS(op->execute(bucket),
                           doctest::Contains("BAGUA_LOW_PRECISION_SEGMENT) on rank"),
                           InvalidArgument);
      CHECK(x == before);  // nothing was sent or written
    });
  }
}

TEST_CASE("C_LP_S in segments, other dtypes (no pipeline): each segment as a bucket of its own") {
  for (int world : {1, 2, 3, 5}) {
    for (DType dtype : {DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
      CAPTURE(world);
      CAPTURE(to_string(dtype));
      testing::run_ranks(world, [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        const std::int64_t n = 1001, segment = 300;
        const auto x = lp_input(comm.rank(), n, 13);
        TypedBuffer whole(dtype, n);
        for (std::int64_t i = 0; i < n; ++i) whole.set(i, x[static_cast<std::size_t>(i)]);
        Bucket bucket("whole", {{"x", whole.view()}});
        auto op = std::make_shared<CentralizedLowPrecisionOp>(
            bucket_comm, nullptr, dtype,
            CentralizedLowPrecisionOptions{.segment_elements = segment});
        bucket.append_op(op);
        op->execute(bucket);
        CHECK(op->pipelined_segments() == 0);
        for (std::int64_t first = 0; first < n; first += segment) {
          const std::int64_t count = std::min(segment, n - first);
          TypedBuffer part(dtype, count);
          for (std::int64_t i = 0; i < count; ++i)
            part.set(i, x[static_cast<std::size_t>(first + i)]);
          Bucket alone("alone", {{"x", part.view()}});
          alone.append_op(std::make_unique<CentralizedLowPrecisionOp>(
              bucket_comm, nullptr, dtype, CentralizedLowPrecisionOptions{}));
          alone.ops().front()->execute(alone);
          for (std::int64_t i = 0; i < count; ++i) {
            CAPTURE(first + i);
            REQUIRE(whole.get(first + i) == part.get(i));
          }
        }
      });
    }
  }
}

TEST_CASE("C_LP_S moves at most 1/3.9 of C_FP_S's bytes for fp32") {
  testing::run_ranks(4, [&](Communicator& comm) {
    auto bucket_comm = all_ranks(comm);
    auto x = lp_input(comm.rank(), 100'000, 9);
    Bucket full("full", {{"x", view_of(x)}});
    full.append_op(std::make_unique<CentralizedSynchronousOp>(bucket_comm, nullptr,
                                                              CentralizedSynchronousOptions{}));
    full.ops().front()->execute(full);
    Bucket low("low", {{"x", view_of(x)}});
    low.append_op(std::make_unique<CentralizedLowPrecisionOp>(bucket_comm, nullptr, DType::kFloat32,
                                                              CentralizedLowPrecisionOptions{}));
    low.ops().front()->execute(low);
    const auto full_bytes = full.ops().front()->bytes_sent();
    const auto low_bytes = low.ops().front()->bytes_sent();
    CAPTURE(full_bytes);
    CAPTURE(low_bytes);
    CHECK(full_bytes == 2 * 3 * 100'000 * 4 / 4);  // ring allreduce: 2(n-1)/n of the buffer
    CHECK(static_cast<double>(full_bytes) / static_cast<double>(low_bytes) >= 3.9);
  });
}

TEST_CASE("C_LP_S error feedback keeps the accumulated error at one step's size") {
  const int world = 3;
  const std::int64_t n = 301;
  const int steps = 40;
  std::vector<double> drift(2, 0.0);
  for (bool feedback : {false, true}) {
    testing::run_ranks(world, [&](Communicator& comm) {
      auto bucket_comm = all_ranks(comm);
      std::vector<float> x(static_cast<std::size_t>(n));
      Bucket bucket("ef", {{"x", view_of(x)}});
      bucket.append_op(std::make_unique<CentralizedLowPrecisionOp>(
          bucket_comm, nullptr, DType::kFloat32,
          CentralizedLowPrecisionOptions{
              .hierarchical = false, .average = true, .error_feedback = feedback}));
      std::vector<double> sum_out(static_cast<std::size_t>(n), 0.0),
          sum_exact(static_cast<std::size_t>(n), 0.0);
      for (int step = 0; step < steps; ++step) {
        const auto input = lp_input(comm.rank(), n, 5);    // the same input every step
        std::copy(input.begin(), input.end(), x.begin());  // (x's memory is the bucket's)
        bucket.ops().front()->execute(bucket);
        for (std::int64_t i = 0; i < n; ++i) {
          double exact = 0;
          for (int r = 0; r < world; ++r) exact += lp_input(r, n, 5)[static_cast<std::size_t>(i)];
          sum_exact[static_cast<std::size_t>(i)] += exact / world;
          sum_out[static_cast<std::size_t>(i)] += x[static_cast<std::size_t>(i)];
        }
      }
      double worst = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        worst = std::max(worst, std::abs(sum_out[static_cast<std::size_t>(i)] -
                                         sum_exact[static_cast<std::size_t>(i)]));
      }
      if (comm.rank() == 0) drift[feedback ? 1 : 0] = worst;
    });
  }
  CAPTURE(drift[0]);
  CAPTURE(drift[1]);
  // One step's error is at most 2 * (2 + 4 + 6) / 510 / 3 ~ 0.016.
  CHECK(drift[1] <= 0.05);
  CHECK(drift[0] > 4 * drift[1]);  // without feedback the same error adds up every step
}

TEST_CASE("D_LP_S keeps every rank's weight equal to its neighbours' copies of it") {
  for (int world = 1; world <= 5; ++world) {
    for (bool hierarchical : {false, true}) {
      CAPTURE(world);
      CAPTURE(hierarchical);
      const std::int64_t n = 1000;
      std::vector<std::vector<float>> final_w(world), final_l(world), final_r(world);
      testing::run_ranks(world, [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        auto hierarchy =
            std::make_shared<HierarchicalComms>(make_hierarchical_comms(*bucket_comm, 2));
        std::vector<float> x(static_cast<std::size_t>(n), 0.5f);
        std::vector<float> w(x), l(x), r(x);
        Bucket bucket("dlp", {{"x", view_of(x)}});
        bucket.append_op(std::make_unique<LowPrecisionDecentralizedOp>(
            bucket_comm, hierarchy, view_of(w), view_of(l), view_of(r), n, DType::kFloat32,
            LowPrecisionDecentralizedOptions{.hierarchical = hierarchical}));
        for (int step = 0; step < 5; ++step) {
          const auto update =
              lp_input(comm.rank(), n, step);  // a different "gradient step" per rank
          for (std::int64_t i = 0; i < n; ++i)
            x[static_cast<std::size_t>(i)] -= 0.1f * update[static_cast<std::size_t>(i)];
          bucket.ops().front()->execute(bucket);
          REQUIRE(x == w);
        }
        final_w[comm.rank()] = w;
        final_l[comm.rank()] = l;
        final_r[comm.rank()] = r;
      });
      // Ring among the communicating ranks: all ranks (flat) or node leaders.
      std::vector<int> ring;
      for (int rank = 0; rank < world; rank += hierarchical ? 2 : 1) ring.push_back(rank);
      const int m = static_cast<int>(ring.size());
      for (int i = 0; i < m; ++i) {
        const int me = ring[i], left = ring[(i + m - 1) % m], right = ring[(i + 1) % m];
        CHECK(final_r[left] == final_w[me]);
        CHECK(final_l[right] == final_w[me]);
      }
    }
  }
}

namespace {

// Rank r's pattern in a graph of `world` ranks: "exponential" (receive from
// r - 2^j, send to r + 2^j, uniform weights) or "star" around rank 0
// (BlueFog's StarGraph weights: the centre 1/n for everyone, a leaf keeps
// 1 - 1/n).
LowPrecisionNeighborOptions graph_pattern(const std::string& graph, int rank, int world) {
  LowPrecisionNeighborOptions o;
  if (graph == "exponential") {
    std::vector<int> hops;
    for (int h = 1; h < world; h *= 2) hops.push_back(h);
    o.self_weight = 1.0 / static_cast<double>(hops.size() + 1);
    for (int h : hops) {
      o.sources.push_back({(rank - h + world) % world, o.self_weight});
      o.destinations.push_back((rank + h) % world);
    }
    return o;
  }
  const double n = world;
  o.self_weight = rank == 0 ? 1.0 / n : 1.0 - 1.0 / n;
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank || (rank != 0 && peer != 0)) continue;
    o.sources.push_back({peer, 1.0 / n});
    o.destinations.push_back(peer);
  }
  return o;
}

}  // namespace

TEST_CASE(
    "low-precision neighbour allreduce: each step within the quantization bound of the "
    "mixing formula, and every W equal to its out-neighbours' replicas of it") {
  for (const std::string graph : {"exponential", "star"}) {
    for (int world = 1; world <= 5; ++world) {
      CAPTURE(graph);
      CAPTURE(world);
      const std::int64_t n = 1000;
      std::vector<std::vector<float>> final_w(world);
      std::vector<std::vector<std::vector<float>>> final_replicas(world);
      std::vector<LowPrecisionNeighborOptions> patterns(world);
      testing::run_ranks(world, [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        const int rank = comm.rank();
        const auto pattern = graph_pattern(graph, rank, world);
        std::vector<float> x(static_cast<std::size_t>(n), 0.5f);
        std::vector<float> w(x);
        std::vector<std::vector<float>> replicas(pattern.sources.size(), x);
        std::vector<TensorView> replica_views;
        for (auto& r : replicas) replica_views.push_back(view_of(r));
        Bucket bucket("lpn", {{"x", view_of(x)}});
        bucket.append_op(std::make_unique<LowPrecisionNeighborAllreduceOp>(
            bucket_comm, view_of(w), replica_views, n, DType::kFloat32, pattern));
        for (int step = 0; step < 5; ++step) {
          const auto update = lp_input(rank, n, step);
          for (std::int64_t i = 0; i < n; ++i)
            x[static_cast<std::size_t>(i)] -= 0.1f * update[static_cast<std::size_t>(i)];
          // d = w_ii W + sum_j w_ij X_j + (x - W) - W, exactly
          std::vector<double> d(static_cast<std::size_t>(n));
          for (std::size_t i = 0; i < d.size(); ++i) {
            double mixed = pattern.self_weight * w[i];
            for (std::size_t k = 0; k < replicas.size(); ++k)
              mixed += pattern.sources[k].weight * replicas[k][i];
            d[i] = mixed + x[i] - 2.0 * w[i];
          }
          const auto [lo, hi] = std::minmax_element(d.begin(), d.end());
          const double bound = (*hi - *lo) / 510 * 1.01 + 1e-5;
          const std::vector<float> w_before(w);
          bucket.ops().front()->execute(bucket);
          REQUIRE(x == w);
          for (std::size_t i = 0; i < d.size(); ++i)
            REQUIRE(std::abs(w[i] - w_before[i] - d[i]) <= bound);
        }
        final_w[rank] = w;
        final_replicas[rank] = replicas;
        patterns[rank] = pattern;
      });
      for (int rank = 0; rank < world; ++rank) {
        const auto& sources = patterns[rank].sources;
        for (std::size_t k = 0; k < sources.size(); ++k) {
          CHECK(final_replicas[rank][k] == final_w[sources[k].rank]);  // bit for bit
        }
      }
    }
  }
}

TEST_CASE("low-precision neighbour allreduce: bad patterns are refused") {
  testing::run_ranks(3, [&](Communicator& comm) {
    auto bucket_comm = all_ranks(comm);
    const int rank = comm.rank();
    std::vector<float> x(10, 1.0f), w(x), r(x);
    const auto make = [&](LowPrecisionNeighborOptions o, std::vector<TensorView> replicas) {
      return LowPrecisionNeighborAllreduceOp(bucket_comm, view_of(w), std::move(replicas), 10,
                                             DType::kFloat32, std::move(o));
    };
    LowPrecisionNeighborOptions self_source;
    self_source.sources = {{rank, 0.5}};
    CHECK_THROWS_AS(make(self_source, {view_of(r)}), InvalidArgument);
    LowPrecisionNeighborOptions two_sources;
    two_sources.sources = {{(rank + 1) % 3, 0.5}, {(rank + 2) % 3, 0.5}};
    CHECK_THROWS_WITH_AS(make(two_sources, {view_of(r)}),
                         doctest::Contains("one replica per source"), InvalidArgument);
    // every rank receives from its right neighbour, but sends to its right
    // neighbour too: the check at the first execution fails on every rank.
    LowPrecisionNeighborOptions mismatched{.self_weight = 0.5,
                                           .sources = {{(rank + 1) % 3, 0.5}},
                                           .destinations = {(rank + 1) % 3},
                                           .check_pattern = true};
    auto op = make(mismatched, {view_of(r)});
    Bucket bucket("bad", {{"x", view_of(x)}});
    CHECK_THROWS_WITH_AS(op.execute(bucket), doctest::Contains("do not match"), InvalidArgument);
  });
}

TEST_CASE(
    "low-precision neighbour allreduce: a neighbour that never sends fails within the "
    "timeout, naming the op, the bucket and the rank") {
  testing::run_ranks(
      2,
      [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        std::vector<float> x(10, 1.0f), w(x), r(x);
        LowPrecisionNeighborOptions pattern;
        pattern.check_pattern = false;  // rank 0 expects a message rank 1 never sends
        std::vector<TensorView> replicas;
        if (comm.rank() == 0) {
          pattern.self_weight = 0.5;
          pattern.sources = {{1, 0.5}};
          replicas.push_back(view_of(r));
        }
        LowPrecisionNeighborAllreduceOp op(bucket_comm, view_of(w), replicas, 10, DType::kFloat32,
                                           pattern);
        Bucket bucket("lpn", {{"x", view_of(x)}});
        if (comm.rank() == 0) {
          const auto start = std::chrono::steady_clock::now();
          CHECK_THROWS_WITH_AS(
              op.execute(bucket),
              doctest::Contains("low_precision_neighbor_allreduce on bucket 'lpn' (rank 0 of 2)"),
              TimeoutError);
          CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
        } else {
          op.execute(bucket);  // nothing to exchange
          std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        }
      },
      std::chrono::milliseconds(500));
}

TEST_CASE("the vectorized fp32 compressor writes the portable loop's bytes") {
  std::mt19937 rng(99);
  for (std::int64_t n : {1, 7, 8, 31, 32, 33, 100, 1000, 65537}) {
    for (float offset : {0.0f, 3.0f, -100.0f, 1e5f}) {
      for (float magnitude : {1e-3f, 1.0f, 250.0f}) {
        std::uniform_real_distribution<float> value(-magnitude, magnitude);
        std::vector<float> x(static_cast<std::size_t>(n));
        for (auto& v : x) v = offset + value(rng);
        if (n > 40) x[40] = offset;  // a repeated value
        std::vector<std::byte> fast(q::compressed_bytes(n)), portable(q::compressed_bytes(n));
        q::compress_f32(x.data(), n, fast.data());
        q::compress_f32_portable(x.data(), n, portable.data());
        CAPTURE(n);
        CAPTURE(offset);
        CAPTURE(magnitude);
        REQUIRE(fast == portable);
      }
    }
  }
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(77, 1.0f);
    x[70] = bad;  // in the scalar tail
    x[3] = 2.0f;
    std::vector<std::byte> fast(q::compressed_bytes(77)), portable(q::compressed_bytes(77));
    q::compress_f32(x.data(), 77, fast.data());
    q::compress_f32_portable(x.data(), 77, portable.data());
    CHECK(std::memcmp(fast.data() + 8, portable.data() + 8, 77) == 0);
    float header[2];
    std::memcpy(header, fast.data(), sizeof(header));
    CHECK(std::isnan(header[0]));
    x[70] = 1.0f;
    x[5] = bad;  // in the vector body
    q::compress_f32(x.data(), 77, fast.data());
    std::memcpy(header, fast.data(), sizeof(header));
    CHECK(std::isnan(header[1]));
  }
}

TEST_CASE("the vectorized fp32 decompressor writes the portable loop's values") {
  std::mt19937 rng(7);
  for (std::int64_t n : {1, 7, 8, 9, 31, 32, 33, 100, 1000, 65537}) {
    for (float offset : {0.0f, 3.0f, -100.0f, 1e5f}) {
      std::uniform_real_distribution<float> value(-250.0f, 250.0f);
      std::vector<float> x(static_cast<std::size_t>(n));
      for (auto& v : x) v = offset + value(rng);
      std::vector<std::byte> packed(q::compressed_bytes(n));
      q::compress_f32(x.data(), n, packed.data());
      for (bool accumulate : {false, true}) {
        // Start from values of their own so accumulating is visible.
        std::vector<float> fast(x.rbegin(), x.rend()), portable = fast;
        q::decompress_f32(packed.data(), n, fast.data(), accumulate);
        q::decompress_f32_portable(packed.data(), n, portable.data(), accumulate);
        CAPTURE(n);
        CAPTURE(offset);
        CAPTURE(accumulate);
        REQUIRE(std::memcmp(fast.data(), portable.data(), fast.size() * sizeof(float)) == 0);
      }
    }
  }
  // The special grids keep their rules: a constant chunk decodes to its value,
  // a non-finite one to NaN, added or not.
  std::vector<float> constant(40, 2.5f), with_nan(40, 1.0f);
  with_nan[33] = std::numeric_limits<float>::quiet_NaN();
  for (const auto* x : {&constant, &with_nan}) {
    std::vector<std::byte> packed(q::compressed_bytes(40));
    q::compress_f32(x->data(), 40, packed.data());
    std::vector<float> fast(40, 1.0f), portable(40, 1.0f);
    q::decompress_f32(packed.data(), 40, fast.data(), true);
    q::decompress_f32_portable(packed.data(), 40, portable.data(), true);
    CHECK(std::memcmp(fast.data(), portable.data(), 40 * sizeof(float)) == 0);
    CHECK((x == &constant ? fast[39] == 3.5f : std::isnan(fast[39])));
  }
}

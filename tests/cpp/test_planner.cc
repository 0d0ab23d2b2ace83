#include <doctest/doctest.h>

#include "bagua/runtime/planner.h"

using namespace bagua;

TEST_CASE("planner: ready order, size target, one dtype and device per bucket") {
  const Device cpu{};
  const std::vector<TensorDeclaration> tensors{
      {"a", 100, DType::kFloat32, cpu},  // 400 bytes
      {"b", 100, DType::kFloat32, cpu},  // 400
      {"h", 10, DType::kFloat16, cpu},   // 20, other dtype
      {"c", 300, DType::kFloat32, cpu},  // 1200 > target alone
      {"d", 50, DType::kFloat32, cpu},   // 200
      {"g", 5, DType::kFloat32, Device{DeviceType::kCUDA, 0}},
  };
  const auto plan = plan_buckets(tensors, 1000);
  // a+b fit (800); c would pass 1000 so [a, b] closes at position 1; c alone
  // (1200, over the target) closes when d arrives (position 3); [h], [d] and
  // [g] close at the end. Sorted by the position of their last tensor.
  const std::vector<std::vector<std::size_t>> expected{{0, 1}, {2}, {3}, {4}, {5}};
  CHECK(plan == expected);
  for (const auto& bucket : plan) {
    for (std::size_t i : bucket) {
      CHECK(tensors[i].dtype == tensors[bucket.front()].dtype);
      CHECK(tensors[i].device == tensors[bucket.front()].device);
    }
  }
}

TEST_CASE("planner: every tensor exactly once, deterministic, bad target rejected") {
  std::vector<TensorDeclaration> tensors;
  tensors.reserve(57);
  for (int i = 0; i < 57; ++i) {
    tensors.push_back({fmt::format("t{}", i), (i * 37) % 101 + 1,
                       i % 3 == 0 ? DType::kFloat64 : DType::kFloat32, Device{}});
  }
  const auto plan = plan_buckets(tensors, 256);
  std::vector<int> seen(tensors.size(), 0);
  for (const auto& bucket : plan) {
    std::int64_t bytes = 0;
    for (std::size_t i : bucket) {
      seen[i] += 1;
      bytes += tensors[i].nbytes();
    }
    CHECK((bucket.size() == 1 || bytes <= 256));
    for (std::size_t k = 1; k < bucket.size(); ++k) CHECK(bucket[k] > bucket[k - 1]);
  }
  for (int count : seen) CHECK(count == 1);
  CHECK(plan == plan_buckets(tensors, 256));
  CHECK_THROWS_AS(plan_buckets(tensors, 0), InvalidArgument);
  CHECK(plan_buckets({}, 10).empty());
}

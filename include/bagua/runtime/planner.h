// The bucket planner: from tensors in the order they become ready to an
// ordered list of buckets.
//
// Rules (tested in tests/cpp/test_planner.cc):
// - Tensors keep their ready order inside a bucket.
// - A bucket never mixes dtypes or devices: one bucket is open per
//   (dtype, device) and closes when adding the next tensor would pass the
//   size target. A tensor larger than the target gets a bucket of its own.
// - Buckets are ordered by the ready position of their last tensor, which is
//   when they can start communicating.
// - The plan depends only on its inputs, so ranks that pass the same profile
//   derive the same plan.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

struct TensorDeclaration {
  std::string name;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
  Device device{};

  std::int64_t nbytes() const { return numel * static_cast<std::int64_t>(dtype_size(dtype)); }
};

// Returns, per bucket, the indices into `ready_order` of its tensors.
inline std::vector<std::vector<std::size_t>> plan_buckets(
    const std::vector<TensorDeclaration>& ready_order, std::int64_t bucket_bytes) {
  BAGUA_CHECK_ARG(bucket_bytes > 0, "bucket size target must be positive, got {}", bucket_bytes);
  struct Open {
    std::vector<std::size_t> members;
    std::int64_t bytes = 0;
  };
  // (closing position, members): sorted at the end.
  std::vector<std::pair<std::size_t, std::vector<std::size_t>>> closed;
  std::map<std::pair<int, std::pair<int, int>>, Open> open;
  for (std::size_t i = 0; i < ready_order.size(); ++i) {
    const auto& tensor = ready_order[i];
    const auto key =
        std::make_pair(static_cast<int>(tensor.dtype),
                       std::make_pair(static_cast<int>(tensor.device.type), tensor.device.index));
    auto& bucket = open[key];
    if (!bucket.members.empty() && bucket.bytes + tensor.nbytes() > bucket_bytes) {
      closed.emplace_back(bucket.members.back(), std::move(bucket.members));
      bucket = Open{};
    }
    bucket.members.push_back(i);
    bucket.bytes += tensor.nbytes();
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.members.empty())
      closed.emplace_back(bucket.members.back(), std::move(bucket.members));
  }
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<std::size_t>> plan;
  plan.reserve(closed.size());
  for (auto& entry : closed) plan.push_back(std::move(entry.second));
  return plan;
}

}  // namespace bagua

// Backend-independent parts of the Communicator: cross-rank call checks and
// the hierarchical split.
#include "bagua/comm/communicator.h"

#include <algorithm>
#include <array>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {
namespace {

// FNV-1a: a stable hash of the op name, equal on every rank and build.
std::int64_t stable_hash(std::string_view text) {
  std::uint64_t hash = 1469598103934665603ULL;
  for (char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ULL;
  }
  return static_cast<std::int64_t>(hash >> 1);
}

}  // namespace

void Communicator::verify_same_call(std::string_view op, const TensorView& tensor, int root) {
  constexpr int kFields = 4;
  std::array<std::int64_t, kFields> mine{stable_hash(op), tensor.numel,
                                         static_cast<std::int64_t>(tensor.dtype), root};
  std::vector<std::int64_t> all(static_cast<std::size_t>(kFields) * size());
  allgather(TensorView{mine.data(), kFields, DType::kInt64, {}},
            TensorView{all.data(), static_cast<std::int64_t>(all.size()), DType::kInt64, {}});
  bool same = true;
  for (int r = 1; r < size(); ++r) {
    for (int f = 0; f < kFields; ++f) {
      same = same &&
             all[static_cast<std::size_t>(r) * kFields + static_cast<std::size_t>(f)] == all[f];
    }
  }
  if (same) return;
  std::string detail;
  for (int r = 0; r < size(); ++r) {
    const auto* row = &all[static_cast<std::size_t>(r) * kFields];
    detail += fmt::format("{}rank {}: {}[{}]{}", r == 0 ? "" : "; ", r,
                          to_string(static_cast<DType>(row[2])), row[1],
                          row[0] == mine[0] ? "" : " (a different op)");
    if (row[3] >= 0) detail += fmt::format(" root {}", row[3]);
  }
  throw InvalidArgument(fmt::format("{} on rank {} of {}: the ranks passed different tensors: {}",
                                    op, rank(), size(), detail));
}

HierarchicalComms make_hierarchical_comms(Communicator& global,
                                          const std::vector<int>& node_of_rank) {
  BAGUA_CHECK_ARG(static_cast<int>(node_of_rank.size()) == global.size(),
                  "hierarchical communication: {} node ids for a group of {} ranks",
                  node_of_rank.size(), global.size());
  // Nodes in order of their lowest rank; members in rank order.
  std::vector<int> node_ids;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < global.size(); ++r) {
    const auto node = node_of_rank[static_cast<std::size_t>(r)];
    const auto found = std::find(node_ids.begin(), node_ids.end(), node);
    if (found == node_ids.end()) {
      node_ids.push_back(node);
      members.push_back({r});
    } else {
      members[static_cast<std::size_t>(found - node_ids.begin())].push_back(r);
    }
  }
  HierarchicalComms comms;
  // new_group is collective: every rank takes part in creating every group,
  // in the same order, and keeps the ones it belongs to.
  std::vector<int> leaders;
  for (const auto& node : members) {
    auto group = global.new_group(node);
    if (group) {
      comms.intra = std::move(group);
      comms.local_size = static_cast<int>(node.size());
    }
    leaders.push_back(node.front());
  }
  std::sort(leaders.begin(), leaders.end());
  auto inter = global.new_group(leaders);
  if (inter) comms.inter = std::move(inter);
  BAGUA_CHECK_INTERNAL(comms.intra != nullptr, "rank {} found no intra-node group", global.rank());
  return comms;
}

HierarchicalComms make_hierarchical_comms(Communicator& global, int local_size) {
  BAGUA_CHECK_ARG(local_size >= 1, "hierarchical communication needs local_size >= 1, got {}",
                  local_size);
  std::vector<int> node_of_rank;
  node_of_rank.reserve(static_cast<std::size_t>(global.size()));
  for (int r = 0; r < global.size(); ++r) node_of_rank.push_back(r / local_size);
  return make_hierarchical_comms(global, node_of_rank);
}

}  // namespace bagua

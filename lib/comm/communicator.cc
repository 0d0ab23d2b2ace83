// Backend-independent parts of the Communicator: cross-rank call checks and
// the hierarchical split.
#include "bagua/comm/communicator.h"

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
      same = same && all[static_cast<std::size_t>(r * kFields + f)] == all[f];
    }
  }
  if (same) return;
  std::string detail;
  for (int r = 0; r < size(); ++r) {
    const auto* row = &all[static_cast<std::size_t>(r * kFields)];
    detail += fmt::format("{}rank {}: {}[{}]{}", r == 0 ? "" : "; ", r,
                          to_string(static_cast<DType>(row[2])), row[1],
                          row[0] == mine[0] ? "" : " (a different op)");
    if (row[3] >= 0) detail += fmt::format(" root {}", row[3]);
  }
  throw InvalidArgument(fmt::format("{} on rank {} of {}: the ranks passed different tensors: {}",
                                    op, rank(), size(), detail));
}

HierarchicalComms make_hierarchical_comms(Communicator& global, int local_size) {
  BAGUA_CHECK_ARG(local_size >= 1, "hierarchical communication needs local_size >= 1, got {}",
                  local_size);
  const int world = global.size();
  const int nodes = (world + local_size - 1) / local_size;
  HierarchicalComms comms;
  comms.local_size = local_size;
  // new_group is collective: every rank takes part in creating every group,
  // in the same order, and keeps the one it belongs to.
  for (int node = 0; node < nodes; ++node) {
    std::vector<int> members;
    for (int r = node * local_size; r < std::min(world, (node + 1) * local_size); ++r) {
      members.push_back(r);
    }
    auto group = global.new_group(members);
    if (group) comms.intra = std::move(group);
  }
  std::vector<int> leaders;
  for (int node = 0; node < nodes; ++node) leaders.push_back(node * local_size);
  auto inter = global.new_group(leaders);
  if (inter) comms.inter = std::move(inter);
  BAGUA_CHECK_INTERNAL(comms.intra != nullptr, "rank {} found no intra-node group", global.rank());
  return comms;
}

}  // namespace bagua

// Backend-independent parts of the Communicator: the collectives' entry
// points (argument checks, then the backend's do_*), cross-rank call checks
// and the hierarchical split.
#include "bagua/comm/communicator.h"

#include <algorithm>
#include <array>
#include <string>
#include <utility>
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

void Communicator::allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) {
  check_same_shape("allreduce", send, recv);
  if (send.numel > 0) do_allreduce(send, recv, op);
}

void Communicator::reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) {
  check_root("reduce", root);
  if (rank() == root) check_same_shape("reduce", send, recv);
  if (send.numel > 0) do_reduce(send, recv, root, op);
}

void Communicator::broadcast(const TensorView& buffer, int root) {
  check_root("broadcast", root);
  if (buffer.numel > 0) do_broadcast(buffer, root);
}

void Communicator::allgather(const TensorView& send, const TensorView& recv) {
  check_gathered("allgather", send, recv);
  if (send.numel > 0) do_allgather(send, recv);
}

void Communicator::gather(const TensorView& send, const TensorView& recv, int root) {
  check_root("gather", root);
  if (rank() == root) check_gathered("gather", send, recv);
  if (send.numel > 0) do_gather(send, recv, root);
}

void Communicator::scatter(const TensorView& send, const TensorView& recv, int root) {
  check_root("scatter", root);
  if (rank() == root) check_gathered("scatter", recv, send);
  if (recv.numel > 0) do_scatter(send, recv, root);
}

void Communicator::reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) {
  check_gathered("reduce_scatter", recv, send);
  if (recv.numel > 0) do_reduce_scatter(send, recv, op);
}

void Communicator::alltoall(const TensorView& send, const TensorView& recv) {
  check_same_shape("alltoall", send, recv);
  BAGUA_CHECK_ARG(send.numel % size() == 0,
                  "alltoall on rank {}: {} elements do not split into {} equal chunks", rank(),
                  send.numel, size());
  if (send.numel > 0) do_alltoall(send, recv);
}

void Communicator::send(const TensorView& buffer, int peer) {
  check_peer("send", peer);
  const PeerMessage sends[] = {{buffer, peer}};
  if (buffer.numel > 0) do_send_recv(sends, {});
}

void Communicator::recv(const TensorView& buffer, int peer) {
  check_peer("recv", peer);
  const PeerMessage receives[] = {{buffer, peer}};
  if (buffer.numel > 0) do_send_recv({}, receives);
}

void Communicator::send_recv(std::span<const PeerMessage> sends,
                             std::span<const PeerMessage> receives) {
  for (const auto& message : sends) check_peer("send_recv", message.peer);
  for (const auto& message : receives) check_peer("send_recv", message.peer);
  do_send_recv(sends, receives);
}

bool Communicator::send_recv_on_host(std::span<const PeerMessage> sends,
                                     std::span<const PeerMessage> receives) {
  for (const auto& message : sends) check_peer("send_recv", message.peer);
  for (const auto& message : receives) check_peer("send_recv", message.peer);
  return do_send_recv_on_host(sends, receives);
}

int Communicator::recv_any(const TensorView& buffer, std::span<const int> peers, std::uint64_t tag,
                           bool wait_forever) {
  BAGUA_CHECK_ARG(!peers.empty() && buffer.numel > 0 && tag != 0,
                  "recv_any on rank {}: needs peers, a non-empty buffer and a tag", rank());
  for (int peer : peers) check_peer("recv_any", peer);
  return do_recv_any(buffer, peers, tag, wait_forever);
}

void Communicator::recv_from(const TensorView& buffer, int peer, std::uint64_t tag,
                             bool wait_forever) {
  BAGUA_CHECK_ARG(buffer.numel > 0 && tag != 0,
                  "recv_from on rank {}: needs a non-empty buffer and a tag", rank());
  check_peer("recv_from", peer);
  do_recv_from(buffer, peer, tag, wait_forever);
}

void Communicator::do_recv_from(const TensorView& /*buffer*/, int /*peer*/, std::uint64_t /*tag*/,
                                bool /*wait_forever*/) {
  throw InvalidArgument(fmt::format(
      "recv_from: the {} backend cannot receive a tagged message alone", backend_name()));
}

int Communicator::do_recv_any(const TensorView& /*buffer*/, std::span<const int> /*peers*/,
                              std::uint64_t /*tag*/, bool /*wait_forever*/) {
  throw InvalidArgument(
      fmt::format("recv_any: the {} backend cannot receive from any rank", backend_name()));
}

std::unique_ptr<Communicator> Communicator::new_group(std::span<const int> ranks) {
  check_group(ranks);
  return do_new_group(ranks);
}

std::unique_ptr<Communicator> Communicator::new_bucket_group(std::span<const int> ranks) {
  check_group(ranks);
  return do_new_bucket_group(ranks);
}

Communicator::GroupSlot Communicator::next_group(std::span<const int> ranks) {
  GroupSlot slot{group_counter_++, -1};
  const auto found = std::find(ranks.begin(), ranks.end(), rank());
  if (found != ranks.end()) slot.rank = static_cast<int>(found - ranks.begin());
  return slot;
}

void Communicator::count(std::size_t bytes) {
  counters_.bytes_sent += static_cast<std::int64_t>(bytes);
  counters_.bytes_received += static_cast<std::int64_t>(bytes);
  counters_.calls += 1;
}

void Communicator::check_root(std::string_view op, int root) const {
  BAGUA_CHECK_ARG(root >= 0 && root < size(), "{}: root {} is outside the group of size {}", op,
                  root, size());
}

void Communicator::check_peer(std::string_view op, int peer) const {
  BAGUA_CHECK_ARG(peer >= 0 && peer < size() && peer != rank(),
                  "{} on rank {}: peer {} is not another rank of the group of size {}", op, rank(),
                  peer, size());
}

void Communicator::check_same_shape(std::string_view op, const TensorView& a,
                                    const TensorView& b) const {
  BAGUA_CHECK_ARG(a.numel == b.numel && a.dtype == b.dtype, "{}: input {} and output {} differ", op,
                  a.describe(), b.describe());
}

void Communicator::check_gathered(std::string_view op, const TensorView& part,
                                  const TensorView& whole) const {
  BAGUA_CHECK_ARG(part.dtype == whole.dtype && whole.numel == part.numel * size(),
                  "{}: expected a {}-rank buffer of {} x {} elements, got {}", op, size(), size(),
                  part.describe(), whole.describe());
}

void Communicator::check_group(std::span<const int> ranks) const {
  BAGUA_CHECK_ARG(!ranks.empty(), "new_group: the rank list is empty");
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    BAGUA_CHECK_ARG(ranks[i] >= 0 && ranks[i] < size(),
                    "new_group: rank {} is outside the group of size {}", ranks[i], size());
    BAGUA_CHECK_ARG(i == 0 || ranks[i] > ranks[i - 1],
                    "new_group: ranks must be sorted and unique, got {} after {}", ranks[i],
                    ranks[i - 1]);
  }
}

namespace {

// A refusal travels in a fixed-size buffer (only when some rank refused).
constexpr std::size_t kRefusalBytes = 512;

}  // namespace

void Communicator::raise_refusals(std::string_view op, std::string_view refusal) {
  std::vector<char> mine(kRefusalBytes, '\0');
  std::copy_n(refusal.begin(), std::min(refusal.size(), kRefusalBytes - 1), mine.begin());
  std::vector<char> all(kRefusalBytes * static_cast<std::size_t>(size()));
  allgather(TensorView{mine.data(), static_cast<std::int64_t>(kRefusalBytes), DType::kUInt8, {}},
            TensorView{all.data(), static_cast<std::int64_t>(all.size()), DType::kUInt8, {}});
  // Ranks that give the same reason are named together.
  std::vector<std::pair<std::string, std::vector<int>>> reasons;
  for (int r = 0; r < size(); ++r) {
    const std::string text(&all[kRefusalBytes * static_cast<std::size_t>(r)]);
    if (text.empty()) continue;
    const auto same = std::find_if(reasons.begin(), reasons.end(),
                                   [&](const auto& reason) { return reason.first == text; });
    if (same == reasons.end()) {
      reasons.push_back({text, {r}});
    } else {
      same->second.push_back(r);
    }
  }
  std::string detail;
  for (const auto& [text, ranks] : reasons) {
    detail += fmt::format("{}{} {}: {}", detail.empty() ? "" : "; ",
                          ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "), text);
  }
  throw InvalidArgument(
      fmt::format("{} on rank {} of {}: the call was refused, so no rank runs it: {}", op, rank(),
                  size(), detail));
}

void Communicator::verify_same_call(std::string_view op, const TensorView& tensor, int root,
                                    std::string_view refusal) {
  constexpr int kFields = 5;
  std::array<std::int64_t, kFields> mine{stable_hash(op), tensor.numel,
                                         static_cast<std::int64_t>(tensor.dtype), root,
                                         refusal.empty() ? 0 : 1};
  std::vector<std::int64_t> all(static_cast<std::size_t>(kFields) * size());
  allgather(TensorView{mine.data(), kFields, DType::kInt64, {}},
            TensorView{all.data(), static_cast<std::int64_t>(all.size()), DType::kInt64, {}});
  const auto field = [&](int r, int f) {
    return all[static_cast<std::size_t>(r) * kFields + static_cast<std::size_t>(f)];
  };
  // A refusal flag other than 0 or 1 is not a check's: that rank sent the
  // bytes of another collective, so the ranks' calls are out of step. No
  // further collective can pair up; this rank stops here, naming them.
  std::vector<int> out_of_step;
  for (int r = 0; r < size(); ++r) {
    if (field(r, 4) != 0 && field(r, 4) != 1) out_of_step.push_back(r);
  }
  if (!out_of_step.empty()) {
    throw InvalidArgument(
        fmt::format("{} on rank {} of {}: {} {} sent something other than this check: the ranks' "
                    "collectives are out of step (one runs another collective here)",
                    op, rank(), size(), out_of_step.size() == 1 ? "rank" : "ranks",
                    fmt::join(out_of_step, ", ")));
  }
  bool refused = false;
  for (int r = 0; r < size(); ++r) refused = refused || field(r, 4) != 0;
  if (refused) raise_refusals(op, refusal);
  bool same = true;
  for (int r = 1; r < size(); ++r) {
    for (int f = 0; f < 4; ++f) same = same && field(r, f) == field(0, f);
  }
  if (same) return;
  std::string detail;
  for (int r = 0; r < size(); ++r) {
    detail += fmt::format("{}rank {}: {}[{}]{}", r == 0 ? "" : "; ", r,
                          to_string(static_cast<DType>(field(r, 2))), field(r, 1),
                          field(r, 0) == mine[0] ? "" : " (a different op)");
    if (field(r, 3) >= 0) detail += fmt::format(" root {}", field(r, 3));
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
  comms.nodes = static_cast<int>(members.size());
  for (const auto& node : members) {
    comms.largest_node = std::max(comms.largest_node, static_cast<int>(node.size()));
  }
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
  const bool equal_nodes = std::all_of(members.begin(), members.end(), [&](const auto& node) {
    return node.size() == members.front().size();
  });
  if (equal_nodes && comms.nodes > 1 && comms.largest_node > 1) {
    for (std::size_t index = 0; index < members.front().size(); ++index) {
      std::vector<int> same_index;
      same_index.reserve(members.size());
      for (const auto& node : members) same_index.push_back(node[index]);
      std::sort(same_index.begin(), same_index.end());
      auto group = global.new_group(same_index);
      if (group) comms.across = std::move(group);
    }
  }
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

// P-Reduce (partial all-reduce): an allreduce among some ranks of a
// communicator, called by those ranks only.
//
// Ripples creates a communicator per group; creating one is collective over
// the whole world and costs a rendezvous (design/ripples.md, section 3), so
// here a P-Reduce is point-to-point traffic among the members on the
// already connected mesh: a ring reduce-scatter, then a ring allgather, each
// step one tagged send_recv with the next and previous member; a small
// tensor instead goes to every member at once (one step). Among ranks of
// one host those messages, and the ring's steps when its chunks are small
// enough, go through shared-memory mailboxes (send_recv_on_host). The tag
// (members and group id) keeps concurrent groups apart and turns members that
// disagree about the group into a timeout naming it, never mixed data.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/communicator.h"
#include "bagua/comm/group_tags.h"
#include "bagua/core/cuda.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/errors.h"

namespace bagua {
namespace {

using group_tags::Chunk;
using group_tags::chunk_of;
using group_tags::group_key;
using group_tags::members_hash;
using group_tags::step_tag;

// The members and the place of this rank among them, with the tags of the call.
struct Ring {
  Communicator& comm;
  std::span<const int> members;
  int me = 0;  // index of this rank in members
  std::uint64_t key = 0;
  std::uint64_t group_id = 0;
  // Whether the ring's steps go through the shared-memory mailboxes: its
  // largest chunk fits one (the same answer on every member).
  bool on_host = false;

  int m() const { return static_cast<int>(members.size()); }
  int next() const { return members[static_cast<std::size_t>((me + 1) % m())]; }
  int prev() const { return members[static_cast<std::size_t>((me + m() - 1) % m())]; }

  // One ring step; a failure names the two neighbours this rank waited on.
  void exchange(const TensorView& send, const TensorView& recv, int step) {
    const std::uint64_t tag = step_tag(key, step);
    const PeerMessage sends[] = {{send, next(), tag}};
    const PeerMessage receives[] = {{recv, prev(), tag}};
    try {
      if (on_host) {
        BAGUA_CHECK_INTERNAL(
            comm.send_recv_on_host(sends, receives),
            "ring step {}: the chunk did not fit the mailbox its largest chunk fits", step);
      } else {
        comm.send_recv(sends, receives);
      }
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("{} (step {}: receiving from rank {}, sending to rank {})",
                                     e.what(), step, prev(), next()));
    } catch (const BackendError& e) {
      throw BackendError(fmt::format("{} (step {}: receiving from rank {}, sending to rank {})",
                                     e.what(), step, prev(), next()));
    }
  }
};

std::string describe_group(const Ring& ring) {
  return fmt::format("partial_allreduce of group {} (ranks {}) on rank {}", ring.group_id,
                     fmt::join(ring.members, ","), ring.comm.rank());
}

// Up to this many bytes sent per member ((m - 1) times the tensor), the
// members swap whole tensors in one step instead of the ring's 2 (m - 1)
// steps. Each step costs a round of notices and wake-ups across processes
// whatever its size; for a small tensor that latency is the whole cost.
constexpr std::size_t kDirectBytes = 64 * 1024;
// The direct exchange's step number in the tags (the ring uses 0 to 2m - 2).
constexpr int kDirectStep = (1 << group_tags::kStepBits) - 1;
// What a member tells the others when verifying: numel, dtype, op, members.
constexpr std::size_t kHeaderFields = 4;
constexpr std::size_t kHeaderBytes = kHeaderFields * sizeof(std::int64_t);

bool exchanges_directly(const TensorView& tensor, std::size_t members) {
  return (members - 1) * tensor.nbytes() <= kDirectBytes;
}

// One step in which every member sends `out` to every other and receives
// theirs into `slot(i)` (member i's); a failure says so.
template <typename Slot>
void exchange_with_every_member(Ring& ring, const TensorView& out, const Slot& slot, int step) {
  std::vector<PeerMessage> sends, receives;
  const std::uint64_t tag = step_tag(ring.key, step);
  for (int i = 0; i < ring.m(); ++i) {
    if (i == ring.me) continue;
    const int peer = ring.members[static_cast<std::size_t>(i)];
    sends.push_back({out, peer, tag});
    receives.push_back({slot(static_cast<std::size_t>(i)), peer, tag});
  }
  try {
    // Among ranks of one host the messages go through shared memory: one
    // wake-up per message instead of Gloo's two.
    if (!ring.comm.send_recv_on_host(sends, receives)) ring.comm.send_recv(sends, receives);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{} (step {}: with every member)", e.what(), step));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{} (step {}: with every member)", e.what(), step));
  }
}

// recv = the members' tensors reduced in member order (`tensor(i)`: member
// i's; `own`: this rank's, apart from recv): every member computes the same
// operations on the same values, so all end bit-identical.
template <typename Tensor>
void reduce_in_member_order(const Ring& ring, const TensorView& own, const TensorView& recv,
                            ReduceOp op, const Tensor& tensor) {
  const auto of = [&](int i) { return i == ring.me ? own : tensor(static_cast<std::size_t>(i)); };
  std::memcpy(recv.data, of(0).data, recv.nbytes());
  for (int i = 1; i < ring.m(); ++i) reduce_into(op, recv, recv, of(i));
  if (op == ReduceOp::kAvg) divide_inplace(recv, ring.m());
}

// Every member sends its whole tensor to every other member and reduces
// the m tensors in member order.
void exchange_directly(Ring& ring, const TensorView& send, const TensorView& recv, ReduceOp op) {
  const std::size_t bytes = send.nbytes();
  thread_local std::vector<std::byte> scratch;
  scratch.resize(static_cast<std::size_t>(ring.m()) * bytes);
  const auto slot = [&](std::size_t i) {
    return TensorView{scratch.data() + i * bytes, send.numel, send.dtype, {}};
  };
  // recv may be send: this rank's tensor is kept apart for the reduction.
  std::memcpy(slot(static_cast<std::size_t>(ring.me)).data, send.data, bytes);
  exchange_with_every_member(ring, send, slot, kDirectStep);
  reduce_in_member_order(ring, slot(static_cast<std::size_t>(ring.me)), recv, op, slot);
}

// Every member sends its (numel, dtype, op, members) to every other member
// and compares what it receives, so all of them see a disagreement. A
// tensor that goes directly rides in the same message, after the header:
// receives are sized for the largest tensor that goes directly (a member
// that takes the ring sends the header alone; a shorter message is fine),
// so even members that disagree on the size fail cleanly. Returns whether
// the reduction is done (the direct case).
bool verify_members_agree(Ring& ring, const TensorView& send, const TensorView& recv, ReduceOp op) {
  const bool direct = exchanges_directly(send, ring.members.size());
  // Each slot: a header and the largest tensor that goes directly, rounded
  // up so that every slot's tensor stays aligned for any dtype.
  constexpr std::size_t kAlign = 16;
  const std::size_t most =
      (kHeaderBytes + kDirectBytes / (ring.members.size() - 1) + kAlign - 1) / kAlign * kAlign;
  thread_local std::vector<std::byte> scratch;
  scratch.assign(static_cast<std::size_t>(ring.m() + 1) * most, std::byte{0});
  auto* mine = scratch.data() + static_cast<std::size_t>(ring.m()) * most;
  const std::array<std::int64_t, kHeaderFields> header{
      send.numel, static_cast<std::int64_t>(send.dtype), static_cast<std::int64_t>(op),
      static_cast<std::int64_t>(members_hash(ring.members) >> 1)};
  std::memcpy(mine, header.data(), kHeaderBytes);
  if (direct) std::memcpy(mine + kHeaderBytes, send.data, send.nbytes());
  const TensorView out{mine,
                       static_cast<std::int64_t>(kHeaderBytes + (direct ? send.nbytes() : 0)),
                       DType::kUInt8,
                       {}};
  exchange_with_every_member(
      ring, out,
      [&](std::size_t i) {
        return TensorView{
            scratch.data() + i * most, static_cast<std::int64_t>(most), DType::kUInt8, {}};
      },
      0);
  std::string detail;
  for (int i = 0; i < ring.m(); ++i) {
    if (i == ring.me) continue;
    std::array<std::int64_t, kHeaderFields> row{};
    std::memcpy(row.data(), scratch.data() + static_cast<std::size_t>(i) * most, kHeaderBytes);
    if (row == header) continue;
    detail += fmt::format(
        "; rank {} passed {}[{}] op {}{}", ring.members[static_cast<std::size_t>(i)],
        to_string(static_cast<DType>(row[1])), row[0], to_string(static_cast<ReduceOp>(row[2])),
        row[3] == header[3] ? "" : " and another member list");
  }
  if (!detail.empty()) {
    throw InvalidArgument(fmt::format(
        "{}: the members passed different calls: this rank {}[{}] op {}{}", describe_group(ring),
        to_string(send.dtype), send.numel, to_string(op), detail));
  }
  if (!direct) return false;
  const TensorView own{mine + kHeaderBytes, send.numel, send.dtype, {}};  // apart from recv
  reduce_in_member_order(ring, own, recv, op, [&](std::size_t i) {
    return TensorView{scratch.data() + i * most + kHeaderBytes, send.numel, send.dtype, {}};
  });
  return true;
}

// After it, member `me` holds the reduction of chunk (me + 1) mod m in recv.
void reduce_scatter_ring(Ring& ring, const TensorView& recv, ReduceOp op) {
  const int m = ring.m();
  const Chunk largest = chunk_of(recv.numel, m, 0);
  thread_local std::vector<std::byte> scratch;
  scratch.resize(static_cast<std::size_t>(largest.numel) * dtype_size(recv.dtype));
  for (int s = 0; s < m - 1; ++s) {
    const Chunk out = chunk_of(recv.numel, m, (ring.me - s + m) % m);
    const Chunk in = chunk_of(recv.numel, m, (ring.me - s - 1 + 2 * m) % m);
    const TensorView incoming{scratch.data(), in.numel, recv.dtype, {}};
    ring.exchange(recv.slice(out.offset, out.numel), incoming, 1 + s);
    const TensorView target = recv.slice(in.offset, in.numel);
    reduce_into(op, target, target, incoming);
  }
}

// Passes each member's reduced chunk around the ring into everyone's recv.
void allgather_ring(Ring& ring, const TensorView& recv) {
  const int m = ring.m();
  for (int s = 0; s < m - 1; ++s) {
    const Chunk out = chunk_of(recv.numel, m, (ring.me + 1 - s + m) % m);
    const Chunk in = chunk_of(recv.numel, m, (ring.me - s + m) % m);
    ring.exchange(recv.slice(out.offset, out.numel), recv.slice(in.offset, in.numel), m + s);
  }
}

}  // namespace

void Communicator::partial_allreduce(const TensorView& send, const TensorView& recv,
                                     std::span<const int> members, ReduceOp op,
                                     std::uint64_t group_id, bool verify) {
  check_members(send, recv, members);
  if (send.numel == 0) return;
  if (members.size() == 1) {
    if (send.data == recv.data) return;
    if (send.device.type == DeviceType::kCPU && recv.device.type == DeviceType::kCPU) {
      std::memcpy(recv.data, send.data, send.nbytes());
    } else {  // a CUDA buffer: copied on the device's communication stream
      const int device =
          send.device.type == DeviceType::kCUDA ? send.device.index : recv.device.index;
      void* stream = cuda_communication_stream(device);
      cuda_copy_async(recv.data, send.data, send.nbytes(), stream);
      cuda_stream_wait(stream, timeout(), "partial_allreduce of a group of one");
    }
    return;
  }
  do_partial_allreduce(send, recv, members, op, group_id, verify);
}

std::uint64_t Communicator::next_partial_id(std::span<const int> members) {
  return partial_ids_[std::vector<int>(members.begin(), members.end())]++;
}

void Communicator::do_partial_allreduce(const TensorView& send, const TensorView& recv,
                                        std::span<const int> members, ReduceOp op,
                                        std::uint64_t group_id, bool verify) {
  BAGUA_CHECK_ARG(send.device.type == DeviceType::kCPU && recv.device.type == DeviceType::kCPU,
                  "partial_allreduce on the {} backend takes host buffers, got {} and {}",
                  backend_name(), send.describe(), recv.describe());
  Ring ring{*this, members, 0, group_key(members, group_id), group_id};
  ring.me = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  try {
    if (verify) {
      if (verify_members_agree(ring, send, recv, op)) return;
    } else if (exchanges_directly(send, members.size())) {
      exchange_directly(ring, send, recv, op);
      return;
    }
    if (send.data != recv.data) std::memcpy(recv.data, send.data, send.nbytes());
    const auto largest_chunk = static_cast<std::size_t>(chunk_of(recv.numel, ring.m(), 0).numel);
    ring.on_host = largest_chunk * dtype_size(recv.dtype) <= host_message_capacity();
    reduce_scatter_ring(ring, recv, op);
    if (op == ReduceOp::kAvg) {
      const Chunk own = chunk_of(recv.numel, ring.m(), (ring.me + 1) % ring.m());
      divide_inplace(recv.slice(own.offset, own.numel), ring.m());
    }
    allgather_ring(ring, recv);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: {}", describe_group(ring), e.what()));
  } catch (const BackendError& e) {
    throw BackendError(fmt::format("{}: {}", describe_group(ring), e.what()));
  }
}

void Communicator::check_members(const TensorView& send, const TensorView& recv,
                                 std::span<const int> members) const {
  check_same_shape("partial_allreduce", send, recv);
  BAGUA_CHECK_ARG(!members.empty(), "partial_allreduce on rank {}: the member list is empty",
                  rank());
  bool has_me = false;
  for (std::size_t i = 0; i < members.size(); ++i) {
    BAGUA_CHECK_ARG(members[i] >= 0 && members[i] < size(),
                    "partial_allreduce on rank {}: member {} is outside the group of size {}",
                    rank(), members[i], size());
    BAGUA_CHECK_ARG(i == 0 || members[i] > members[i - 1],
                    "partial_allreduce on rank {}: members must be sorted and unique, got {} "
                    "after {}",
                    rank(), members[i], members[i - 1]);
    has_me = has_me || members[i] == rank();
  }
  BAGUA_CHECK_ARG(has_me, "partial_allreduce on rank {}: this rank is not among the members {}",
                  rank(), fmt::format("{}", fmt::join(members, ",")));
}

}  // namespace bagua

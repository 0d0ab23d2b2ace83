// The exchange D_LP_S (decentralized_low_precision.h) and its graph form
// (low_precision_neighbor_allreduce.h) share, once each has its float32
// difference d:
//   send Q(d) to every destination, receive Q(d_j) from every source;
//   replica_j += Q^-1(Q(d_j));  weight += Q^-1(Q(d));  x = weight.
// Q is MinMaxUInt8 over chunks of `chunk_elements` (chunked_layout.h). Every
// rank adds the same decoded bytes, so a rank's weight stays equal, bit for
// bit, to the replicas its destinations keep of it.
//
// A source or destination that is this rank itself (a ring of one) is served
// from Q(d) without communication. Where every rank neighbours every other
// (a ring of two or three) one allgather replaces the pairwise messages: each
// rank's message reaches each other rank once, on shared memory when the
// ranks share a host (a ring of two thus sends its one peer the message once,
// not once per neighbour). Otherwise all sends and receives are posted before
// any wait (Communicator::send_recv), each bounded by the communicator's
// timeout. Errors are rethrown prefixed with `where` (the op, the bucket, the
// rank).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bagua/comm/communicator.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct LowPrecisionExchange {
  std::int64_t chunk_elements = 1;
  std::span<const int> sources;          // one replica each, in this order
  std::span<const TensorView> replicas;  // of the bucket's size and dtype
  std::span<const int> destinations;     // receive Q(d)
  // Every rank's sources and destinations are all the other ranks (a ring
  // of two or three): one allgather then carries each rank's message to
  // each other rank once, in one collective that shared memory carries.
  // Must be the same on every rank, since the ranks then call a collective.
  bool everyone_neighbours_everyone = false;
  std::string_view where;  // for errors
};

namespace detail {

// Runs `communicate` (the exchange's one communicator call), prefixing
// errors with where the exchange was.
template <typename Fn>
void exchange_or_explain(std::string_view where, Fn&& communicate) {
  try {
    communicate();
  } catch (const TimeoutError& error) {
    throw TimeoutError(fmt::format("{}: a neighbour did not exchange within the timeout; {}", where,
                                   error.what()));
  } catch (const BackendError& error) {
    throw BackendError(fmt::format("{}: {}", where, error.what()));
  }
}

// Q(d) of every rank through one allgather; returns each source's bytes.
inline std::vector<const std::byte*> allgather_messages(Compute& c, Communicator& comm,
                                                        const LowPrecisionExchange& e,
                                                        const TensorView& mine,
                                                        CachingAllocator::Block& gathered) {
  const auto bytes = static_cast<std::size_t>(mine.numel);
  gathered = c.scratch(bytes * static_cast<std::size_t>(comm.size()));
  const TensorView all = c.view(gathered, mine.numel * comm.size(), DType::kUInt8);
  exchange_or_explain(e.where, [&] { comm.allgather(mine, all); });
  std::vector<const std::byte*> decoded;
  for (int s : e.sources) {
    decoded.push_back(static_cast<const std::byte*>(gathered.data()) +
                      static_cast<std::size_t>(s) * bytes);
  }
  return decoded;
}

// Q(d) to each destination and from each source, pairwise; several
// messages to or from one peer match in the order listed. Returns each
// source's bytes.
inline std::vector<const std::byte*> exchange_messages(
    Compute& c, Communicator& comm, const LowPrecisionExchange& e, const TensorView& mine,
    std::vector<CachingAllocator::Block>& received) {
  std::vector<PeerMessage> sends, receives;
  for (int d : e.destinations) {
    if (d != comm.rank()) sends.push_back({mine, d});
  }
  received.reserve(e.sources.size());
  std::vector<const std::byte*> decoded;
  for (int s : e.sources) {
    if (s == comm.rank()) {
      decoded.push_back(static_cast<const std::byte*>(mine.data));
      continue;
    }
    received.push_back(c.scratch(static_cast<std::size_t>(mine.numel)));
    receives.push_back({c.view(received.back(), mine.numel, DType::kUInt8), s});
    decoded.push_back(static_cast<const std::byte*>(received.back().data()));
  }
  if (!sends.empty() || !receives.empty()) {
    exchange_or_explain(e.where, [&] { comm.send_recv(sends, receives); });
  }
  return decoded;
}

}  // namespace detail

inline void exchange_low_precision_difference(Compute& c, Communicator& comm,
                                              const LowPrecisionExchange& e, const TensorView& diff,
                                              const TensorView& weight, const TensorView& x) {
  BAGUA_CHECK_INTERNAL(e.sources.size() == e.replicas.size(), "{}: {} sources, {} replicas",
                       e.where, e.sources.size(), e.replicas.size());
  const std::size_t bytes = minmax_uint8::ChunkedLayout{diff.numel, e.chunk_elements}.bytes();
  const auto mine = c.scratch(bytes);
  auto* mine_bytes = static_cast<std::byte*>(mine.data());
  c.compress(diff, e.chunk_elements, mine_bytes);
  const TensorView mine_view = c.view(mine, static_cast<std::int64_t>(bytes), DType::kUInt8);
  CachingAllocator::Block gathered;
  std::vector<CachingAllocator::Block> received;
  const std::vector<const std::byte*> decoded =
      e.everyone_neighbours_everyone && comm.size() > 1
          ? detail::allgather_messages(c, comm, e, mine_view, gathered)
          : detail::exchange_messages(c, comm, e, mine_view, received);
  for (std::size_t k = 0; k < decoded.size(); ++k) {
    c.decompress(decoded[k], e.chunk_elements, e.replicas[k], true);
  }
  // x = W + Q^-1(Q(d)); W = x: decode into W in place, then copy to x.
  c.decompress(mine_bytes, e.chunk_elements, weight, true);
  c.copy(x.data, weight.data, x.nbytes());
}

}  // namespace bagua

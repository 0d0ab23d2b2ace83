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
// from Q(d) without communication. A peer listed twice (a ring of two) is
// sent Q(d) once and its one message decodes into both of its replicas. All sends and receives are
// posted before any wait (Communicator::send_recv), each bounded by the communicator's timeout;
// errors are rethrown prefixed with `where` (the op, the bucket, the rank).
#pragma once

#include <algorithm>
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
  std::string_view where;                // for errors
};

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
  std::vector<CachingAllocator::Block> received;
  received.reserve(e.sources.size());
  std::vector<const std::byte*> decoded;
  std::vector<PeerMessage> sends, receives;
  // A peer listed twice (both neighbours of a ring of two) gets Q(d) once
  // and sends once: the copies would carry the same bytes. Every rank
  // dedupes alike, so the messages still match.
  for (std::size_t k = 0; k < e.destinations.size(); ++k) {
    const int d = e.destinations[k];
    const auto first = std::find(e.destinations.begin(), e.destinations.end(), d);
    if (d != comm.rank() && first == e.destinations.begin() + k) sends.push_back({mine_view, d});
  }
  for (std::size_t k = 0; k < e.sources.size(); ++k) {
    const int s = e.sources[k];
    if (s == comm.rank()) {
      decoded.push_back(mine_bytes);
      continue;
    }
    const auto first = std::find(e.sources.begin(), e.sources.end(), s);
    if (first != e.sources.begin() + k) {
      decoded.push_back(decoded[static_cast<std::size_t>(first - e.sources.begin())]);
      continue;
    }
    received.push_back(c.scratch(bytes));
    receives.push_back(
        {c.view(received.back(), static_cast<std::int64_t>(bytes), DType::kUInt8), s});
    decoded.push_back(static_cast<const std::byte*>(received.back().data()));
  }
  if (!sends.empty() || !receives.empty()) {
    try {
      comm.send_recv(sends, receives);
    } catch (const TimeoutError& error) {
      throw TimeoutError(fmt::format("{}: a neighbour did not exchange within the timeout; {}",
                                     e.where, error.what()));
    } catch (const BackendError& error) {
      throw BackendError(fmt::format("{}: {}", e.where, error.what()));
    }
  }
  for (std::size_t k = 0; k < decoded.size(); ++k) {
    c.decompress(decoded[k], e.chunk_elements, e.replicas[k], true);
  }
  // x = W + Q^-1(Q(d)); W = x: decode into W in place, then copy to x.
  c.decompress(mine_bytes, e.chunk_elements, weight, true);
  c.copy(x.data, weight.data, x.nbytes());
}

}  // namespace bagua

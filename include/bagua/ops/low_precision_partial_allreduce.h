// Low-precision P-Reduce: the average of a group's float32 buffers with
// MinMaxUInt8 on the wire (about a quarter of the bytes of the full
// precision ring), the "asynchronous + low precision + decentralized" row of
// the Bagua paper's Table 1 (design/ripples.md, 7.9).
//
// Scatter-gather among the m members, as C_LP_S does among all ranks: member
// j owns chunk j; every member compresses each of its chunks and sends chunk
// j to member j; the owner decompresses and averages the m versions of its
// chunk, compresses the average and sends it to every member; everyone,
// owner included, decompresses the same bytes, so all members end with
// bit-identical buffers. Messages are tagged by group (members and id) like
// Communicator::partial_allreduce, so members that disagree time out naming
// the group instead of mixing data.
#pragma once

#include <cstdint>
#include <span>

#include "bagua/comm/communicator.h"

namespace bagua {

// How each member's chunk is coded. By default with one min/max. With
// `segments` (the lengths of the tensors the buffer holds back to back; they
// sum to its numel) a chunk is cut where a tensor ends and every
// `piece_elements` (> 0) from a tensor's start, each piece with a min/max of
// its own: tensors of different scale then never share a range.
struct CodeLayout {
  std::span<const std::int64_t> segments;
  std::int64_t piece_elements = 0;
};

// `buffer`: float32, host memory, the same numel on every member; members
// sorted, unique, containing comm.rank(). A group of one leaves it as is.
void low_precision_partial_allreduce(Communicator& comm, const TensorView& buffer,
                                     std::span<const int> members, std::uint64_t group_id,
                                     const CodeLayout& layout = {});

// The bytes of the whole buffer coded under `layout`, each member's chunk
// once (codes and min/max headers): the payload PowerSGD counts as exchanged.
std::int64_t low_precision_coded_bytes(std::int64_t numel, int members,
                                       const CodeLayout& layout = {});

}  // namespace bagua

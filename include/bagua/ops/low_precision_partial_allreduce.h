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

// `buffer`: float32, host memory, the same numel on every member; members
// sorted, unique, containing comm.rank(). A group of one leaves it as is.
void low_precision_partial_allreduce(Communicator& comm, const TensorView& buffer,
                                     std::span<const int> members, std::uint64_t group_id);

}  // namespace bagua

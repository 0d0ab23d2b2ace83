// Collectives through shared memory (allreduce, allgather, alltoall,
// broadcast), for
// the ranks of a group that share a host.
//
// Over loopback TCP an allreduce costs each rank several copies through the
// kernel per byte plus socket wake-ups; with the buffers in one shared
// segment it is three memory passes: copy in, reduce this rank's share of
// every rank's copy, copy the reduced result out (the share itself skips
// both copies, see Protocol). This is what NCCL and MPI
// do inside a node; PyTorch's Gloo backend does not.
//
// Protocol. The buffer is cut into pieces of at most one slot. For piece p
// (alternating between two slot sets, so copying in the next piece overlaps
// peers still reading the previous one):
//   1. copy in: every rank copies its piece into its own slot, all but
//      its own segment r (which no peer reads), then publishes written = p;
//   2. reduce: once all have written, rank r reduces segment r of the piece
//      over the ranks' copies in rank order 0, 1, ..., n-1 (so every rank
//      ends with the same bits), its own copy read from its buffer, divides
//      for kAvg, writes the result into its buffer and the set's result
//      area, then publishes reduced = p;
//   3. copy out: once all have reduced, every rank copies the other
//      segments of the result piece into its buffer, then publishes
//      consumed = p (a slot set is rewritten only when every rank has
//      consumed what it held before).
// The reduction goes block by block, each block's partial sums in L1. Per
// rank that moves 5 - 2/n times the piece's bytes through memory (reads
// plus writes), against 7 - 3/n when the own segment went through the slot
// too and every pass went over the whole segment.
// Direct allreduce (buffers of at least `direct_min_bytes`, where the kernel
// lets a rank read and write its peers' memory: process_vm_readv/writev,
// probed once when the group is set up). No slot is used: every rank
// publishes its buffer's address and written = call; once all have, the
// ranks claim blocks of 64 KiB from a counter in the segment, each block
// going to whichever rank asks first. The claimant reads every peer's copy
// of the block straight from the peer's buffer (a kernel copy into a block
// of its own, in L2), reduces them in rank order with its own copy in
// place, and writes the result straight into every peer's buffer. A rank
// returns once every block is finished. Over the ranks that is 2 times the
// buffer's bytes through memory per rank (every copy read, every copy
// written) instead of 5 - 2/n, one call instead of pieces of a slot, and
// two waits instead of three per piece; and a rank the scheduler leaves
// out (more ranks than cores) is not waited for, its share done by the
// others. The sum is the same rank-order sum, so the bits are the slot
// path's.
// Allgather and alltoall are the same without the reduce stage: every rank
// copies its piece (for alltoall: its piece of each destination's chunk) into
// its slot, and once all have written, copies what is meant for it out of
// every slot. Broadcast is the same with only the root's slot written and
// read.
// Every wait is bounded by the timeout and watches the peers' processes: a
// peer that exited is an error at once, naming it.
//
// Ranks share a host when they run under one kernel boot and share the
// network, mount and pid namespaces (ranks in separate network namespaces,
// e.g. behind a shaped link, keep talking over the network).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/core/reduce_op.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

struct SharedMemoryOptions {
  // Whether collectives may use shared memory at all (BAGUA_SHARED_MEMORY).
  bool enabled = true;
  // Smaller buffers stay on the communicator's own transport
  // (BAGUA_SHARED_MEMORY_MIN_BYTES). By default none does: even a few bytes
  // take 0.1-0.7 ms here against 0.5-7 ms over loopback TCP, whose every
  // message waits for Gloo's event-loop thread and then the receiving thread
  // (docs/benchmarks.md, "One allreduce by transport").
  std::int64_t min_bytes = 1;
  // Bytes of one rank's slot (a piece); 0 picks a size from the world size.
  std::size_t slot_bytes = 0;
  // Allreduces of at least this many bytes go direct (see above) where the
  // kernel allows it and BAGUA_SHARED_MEMORY_DIRECT is not 0; 0: never.
  std::int64_t direct_min_bytes = std::int64_t{64} << 10;
};

// A key equal on two ranks exactly when they can share a segment (same
// boot, same network, mount and pid namespaces); empty when undeterminable.
std::string shared_memory_host_key();

class SharedMemoryGroup {
 public:
  // Collective over `comm` (which must be usable for allgather): returns the
  // shared-memory group of its ranks, or null
  // on every rank when they are not all on one host or any rank failed to
  // map the segment (the reason is logged).
  static std::unique_ptr<SharedMemoryGroup> attach(Communicator& comm,
                                                   const SharedMemoryOptions& options,
                                                   const std::string& group_name);
  ~SharedMemoryGroup();
  SharedMemoryGroup(const SharedMemoryGroup&) = delete;
  SharedMemoryGroup& operator=(const SharedMemoryGroup&) = delete;

  // buffer = op over ranks of buffer (host memory, same size on every rank).
  // `aborted` is polled while waiting.
  void allreduce(const TensorView& buffer, ReduceOp op, std::chrono::milliseconds timeout,
                 const std::atomic<bool>& aborted);
  // recv (size() * send bytes) = concatenation of send over ranks.
  void allgather(const TensorView& send, const TensorView& recv, std::chrono::milliseconds timeout,
                 const std::atomic<bool>& aborted);
  // buffer = the root's buffer, on every rank.
  void broadcast(const TensorView& buffer, int root, std::chrono::milliseconds timeout,
                 const std::atomic<bool>& aborted);
  // chunk j of recv on rank i = chunk i of send on rank j (size() equal chunks).
  void alltoall(const TensorView& send, const TensorView& recv, std::chrono::milliseconds timeout,
                const std::atomic<bool>& aborted);

  std::size_t slot_bytes() const { return slot_bytes_; }
  // Whether allreduces of `bytes` go direct (the same on every rank).
  bool direct(std::size_t bytes) const {
    return direct_min_bytes_ > 0 && static_cast<std::int64_t>(bytes) >= direct_min_bytes_;
  }

 private:
  struct Control;
  class Waiter;
  SharedMemoryGroup(void* base, std::size_t bytes, int rank, int size, std::size_t slot_bytes,
                    std::int64_t direct_min_bytes, std::string group_name);
  void direct_allreduce(const TensorView& buffer, ReduceOp op, Waiter& waiter);
  // The next unclaimed block of the call whose blocks are numbered from
  // `first`, relative to it; `blocks` when none is left.
  std::uint64_t claim_block(std::uint64_t first, std::uint64_t blocks);
  // The n elements at byte `at` of `mine` = op over ranks, in rank order, of
  // their copies (this rank's is `mine` itself), also written into every
  // peer's buffer; `scratch` holds size() blocks.
  void reduce_block(DType dtype, std::byte* mine, std::size_t at, std::size_t n, ReduceOp op,
                    std::byte* scratch);
  // Moves `bytes` between `local` and byte `at` of rank `peer`'s buffer:
  // reads them into `local` or writes them from it.
  enum class PeerCopy { kRead, kWrite };
  void copy_peer(PeerCopy direction, int peer, std::byte* local, std::size_t at,
                 std::size_t bytes) const;
  void reduce_piece(const TensorView& buffer, std::int64_t offset, std::int64_t count, ReduceOp op,
                    Waiter& waiter);
  // mine[0, n) = op over ranks, in rank order, of their copies of the
  // segment at byte `at` of `piece` (this rank's copy is `mine` itself),
  // also written to the piece's result area for the peers.
  void reduce_segment(DType dtype, std::byte* mine, std::uint64_t piece, std::size_t at,
                      std::size_t n, ReduceOp op);
  // One piece of an allgather or alltoall: this rank's slot receives
  // `fill_slot`'s bytes, then `drain_slot(rank, slot)` reads every rank's.
  template <typename Fill, typename Drain>
  void exchange_piece(Fill&& fill_slot, Drain&& drain_slot, Waiter& waiter);
  // Starts piece number pieces_done_ + 1 once its slot set is free again.
  std::uint64_t begin_piece(Waiter& waiter);
  std::byte* slot(std::uint64_t piece, int rank) const;
  std::byte* result(std::uint64_t piece) const;

  void* base_;
  std::size_t bytes_;
  int rank_;
  int size_;
  std::size_t slot_bytes_;
  std::int64_t direct_min_bytes_;  // 0: the kernel does not let ranks reach each other's memory
  std::string group_name_;
  Control* control_;
  std::byte* data_;
  std::uint64_t pieces_done_ = 0;       // pieces run so far: equal on every rank
  std::uint64_t blocks_done_ = 0;       // direct blocks so far: equal on every rank
  std::vector<std::uint64_t> scratch_;  // the direct allreduce's blocks
};

}  // namespace bagua

// The direct shared-memory allreduce: every rank reads its peers' copies of
// a block straight from their buffers (process_vm_readv), reduces them and
// writes the result into every buffer (process_vm_writev); blocks go to
// whichever rank claims them first. See bagua/comm/shared_memory.h.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "bagua/comm/shared_memory.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/errors.h"
#include "bagua/core/timeline.h"
#include "comm/shared_memory_control.h"

namespace bagua {

using namespace shm;

namespace {

// A block of the direct reduction: each peer's copy of it is read into one
// of these, so size() of them stay in L2 while the block is reduced.
constexpr std::size_t kDirectBlockBytes = std::size_t{64} << 10;

}  // namespace

void SharedMemoryGroup::direct_allreduce(const TensorView& buffer, ReduceOp op, Waiter& waiter) {
  // One piece number, no slot: later slot pieces find the sets free as before.
  const std::uint64_t call = ++pieces_done_;
  control_->rank(rank_).address.store(reinterpret_cast<std::uintptr_t>(buffer.bytes()),
                                      std::memory_order_relaxed);
  control_->publish(rank_, Stage::kWritten, call);  // releases the address with it
  {
    const TimelinePhase phase("shm.wait_written");
    waiter.wait_all(Stage::kWritten, call);
  }
  const std::size_t element = dtype_size(buffer.dtype);
  const std::size_t per_block = kDirectBlockBytes / element;
  const std::uint64_t first = blocks_done_,
                      blocks = (static_cast<std::size_t>(buffer.numel) + per_block - 1) / per_block;
  blocks_done_ += blocks;
  {
    // Blocks go to whichever rank is running: on a machine with fewer cores
    // than ranks, the ranks the scheduler left out are not waited for.
    const TimelinePhase phase("shm.direct_reduce");
    scratch_.resize(static_cast<std::size_t>(size_) * kDirectBlockBytes / 8);  // once
    for (std::uint64_t block = claim_block(first, blocks); block < blocks;
         block = claim_block(first, blocks)) {
      const std::size_t begin = block * per_block;
      const std::size_t count = std::min(per_block, static_cast<std::size_t>(buffer.numel) - begin);
      reduce_block(buffer.dtype, buffer.bytes(), begin * element, count, op,
                   reinterpret_cast<std::byte*>(scratch_.data()));
      if (control_->finished.fetch_add(1, std::memory_order_acq_rel) + 1 == first + blocks) {
        control_->wake();
      }
    }
  }
  {
    // Peers write into this buffer until the last block is finished.
    const TimelinePhase phase("shm.wait_reduced");
    waiter.wait_blocks(first + blocks);
  }
  // No wake-up: nobody can be waiting for these. A later slot piece waits
  // for consumed >= call only once every rank has written a later call,
  // which each does after these stores. A futex wake here would only rouse
  // ranks sleeping in the next call's waits, each a context switch on a
  // machine with more ranks than cores.
  control_->rank(rank_).reduced.store(call, std::memory_order_release);
  control_->rank(rank_).consumed.store(call, std::memory_order_release);
}

std::uint64_t SharedMemoryGroup::claim_block(std::uint64_t first, std::uint64_t blocks) {
  std::uint64_t claimed = control_->claimed.load(std::memory_order_relaxed);
  do {
    if (claimed >= first + blocks) return blocks;
  } while (
      !control_->claimed.compare_exchange_weak(claimed, claimed + 1, std::memory_order_acq_rel));
  return claimed - first;
}

void SharedMemoryGroup::reduce_block(DType dtype, std::byte* mine, std::size_t at, std::size_t n,
                                     ReduceOp op, std::byte* scratch) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr std::size_t kBlock = kDirectBlockBytes / sizeof(T);
    const std::size_t bytes = n * sizeof(T);
    // Each peer's copy goes into its scratch block; at this rank's index the
    // partial sums (its own copy must be read at its place in the order).
    const auto block_of = [&](int r) {
      return reinterpret_cast<T*>(scratch) + static_cast<std::size_t>(r) * kBlock;
    };
    T* const out = reinterpret_cast<T*>(mine + at);
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) {
        copy_peer(PeerCopy::kRead, r, reinterpret_cast<std::byte*>(block_of(r)), at, bytes);
      }
    }
    const auto copy_of = [&](int r) -> const T* { return r == rank_ ? out : block_of(r); };
    T* const partial = rank_ <= 1 ? out : block_of(rank_);
    for (int r = 1; r < size_; ++r) {  // as reduce_segment: the same bits
      const bool last = r == size_ - 1;
      T* const into = last ? out : partial;
      const T* const sum = r == 1 ? copy_of(0) : partial;
      if (op == ReduceOp::kAvg && last) {
        sum_then_divide<T>(into, sum, copy_of(r), n, size_);
      } else {
        reduce_elements<T>(op, into, sum, copy_of(r), n);
      }
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) copy_peer(PeerCopy::kWrite, r, reinterpret_cast<std::byte*>(out), at, bytes);
    }
  });
}

// process_vm_readv or _writev until all `bytes` moved, or a BackendError
// naming the peer.
void SharedMemoryGroup::copy_peer(PeerCopy direction, int peer, std::byte* local, std::size_t at,
                                  std::size_t bytes) const {
  const RankState& state = control_->rank(peer);
  const int pid = state.pid.load(std::memory_order_relaxed);
  const std::uintptr_t base = state.address.load(std::memory_order_relaxed) + at;
  const bool read = direction == PeerCopy::kRead;
  std::size_t done = 0;
  while (done < bytes) {
    const iovec here{local + done, bytes - done};
    const iovec there{reinterpret_cast<void*>(base + done), bytes - done};
    const ssize_t n = read ? ::process_vm_readv(pid, &here, 1, &there, 1, 0)
                           : ::process_vm_writev(pid, &here, 1, &there, 1, 0);
    if (n <= 0) {
      throw BackendError(fmt::format("direct allreduce: {} the buffer of rank {} (pid {}): {}",
                                     read ? "reading" : "writing", peer, pid,
                                     n < 0 ? std::strerror(errno) : "no progress"));
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace bagua

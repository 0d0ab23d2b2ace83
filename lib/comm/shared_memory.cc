// Shared-memory collectives: the segment, the three-stage protocol through
// slots, allgather / broadcast / alltoall (see include/bagua/comm/
// shared_memory.h). The control block and its waits are in
// shared_memory_control.h, the direct allreduce in shared_memory_direct.cc.
#include "bagua/comm/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bagua/core/elementwise.h"
#include "bagua/core/env.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "bagua/core/timeline.h"
#include "comm/shared_memory_control.h"
#include "comm/shared_memory_segment.h"

namespace bagua {

using namespace shm;

namespace {

constexpr std::size_t kSegmentBudget = 64ULL << 20;  // all slots and results of one group
constexpr std::size_t kReduceBlockBytes = std::size_t{16} << 10;  // a block of the reduction, in L1

std::string namespace_id(const char* kind) {
  std::array<char, 128> target{};
  const auto path = fmt::format("/proc/self/ns/{}", kind);
  const ssize_t n = ::readlink(path.c_str(), target.data(), target.size() - 1);
  return n > 0 ? std::string(target.data(), static_cast<std::size_t>(n)) : std::string();
}

// Slot bytes for `size` ranks: the budget over two sets of size + 1 areas,
// between 256 KiB and 4 MiB.
std::size_t default_slot_bytes(int size) {
  const std::size_t share = kSegmentBudget / (2 * (static_cast<std::size_t>(size) + 1));
  return std::clamp<std::size_t>(share / kPage * kPage, std::size_t{256} << 10,
                                 std::size_t{4} << 20);
}

}  // namespace

Mapping shm::map_segment(const std::string& name, std::size_t bytes, bool create) {
  Mapping m;
  const int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    m.error = fmt::format("shm_open({}): {}", name, std::strerror(errno));
    return m;
  }
  // posix_fallocate reserves the pages now, so a full /dev/shm is an error
  // here instead of a SIGBUS on first touch.
  int rc = 0;
  if (create && (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
                 (rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes))) != 0)) {
    m.error = fmt::format("sizing {} to {} bytes: {}", name, bytes, std::strerror(rc ? rc : errno));
  } else {
    m.base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m.base == MAP_FAILED) m.error = fmt::format("mmap({}): {}", name, std::strerror(errno));
  }
  ::close(fd);
  if (create && !m.error.empty()) ::shm_unlink(name.c_str());
  return m;
}

std::string shm::unique_segment_name(const char* kind) {
  static std::atomic<unsigned> counter{0};
  std::random_device random;
  return fmt::format("/bagua-{}-{}-{}-{:08x}", kind, ::getpid(), counter++, random());
}

std::string shared_memory_host_key() {
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) return {};
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  const std::string net = namespace_id("net"), mnt = namespace_id("mnt"), pid = namespace_id("pid");
  if (boot.empty() || net.empty() || mnt.empty() || pid.empty()) return {};
  return fmt::format("{}|{}|{}|{}|{}", host.data(), boot, net, mnt, pid);
}

// -- setting up ------------------------------------------------------------------

std::vector<std::string> shm::allgather_strings(Communicator& comm, const std::string& mine,
                                                std::size_t width) {
  std::vector<char> send(width, '\0'), recv(width * static_cast<std::size_t>(comm.size()));
  std::memcpy(send.data(), mine.data(), std::min(width - 1, mine.size()));
  const auto as_view = [](std::vector<char>& v) {
    return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kUInt8, Device{}};
  };
  comm.allgather(as_view(send), as_view(recv));
  std::vector<std::string> out;
  out.reserve(static_cast<std::size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) out.emplace_back(recv.data() + r * width);
  return out;
}

Mapping shm::create_shared_segment(Communicator& comm, const char* kind, std::size_t bytes,
                                   const std::function<void(void*)>& construct) {
  const int rank = comm.rank();
  std::string name = rank == 0 ? unique_segment_name(kind) : std::string();
  Mapping mapping;
  if (rank == 0) {
    mapping = map_segment(name, bytes, /*create=*/true);
    if (mapping.error.empty()) construct(mapping.base);  // before any peer maps it
  }
  name = allgather_strings(comm, mapping.error.empty() ? name : "", kNameBytes)[0];
  if (rank != 0 && !name.empty()) mapping = map_segment(name, bytes, /*create=*/false);
  if (rank != 0 && name.empty()) mapping.error = "rank 0 could not create the segment";
  const auto errors = allgather_strings(comm, mapping.error, kNameBytes);
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());  // all have it open or gave up
  const auto failed =
      std::find_if(errors.begin(), errors.end(), [](auto& e) { return !e.empty(); });
  if (failed != errors.end()) {
    if (mapping.base != MAP_FAILED) ::munmap(mapping.base, bytes);
    return Mapping{MAP_FAILED, fmt::format("rank {}: {}", failed - errors.begin(), *failed)};
  }
  return mapping;
}

namespace {

// Starts the lifetime of the control block's atomics in fresh (zeroed) memory.
template <typename Control>
void construct_control_block(void* base, int size) {
  auto* control = new (base) Control();
  for (int r = 0; r < size; ++r) new (&control->rank(r)) RankState();
}

// Whether every rank can read the next rank's memory with process_vm_readv
// (the kernel may refuse: Yama's ptrace scope, seccomp, other users).
// Collective over `comm`.
bool peers_memory_reachable(Communicator& comm, const std::string& group_name) {
  static const std::uint64_t probe = 0x62616775612d766dULL;  // what every rank reads
  const auto mine = fmt::format("{} {}", ::getpid(), reinterpret_cast<std::uintptr_t>(&probe));
  const auto all = allgather_strings(comm, mine, kNameBytes);
  const int next = (comm.rank() + 1) % comm.size();
  long pid = 0;
  std::uintptr_t address = 0;
  std::string error;
  if (std::sscanf(all[static_cast<std::size_t>(next)].c_str(), "%ld %lu", &pid,
                  reinterpret_cast<unsigned long*>(&address)) != 2) {
    error = "bad probe record";
  } else {
    std::uint64_t seen = 0;
    const iovec local{&seen, sizeof(seen)}, remote{reinterpret_cast<void*>(address), sizeof(seen)};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof(seen)) || seen != probe) {
      error = fmt::format("process_vm_readv of rank {}: {}", next,
                          n < 0 ? std::strerror(errno) : "wrong bytes");
    }
  }
  const auto errors = allgather_strings(comm, error, kNameBytes);
  const auto failed =
      std::find_if(errors.begin(), errors.end(), [](auto& e) { return !e.empty(); });
  if (failed != errors.end()) {
    log().info("group '{}': direct allreduce unavailable (rank {}: {}); using the slots",
               group_name, failed - errors.begin(), *failed);
    return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<SharedMemoryGroup> SharedMemoryGroup::attach(Communicator& comm,
                                                             const SharedMemoryOptions& options,
                                                             const std::string& group_name) {
  const int rank = comm.rank(), size = comm.size();
  if (size < 2) return nullptr;  // nothing to share
  const auto keys = allgather_strings(comm, shared_memory_host_key(), kKeyBytes);
  if (keys[0].empty() ||
      std::any_of(keys.begin(), keys.end(), [&](auto& k) { return k != keys[0]; })) {
    log().debug("group '{}': ranks are not on one host; allreduce stays on the network",
                group_name);
    return nullptr;
  }
  const std::size_t slot =
      std::max(options.slot_bytes ? round_up(options.slot_bytes, kLine) : default_slot_bytes(size),
               static_cast<std::size_t>(size) * kLine);  // alltoall: a line per peer at least
  const std::size_t bytes = Control::bytes(size) + 2 * (static_cast<std::size_t>(size) + 1) * slot;
  const Mapping mapping = create_shared_segment(comm, "collectives", bytes, [&](void* base) {
    construct_control_block<Control>(base, size);
  });
  if (!mapping.error.empty()) {
    log().warn("group '{}': shared-memory allreduce unavailable ({}); using the network",
               group_name, mapping.error);
    return nullptr;
  }
  const bool direct = options.direct_min_bytes > 0 && env().shared_memory_direct &&
                      peers_memory_reachable(comm, group_name);
  log().debug("group '{}': allreduce through shared memory ({} slots of {} bytes{})", group_name,
              size, slot, direct ? ", direct" : "");
  return std::unique_ptr<SharedMemoryGroup>(new SharedMemoryGroup(
      mapping.base, bytes, rank, size, slot, direct ? options.direct_min_bytes : 0, group_name));
}

SharedMemoryGroup::SharedMemoryGroup(void* base, std::size_t bytes, int rank, int size,
                                     std::size_t slot_bytes, std::int64_t direct_min_bytes,
                                     std::string group_name)
    : base_(base),
      bytes_(bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      direct_min_bytes_(direct_min_bytes),
      group_name_(std::move(group_name)),
      control_(static_cast<Control*>(base)),
      data_(static_cast<std::byte*>(base) + Control::bytes(size)) {
  control_->rank(rank).pid.store(static_cast<std::int32_t>(::getpid()));
}

SharedMemoryGroup::~SharedMemoryGroup() { ::munmap(base_, bytes_); }

// -- the protocol -------------------------------------------------------------------

std::byte* SharedMemoryGroup::slot(std::uint64_t piece, int rank) const {
  const std::size_t set = piece % 2, areas = static_cast<std::size_t>(size_) + 1;
  return data_ + (set * areas + static_cast<std::size_t>(rank)) * slot_bytes_;
}

std::byte* SharedMemoryGroup::result(std::uint64_t piece) const { return slot(piece, size_); }

std::uint64_t SharedMemoryGroup::begin_piece(Waiter& waiter) {
  const std::uint64_t piece = ++pieces_done_;
  if (piece > 2) waiter.wait_all(Stage::kConsumed, piece - 2);
  return piece;
}

void SharedMemoryGroup::allreduce(const TensorView& buffer, ReduceOp op,
                                  std::chrono::milliseconds timeout,
                                  const std::atomic<bool>& aborted) {
  BAGUA_CHECK_ARG(buffer.device.type == DeviceType::kCPU,
                  "shared-memory allreduce needs host memory, got {}", buffer.describe());
  Waiter waiter(*this, "allreduce", buffer, timeout, aborted);
  if (direct(buffer.nbytes())) {
    direct_allreduce(buffer, op, waiter);
    return;
  }
  const auto per_piece = static_cast<std::int64_t>(slot_bytes_ / dtype_size(buffer.dtype));
  for (std::int64_t offset = 0; offset < buffer.numel; offset += per_piece) {
    reduce_piece(buffer, offset, std::min(per_piece, buffer.numel - offset), op, waiter);
  }
}

void SharedMemoryGroup::reduce_piece(const TensorView& buffer, std::int64_t offset,
                                     std::int64_t count, ReduceOp op, Waiter& waiter) {
  const std::size_t element = dtype_size(buffer.dtype);
  std::byte* const source = buffer.bytes() + offset * element;
  // This rank reduces segment [begin, end) of the piece; no peer reads that
  // segment of this rank's slot, so it never goes there: the reduction reads
  // it from the buffer and writes the result back in place.
  const std::int64_t begin = count * rank_ / size_, end = count * (rank_ + 1) / size_;
  const std::size_t head = begin * element, own = (end - begin) * element,
                    tail = (count - end) * element;
  const auto around_own = [&](std::byte* to, const std::byte* from) {
    std::memcpy(to, from, head);
    std::memcpy(to + head + own, from + head + own, tail);
  };
  // Each stage and wait is a phase on the timeline of the op running this
  // (bench/step_time.py --breakdown); nothing without one.
  // 1. copy in, once every rank has consumed what this slot set held before
  std::uint64_t piece = 0;
  {
    const TimelinePhase phase("shm.wait_slot");
    piece = begin_piece(waiter);
  }
  {
    const TimelinePhase phase("shm.copy_in");
    around_own(slot(piece, rank_), source);
  }
  control_->publish(rank_, Stage::kWritten, piece);
  // 2. reduce this rank's segment over the ranks' copies, in rank order
  {
    const TimelinePhase phase("shm.wait_written");
    waiter.wait_all(Stage::kWritten, piece);
  }
  if (own > 0) {
    const TimelinePhase phase("shm.reduce");
    reduce_segment(buffer.dtype, source + head, piece, head, own / element, op);
  }
  control_->publish(rank_, Stage::kReduced, piece);
  // 3. copy the peers' reduced segments out
  {
    const TimelinePhase phase("shm.wait_reduced");
    waiter.wait_all(Stage::kReduced, piece);
  }
  {
    const TimelinePhase phase("shm.copy_out");
    around_own(source, result(piece));
  }
  control_->publish(rank_, Stage::kConsumed, piece);
}

void SharedMemoryGroup::reduce_segment(DType dtype, std::byte* mine, std::uint64_t piece,
                                       std::size_t at, std::size_t n, ReduceOp op) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    // Block by block, so a block's partial sums and result stay in L1 from
    // the first pass to the copy into the result area.
    constexpr std::size_t kBlock = kReduceBlockBytes / sizeof(T);
    for (std::size_t first = 0; first < n; first += kBlock) {
      const std::size_t count = std::min(kBlock, n - first);
      T* const out = reinterpret_cast<T*>(mine) + first;
      // Rank r's copy of the block: this rank's own is `out` itself, read by
      // the pass that adds it before the pass's result overwrites it (each
      // pass goes element by element), so `out` can hold the partial sums.
      const auto copy_of = [&](int r) -> const T* {
        return r == rank_ ? out : reinterpret_cast<const T*>(slot(piece, r) + at) + first;
      };
      T* const partial = rank_ <= 1 ? out : reinterpret_cast<T*>(result(piece) + at) + first;
      for (int r = 1; r < size_; ++r) {  // (groups here have 2 ranks or more)
        const bool last = r == size_ - 1;
        T* const into = last ? out : partial;
        const T* const sum = r == 1 ? copy_of(0) : partial;
        if (op == ReduceOp::kAvg && last) {
          sum_then_divide<T>(into, sum, copy_of(r), count, size_);  // one pass fewer
        } else {
          reduce_elements<T>(op, into, sum, copy_of(r), count);
        }
      }
      std::memcpy(result(piece) + at + first * sizeof(T), out, count * sizeof(T));  // for the peers
    }
  });
}

template <typename Fill, typename Drain>
void SharedMemoryGroup::exchange_piece(Fill&& fill_slot, Drain&& drain_slot, Waiter& waiter) {
  const std::uint64_t piece = begin_piece(waiter);
  fill_slot(slot(piece, rank_));
  control_->publish(rank_, Stage::kWritten, piece);
  waiter.wait_all(Stage::kWritten, piece);
  for (int r = 0; r < size_; ++r) drain_slot(r, static_cast<const std::byte*>(slot(piece, r)));
  control_->publish(rank_, Stage::kConsumed, piece);
}

void SharedMemoryGroup::allgather(const TensorView& send, const TensorView& recv,
                                  std::chrono::milliseconds timeout,
                                  const std::atomic<bool>& aborted) {
  Waiter waiter(*this, "allgather", send, timeout, aborted);
  const std::size_t total = send.nbytes();
  for (std::size_t offset = 0; offset < total; offset += slot_bytes_) {
    const std::size_t length = std::min(slot_bytes_, total - offset);
    exchange_piece([&](std::byte* mine) { std::memcpy(mine, send.bytes() + offset, length); },
                   [&](int r, const std::byte* theirs) {
                     std::memcpy(recv.bytes() + r * total + offset, theirs, length);
                   },
                   waiter);
  }
}

void SharedMemoryGroup::broadcast(const TensorView& buffer, int root,
                                  std::chrono::milliseconds timeout,
                                  const std::atomic<bool>& aborted) {
  Waiter waiter(*this, "broadcast", buffer, timeout, aborted);
  const std::size_t total = buffer.nbytes();
  const bool is_root = rank_ == root;
  for (std::size_t offset = 0; offset < total; offset += slot_bytes_) {
    const std::size_t length = std::min(slot_bytes_, total - offset);
    exchange_piece(
        [&](std::byte* mine) {
          if (is_root) std::memcpy(mine, buffer.bytes() + offset, length);
        },
        [&](int r, const std::byte* theirs) {
          if (r == root && !is_root) std::memcpy(buffer.bytes() + offset, theirs, length);
        },
        waiter);
  }
}

void SharedMemoryGroup::alltoall(const TensorView& send, const TensorView& recv,
                                 std::chrono::milliseconds timeout,
                                 const std::atomic<bool>& aborted) {
  Waiter waiter(*this, "alltoall", send, timeout, aborted);
  const std::size_t chunk = send.nbytes() / static_cast<std::size_t>(size_);
  const std::size_t per_peer = slot_bytes_ / static_cast<std::size_t>(size_);
  for (std::size_t offset = 0; offset < chunk; offset += per_peer) {
    const std::size_t length = std::min(per_peer, chunk - offset);
    exchange_piece(
        [&](std::byte* mine) {  // this rank's piece of every destination's chunk
          for (int r = 0; r < size_; ++r) {
            std::memcpy(mine + r * per_peer, send.bytes() + r * chunk + offset, length);
          }
        },
        [&](int r, const std::byte* theirs) {
          std::memcpy(recv.bytes() + r * chunk + offset, theirs + rank_ * per_peer, length);
        },
        waiter);
  }
}

}  // namespace bagua

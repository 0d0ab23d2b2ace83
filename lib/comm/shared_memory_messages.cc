// Point-to-point mailboxes in shared memory (see
// include/bagua/comm/shared_memory_messages.h).
#include "bagua/comm/shared_memory_messages.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bagua/comm/shared_memory.h"
#include "bagua/core/errors.h"
#include "bagua/core/logging.h"
#include "comm/shared_memory_control.h"
#include "comm/shared_memory_segment.h"

namespace bagua {

using namespace shm;

namespace {

// The largest message of a P-Reduce that goes directly (64 KiB to one
// peer, at 2 members) with its 32-byte header, rounded up to a line.
constexpr std::size_t kLargestMessage = (std::size_t{64} << 10) + kLine;
constexpr std::size_t kMailboxBudget = std::size_t{4} << 20;
constexpr std::size_t kSmallestMessage = std::size_t{1} << 10;

// How many bytes a mailbox of a group of `size` ranks holds; 0: none.
std::size_t capacity_for(int size) {
  const auto pairs = static_cast<std::size_t>(size) * static_cast<std::size_t>(size - 1);
  const std::size_t share = kMailboxBudget / pairs;
  const std::size_t room = share > kLine ? (share - kLine) / kLine * kLine : 0;
  const std::size_t capacity = std::min(kLargestMessage, room);
  return capacity < kSmallestMessage ? 0 : capacity;
}

// Sleeps on `word` (last read as `seen`) for at most `slice`, counted in
// `sleepers` so that a waker skips the system call when nobody sleeps.
void sleep_on(std::atomic<std::uint32_t>& word, std::atomic<std::uint32_t>& sleepers,
              std::uint32_t seen, std::chrono::nanoseconds slice) {
  const timespec span{static_cast<time_t>(slice.count() / 1000000000),
                      std::max<long>(1000, static_cast<long>(slice.count() % 1000000000))};
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  futex(&word, FUTEX_WAIT, seen, &span);
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// Bumps `word` and wakes whoever sleeps on it.
void wake(std::atomic<std::uint32_t>& word, std::atomic<std::uint32_t>& sleepers) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace

// What a rank sleeps on: `arrived` when it waits for messages, `freed` when
// it waits for room in a peer's mailbox (separate, so that a taken message
// does not wake a rank waiting for messages).
struct alignas(kLine) SharedMemoryMessages::RankLine {
  std::atomic<std::uint32_t> arrived{0};
  std::atomic<std::uint32_t> arrived_sleepers{0};
  std::atomic<std::uint32_t> freed{0};
  std::atomic<std::uint32_t> freed_sleepers{0};
  std::atomic<std::int32_t> pid{0};
};

struct alignas(kLine) SharedMemoryMessages::Mailbox {
  std::atomic<std::uint64_t> posted{0};  // messages written so far
  std::atomic<std::uint64_t> taken{0};   // messages the destination has read
  // Of the message in the box (written before `posted`, read after it).
  std::atomic<std::uint64_t> tag{0};
  std::atomic<std::uint64_t> bytes{0};
};

static_assert(sizeof(std::atomic<std::uint64_t>) == sizeof(std::uint64_t) &&
                  std::atomic<std::uint64_t>::is_always_lock_free,
              "mailbox counters in shared memory must be lock-free atomics");

// The waits of one exchange: bounded by the deadline, watching the abort flag
// and the processes of the peers waited on.
class SharedMemoryMessages::Wait {
 public:
  Wait(const SharedMemoryMessages& owner, std::chrono::milliseconds timeout,
       const std::atomic<bool>& aborted)
      : owner_(owner),
        timeout_(timeout),
        aborted_(aborted),
        deadline_(std::chrono::steady_clock::now() + timeout),
        spin_(static_cast<unsigned>(owner.size_) <= std::thread::hardware_concurrency()) {}

  // Until `ready()`, sleeping on `word` of this rank's line; `waiting_on`
  // says for what (the peers and their messages) in errors.
  template <typename Ready, typename Peers>
  void until(Ready&& ready, std::atomic<std::uint32_t> RankLine::*word,
             std::atomic<std::uint32_t> RankLine::*sleepers, Peers&& waiting_on) {
    if (spin_) {  // peers on cores of their own usually answer within microseconds
      for (int i = 0; i < 256; ++i) {
        if (ready()) return;
        cpu_relax();
      }
    }
    RankLine& mine = owner_.line(owner_.rank_);
    // The peers' processes are looked up once a slice, not at every wake-up.
    auto next_check = std::chrono::steady_clock::now() + kSlice;
    while (true) {
      const std::uint32_t seen = (mine.*word).load(std::memory_order_seq_cst);
      if (ready()) return;
      const auto now = std::chrono::steady_clock::now();
      if (aborted_.load() || now >= next_check || now >= deadline_) {
        check(waiting_on());
        next_check = now + kSlice;
      }
      sleep_on(mine.*word, mine.*sleepers, seen, std::min(next_check, deadline_) - now);
    }
  }

 private:
  // Throws when the wait cannot succeed: aborted, a peer waited on has
  // exited, or the deadline passed.
  void check(const std::vector<std::pair<int, std::string>>& waiting_on) const {
    const auto where = [&] {
      return fmt::format("message exchange on rank {} of {} (shared memory, group '{}')",
                         owner_.rank_, owner_.size_, owner_.group_name_);
    };
    if (aborted_.load()) throw BackendError(where() + ": the communicator was aborted");
    for (const auto& [peer, what] : waiting_on) {
      const int pid = owner_.line(peer).pid.load();
      if (pid > 0 && process_exited(pid)) {
        throw BackendError(
            fmt::format("{}: rank {} (pid {}) has exited ({})", where(), peer, pid, what));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline_) {
      std::vector<std::string> waits;
      for (const auto& entry : waiting_on) waits.push_back(entry.second);
      throw TimeoutError(fmt::format("{}: timed out after {} ms waiting for {}", where(),
                                     timeout_.count(), fmt::join(waits, ", ")));
    }
  }

  const SharedMemoryMessages& owner_;
  std::chrono::milliseconds timeout_;
  const std::atomic<bool>& aborted_;
  std::chrono::steady_clock::time_point deadline_;
  bool spin_;
};

// -- setting up ------------------------------------------------------------------

std::size_t SharedMemoryMessages::segment_bytes(int size, std::size_t capacity) {
  const auto n = static_cast<std::size_t>(size);
  return round_up(n * sizeof(RankLine) + n * (n - 1) * (sizeof(Mailbox) + capacity), kPage);
}

std::unique_ptr<SharedMemoryMessages> SharedMemoryMessages::attach(Communicator& comm,
                                                                   const std::string& group_name) {
  const int rank = comm.rank(), size = comm.size();
  if (size < 2) return nullptr;
  const std::size_t capacity = capacity_for(size);
  const auto keys = allgather_strings(comm, shared_memory_host_key(), kKeyBytes);
  if (capacity == 0 || keys[0].empty() ||
      std::any_of(keys.begin(), keys.end(), [&](auto& k) { return k != keys[0]; })) {
    log().debug("group '{}': no shared-memory mailboxes ({}); messages stay on the network",
                group_name, capacity == 0 ? "too many ranks" : "ranks on several hosts");
    return nullptr;
  }
  const std::size_t bytes = segment_bytes(size, capacity);
  const Mapping mapping = create_shared_segment(comm, "mailboxes", bytes, [&](void* base) {
    auto* at = static_cast<std::byte*>(base);  // the atomics' lifetimes start here
    for (int r = 0; r < size; ++r) new (at + r * sizeof(RankLine)) RankLine();
    at += static_cast<std::size_t>(size) * sizeof(RankLine);
    for (int box = 0; box < size * (size - 1); ++box) {
      new (at + static_cast<std::size_t>(box) * (sizeof(Mailbox) + capacity)) Mailbox();
    }
  });
  if (!mapping.error.empty()) {
    log().warn("group '{}': shared-memory mailboxes unavailable ({}); using the network",
               group_name, mapping.error);
    return nullptr;
  }
  log().debug("group '{}': P-Reduce messages through shared memory ({} mailboxes of {} bytes)",
              group_name, size * (size - 1), capacity);
  return std::unique_ptr<SharedMemoryMessages>(
      new SharedMemoryMessages(mapping.base, bytes, rank, size, capacity, group_name));
}

SharedMemoryMessages::SharedMemoryMessages(void* base, std::size_t bytes, int rank, int size,
                                           std::size_t capacity, std::string group_name)
    : base_(base),
      bytes_(bytes),
      rank_(rank),
      size_(size),
      capacity_(capacity),
      stride_(sizeof(Mailbox) + capacity),
      group_name_(std::move(group_name)),
      post_locks_(new std::mutex[static_cast<std::size_t>(size)]),
      take_locks_(new std::mutex[static_cast<std::size_t>(size)]) {
  line(rank).pid.store(static_cast<std::int32_t>(::getpid()));
}

SharedMemoryMessages::~SharedMemoryMessages() { ::munmap(base_, bytes_); }

SharedMemoryMessages::RankLine& SharedMemoryMessages::line(int rank) const {
  return *reinterpret_cast<RankLine*>(static_cast<std::byte*>(base_) +
                                      static_cast<std::size_t>(rank) * sizeof(RankLine));
}

SharedMemoryMessages::Mailbox& SharedMemoryMessages::mailbox(int source, int destination) const {
  // Pairs in source-major order, the diagonal left out.
  const int column = destination < source ? destination : destination - 1;
  const auto index = static_cast<std::size_t>(source) * static_cast<std::size_t>(size_ - 1) +
                     static_cast<std::size_t>(column);
  auto* first = static_cast<std::byte*>(base_) + static_cast<std::size_t>(size_) * sizeof(RankLine);
  return *reinterpret_cast<Mailbox*>(first + index * stride_);
}

std::byte* SharedMemoryMessages::payload(int source, int destination) const {
  return reinterpret_cast<std::byte*>(&mailbox(source, destination)) + sizeof(Mailbox);
}

// -- the exchange -------------------------------------------------------------------

void SharedMemoryMessages::exchange(std::span<const PeerMessage> sends,
                                    std::span<const PeerMessage> receives,
                                    std::chrono::milliseconds timeout,
                                    const std::atomic<bool>& aborted) {
  for (const auto& message : sends) {
    BAGUA_CHECK_ARG(message.buffer.nbytes() <= capacity_,
                    "message exchange on rank {} (group '{}'): {} to rank {} exceeds the "
                    "mailbox's {} bytes",
                    rank_, group_name_, message.buffer.describe(), message.peer, capacity_);
  }
  Wait wait(*this, timeout, aborted);
  for (const auto& message : sends) {
    if (message.buffer.numel > 0) post(message, wait);
  }
  std::vector<const PeerMessage*> pending;
  for (const auto& message : receives) {
    if (message.buffer.numel > 0) pending.push_back(&message);
  }
  const auto take_arrived = [&] {
    std::erase_if(pending, [&](const PeerMessage* message) { return try_take(*message); });
    return pending.empty();
  };
  const auto waiting_on = [&] {
    std::vector<std::pair<int, std::string>> peers;
    for (const auto* message : pending) {
      peers.emplace_back(message->peer, fmt::format("rank {}'s message tagged {:#x}", message->peer,
                                                    message->tag));
    }
    return peers;
  };
  wait.until(take_arrived, &RankLine::arrived, &RankLine::arrived_sleepers, waiting_on);
}

void SharedMemoryMessages::post(const PeerMessage& message, Wait& wait) {
  const int peer = message.peer;
  const std::lock_guard lock(post_locks_[static_cast<std::size_t>(peer)]);
  Mailbox& box = mailbox(rank_, peer);
  const std::uint64_t posted = box.posted.load(std::memory_order_relaxed);
  // The peer's previous message from this rank is taken within its call,
  // which waits on nothing this rank has yet to send: this wait ends.
  wait.until([&] { return box.taken.load(std::memory_order_acquire) == posted; }, &RankLine::freed,
             &RankLine::freed_sleepers,
             [&] {
               return std::vector<std::pair<int, std::string>>{
                   {peer, fmt::format("rank {} to take this rank's previous message", peer)}};
             });
  std::memcpy(payload(rank_, peer), message.buffer.data, message.buffer.nbytes());
  box.tag.store(message.tag, std::memory_order_relaxed);
  box.bytes.store(message.buffer.nbytes(), std::memory_order_relaxed);
  box.posted.store(posted + 1, std::memory_order_release);
  RankLine& to = line(peer);
  wake(to.arrived, to.arrived_sleepers);
}

bool SharedMemoryMessages::try_take(const PeerMessage& message) {
  const int peer = message.peer;
  const std::lock_guard lock(take_locks_[static_cast<std::size_t>(peer)]);
  Mailbox& box = mailbox(peer, rank_);
  const std::uint64_t posted = box.posted.load(std::memory_order_acquire);
  if (posted == box.taken.load(std::memory_order_relaxed)) return false;
  if (box.tag.load(std::memory_order_relaxed) != message.tag) return false;  // another call's
  const std::size_t bytes = box.bytes.load(std::memory_order_relaxed);
  if (bytes > message.buffer.nbytes()) {
    throw BackendError(fmt::format(
        "message exchange on rank {} of {} (shared memory, group '{}'): rank {} sent {} bytes "
        "tagged {:#x}, the receive holds {}",
        rank_, size_, group_name_, peer, bytes, message.tag, message.buffer.nbytes()));
  }
  std::memcpy(message.buffer.data, payload(peer, rank_), bytes);
  box.taken.store(posted, std::memory_order_release);
  RankLine& from = line(peer);
  wake(from.freed, from.freed_sleepers);
  return true;
}

}  // namespace bagua

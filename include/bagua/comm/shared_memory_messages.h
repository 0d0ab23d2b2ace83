// Point-to-point messages through shared memory, for the small exchanges of
// a P-Reduce among ranks that share a host.
//
// Over loopback TCP a message wakes Gloo's event-loop thread, which reads it
// and then wakes the receiving thread: with more ranks than cores each
// wake-up waits for a core, and a P-Reduce of a few floats took a full round
// of that (3 ms median at 6 ranks on 2 cores, docs/benchmarks.md, "Ripples:
// P-Reduce latency"). Here the sender writes the message into the
// receiver's mailbox and wakes the receiving thread itself: one wake-up.
//
// Layout: one line per rank (the futex words it sleeps on), then a mailbox
// per ordered pair of ranks (source, destination), each a header line and
// room for one message of capacity() bytes. capacity() is 64 KiB and 64
// bytes (the largest message of a P-Reduce that goes directly, with its
// header) while the mailboxes fit a 4 MiB budget, smaller beyond (up to 8
// ranks it is the full size); below 1 KiB the group has no mailboxes.
//
// Protocol, for a mailbox:
//   - send: wait until the destination took the previous message (taken ==
//     posted), write the payload, its tag and size, then posted + 1
//     (release) and wake the destination if it sleeps;
//   - receive: the message in the mailbox is taken only by a receive of the
//     same tag (a receive of another call on another thread leaves it for
//     that one); copy it out, then taken = posted and wake the sender if it
//     waits for room.
// Messages of one pair are therefore taken in the order they were sent, one
// at a time, as Gloo's tagged messages are when each call sends one message
// per peer. Every wait is bounded by the timeout and watches the peers'
// processes (a peer that exited is an error at once, naming it) and the
// communicator's abort flag.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "bagua/comm/communicator.h"

namespace bagua {

class SharedMemoryMessages {
 public:
  // Collective over `comm` (usable for allgather): the mailboxes of its
  // ranks, or null on every rank when they are not all on one host, the
  // group is too large for mailboxes, or any rank failed to map them (the
  // reason is logged).
  static std::unique_ptr<SharedMemoryMessages> attach(Communicator& comm,
                                                      const std::string& group_name);
  ~SharedMemoryMessages();
  SharedMemoryMessages(const SharedMemoryMessages&) = delete;
  SharedMemoryMessages& operator=(const SharedMemoryMessages&) = delete;

  // The largest message a mailbox holds, the same on every rank.
  std::size_t capacity() const { return capacity_; }

  // Posts every send, then takes every receive as its message arrives
  // (empty messages are skipped, as over Gloo). A received message may be
  // shorter than its buffer; a longer one is an error naming both sizes.
  // Sends of more than capacity() bytes are InvalidArgument.
  void exchange(std::span<const PeerMessage> sends, std::span<const PeerMessage> receives,
                std::chrono::milliseconds timeout, const std::atomic<bool>& aborted);

 private:
  struct RankLine;
  struct Mailbox;
  class Wait;

  SharedMemoryMessages(void* base, std::size_t bytes, int rank, int size, std::size_t capacity,
                       std::string group_name);
  static std::size_t segment_bytes(int size, std::size_t capacity);
  RankLine& line(int rank) const;
  Mailbox& mailbox(int source, int destination) const;
  std::byte* payload(int source, int destination) const;

  void post(const PeerMessage& message, Wait& wait);
  // Takes the message of `message.peer` into its buffer if one of its tag
  // is there; returns whether it did.
  bool try_take(const PeerMessage& message);

  void* base_;
  std::size_t bytes_;
  int rank_;
  int size_;
  std::size_t capacity_;
  std::size_t stride_;  // bytes of one mailbox: header line and payload
  std::string group_name_;
  // This process's threads take turns on a mailbox: one posts to a
  // destination at a time, one takes from a source at a time.
  std::unique_ptr<std::mutex[]> post_locks_;
  std::unique_ptr<std::mutex[]> take_locks_;
};

}  // namespace bagua

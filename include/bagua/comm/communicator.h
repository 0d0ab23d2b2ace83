// The Communicator: collectives among a fixed group of ranks.
//
// Contract (as in c10d's backends):
// - Every rank of the group calls the same collectives in the same order;
//   the runtime guarantees this by scheduling buckets in registration order.
// - Calls are blocking and thread-compatible: one thread at a time per
//   communicator. The Python user API and the communication thread each get
//   their own communicator so they never interleave on one.
// - Buffers are contiguous TensorViews; `send` and `recv` may alias (in place).
// - Every wait is bounded by the communicator's timeout; a timeout becomes a
//   TimeoutError and any other transport failure a BackendError, both naming
//   the op, the rank and the sizes involved.
// - Membership is fixed: `new_group` is itself collective over this group.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bagua/core/reduce_op.h"
#include "bagua/core/tensor_view.h"

namespace bagua {

// Bytes this rank moved, summed over calls; read by telemetry and benchmarks.
struct CommCounters {
  std::atomic<std::int64_t> bytes_sent{0};
  std::atomic<std::int64_t> bytes_received{0};
  std::atomic<std::int64_t> calls{0};
};

// One point-to-point message of a grouped exchange.
struct PeerMessage {
  TensorView buffer;
  int peer = -1;
  // 0: matched in program order with the other untagged messages between
  // the two ranks. Otherwise matched only with the other side's message of
  // the same tag (Gloo), so a message meant for another call times out
  // instead of landing in this call's buffer. NCCL matches every message in
  // program order.
  std::uint64_t tag = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend_name() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  // Whether buffers on devices of `type` can be passed to this communicator
  // (Gloo: host memory only; NCCL: CUDA memory, host memory staged).
  virtual bool supports(DeviceType type) const { return type == DeviceType::kCPU; }

  // The collectives are thin funnels: each checks its arguments once, here
  // for every backend (InvalidArgument naming the op, the rank and the
  // sizes), returns when there are no elements to move, and hands over to
  // the backend's do_* implementation.

  // recv = op over ranks of send. kAvg divides the sum by size().
  void allreduce(const TensorView& send, const TensorView& recv, ReduceOp op);
  // recv on `root` = op over ranks of send; recv is ignored on other ranks.
  void reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op);
  // buffer on every rank = buffer on root.
  void broadcast(const TensorView& buffer, int root);
  // recv (size() * send.numel) = concatenation of send over ranks.
  void allgather(const TensorView& send, const TensorView& recv);
  // As allgather, with the result only on root.
  void gather(const TensorView& send, const TensorView& recv, int root);
  // recv on rank r = chunk r of send on root (send has size() * recv.numel).
  void scatter(const TensorView& send, const TensorView& recv, int root);
  // recv (send.numel / size()) on rank r = op over ranks of chunk r of send.
  void reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op);
  // chunk j of recv on rank i = chunk i of send on rank j (equal chunks).
  void alltoall(const TensorView& send, const TensorView& recv);
  // One message to / from another rank of the group (a send_recv of one).
  void send(const TensorView& buffer, int peer);
  void recv(const TensorView& buffer, int peer);
  // Posts every send and receive, then waits for all: a group of exchanges
  // that cannot deadlock whatever order the peers list them in. Messages to
  // the same peer match in list order.
  void send_recv(std::span<const PeerMessage> sends, std::span<const PeerMessage> receives);
  // As send_recv, through shared memory, when the communicator's ranks share
  // a host and every send and receive buffer fits its mailboxes (Gloo, see
  // bagua/comm/shared_memory_messages.h); otherwise it sends nothing and
  // returns false. Both ends of a message must pass buffers of the sizes
  // that lead to the same answer (the P-Reduce's exchanges do: their sizes
  // follow from the member count and the tensor). Messages are matched by
  // tag, as over Gloo.
  bool send_recv_on_host(std::span<const PeerMessage> sends, std::span<const PeerMessage> receives);
  // The largest message send_recv_on_host carries (the same on every rank);
  // 0 when it carries none.
  virtual std::size_t host_message_capacity() const { return 0; }
  void barrier() { do_barrier(); }

  // P-Reduce: recv on every member = op over the members' send. Only the
  // members call it (`members`: sorted, unique, containing this rank);
  // everyone else is not involved, so calls of disjoint groups run
  // concurrently on one communicator. The traffic is point-to-point among
  // the members (a ring reduce-scatter, then an allgather): no communicator
  // per group. Every chunk is reduced once and copied, so all members end
  // bit-identical. Messages carry a tag derived from `members` and
  // `group_id`: members that disagree on the group time out naming it rather
  // than mixing data. Groups sharing members must be called in the same
  // relative order by those members. `verify`: the members first exchange
  // element count, dtype and op, and a mismatch is an InvalidArgument on
  // every member.
  void partial_allreduce(const TensorView& send, const TensorView& recv,
                         std::span<const int> members, ReduceOp op, std::uint64_t group_id,
                         bool verify = false);
  // The receiving end of a control channel (a service answering any rank):
  // one message tagged `tag` (sent with a PeerMessage of that tag, exactly
  // buffer's size) from whichever of `peers` sends first; returns its rank.
  // `wait_forever`: a server idling between requests waits without a bound,
  // ended by a message, the sender's connection failing, or abort() from
  // another thread (BackendError); otherwise the communicator's timeout
  // bounds it. Gloo only; other backends raise InvalidArgument.
  int recv_any(const TensorView& buffer, std::span<const int> peers, std::uint64_t tag,
               bool wait_forever = false);
  // The same from one `peer`. The receive is announced to the peer when it
  // is posted (an any-source receive answers each sender's notice first), so
  // the peer's message leaves at once, and a failure of the peer's
  // connection ends the wait at once. Gloo only.
  void recv_from(const TensorView& buffer, int peer, std::uint64_t tag, bool wait_forever = false);
  // A group id for callers without one (the Python API): how many times this
  // rank has asked for `members` before. Members asking in the same order
  // get the same ids.
  std::uint64_t next_partial_id(std::span<const int> members);

  // Marks the communicator unusable; later calls throw. Safe from any thread.
  virtual void abort() noexcept = 0;

  // The ranks whose connection to this rank has been closed or reset (their
  // process exited or died, or the network failed), as known now, without
  // waiting or sending anything. Errors of the Gloo backend name them; a
  // service uses it to tell a dead peer from a slow one. Empty where the
  // backend cannot tell (NCCL), and after a timeout (Gloo then closes every
  // connection itself, so they say nothing about the peers).
  virtual std::vector<int> lost_peers() { return {}; }

  // Collective over this group: every rank calls it with the same `ranks`
  // (sorted, unique, within [0, size())). Members get a communicator whose
  // rank r is ranks[r]; non-members get nullptr.
  std::unique_ptr<Communicator> new_group(std::span<const int> ranks);

  // Like new_group, for the buckets' ops on the communication thread: a
  // backend with device streams puts the group's collectives on the device's
  // communication stream (bagua/core/cuda.h), in order with the ops' kernels
  // and ready-event waits. Other groups keep streams of their own, so calls
  // made concurrently from other threads never queue behind the buckets'.
  std::unique_ptr<Communicator> new_bucket_group(std::span<const int> ranks);

  // Collective: checks that every rank passes the same op, element count and
  // dtype (and root), so a mismatch is an InvalidArgument on every rank rather
  // than a hang or garbage. Costs one small allgather. A rank that found its
  // own arguments wrong passes the reason as `refusal`: then every rank
  // raises InvalidArgument with every refusing rank's reason (a second
  // allgather, on that path only), instead of the others waiting in a
  // collective it never joins.
  void verify_same_call(std::string_view op, const TensorView& tensor, int root = -1,
                        std::string_view refusal = {});

  const CommCounters& counters() const { return counters_; }

 private:
  [[noreturn]] void raise_refusals(std::string_view op, std::string_view refusal);

 protected:
  // The backends' implementations, called with checked arguments and at
  // least one element to move (send_recv: any messages, empty ones included).
  virtual void do_allreduce(const TensorView& send, const TensorView& recv, ReduceOp op) = 0;
  virtual void do_reduce(const TensorView& send, const TensorView& recv, int root, ReduceOp op) = 0;
  virtual void do_broadcast(const TensorView& buffer, int root) = 0;
  virtual void do_allgather(const TensorView& send, const TensorView& recv) = 0;
  virtual void do_gather(const TensorView& send, const TensorView& recv, int root) = 0;
  virtual void do_scatter(const TensorView& send, const TensorView& recv, int root) = 0;
  virtual void do_reduce_scatter(const TensorView& send, const TensorView& recv, ReduceOp op) = 0;
  virtual void do_alltoall(const TensorView& send, const TensorView& recv) = 0;
  virtual void do_send_recv(std::span<const PeerMessage> sends,
                            std::span<const PeerMessage> receives) = 0;
  virtual void do_barrier() = 0;
  virtual bool do_send_recv_on_host(std::span<const PeerMessage> /*sends*/,
                                    std::span<const PeerMessage> /*receives*/) {
    return false;
  }
  virtual int do_recv_any(const TensorView& buffer, std::span<const int> peers, std::uint64_t tag,
                          bool wait_forever);
  virtual void do_recv_from(const TensorView& buffer, int peer, std::uint64_t tag,
                            bool wait_forever);
  // Default: the ring over tagged send_recv with host reductions (host
  // buffers only); staging backends override it.
  virtual void do_partial_allreduce(const TensorView& send, const TensorView& recv,
                                    std::span<const int> members, ReduceOp op,
                                    std::uint64_t group_id, bool verify);
  virtual std::unique_ptr<Communicator> do_new_group(std::span<const int> ranks) = 0;
  virtual std::unique_ptr<Communicator> do_new_bucket_group(std::span<const int> ranks) {
    return do_new_group(ranks);
  }

  // For do_new_group: the number of the next group of this communicator
  // (every rank counts every group, member or not, so the numbers agree) and
  // this rank's rank in it, -1 for a non-member.
  struct GroupSlot {
    int number = 0;
    int rank = -1;
  };
  GroupSlot next_group(std::span<const int> ranks);

  // Adds one call moving `bytes` each way to the counters.
  void count(std::size_t bytes);

  CommCounters counters_;

 private:
  void check_root(std::string_view op, int root) const;
  void check_peer(std::string_view op, int peer) const;
  void check_same_shape(std::string_view op, const TensorView& a, const TensorView& b) const;
  // `whole` holds size() copies of `part`.
  void check_gathered(std::string_view op, const TensorView& part, const TensorView& whole) const;
  void check_group(std::span<const int> ranks) const;
  void check_members(const TensorView& send, const TensorView& recv,
                     std::span<const int> members) const;

  int group_counter_ = 0;
  std::map<std::vector<int>, std::uint64_t> partial_ids_;
};

// The intra-node / inter-node communicators for hierarchical communication.
// `intra` links the ranks of this rank's node, `inter` the node leaders (the
// lowest rank of each node) and is null on every other rank. When every
// node has the same number of ranks, `across` links this rank with the ranks
// of the same local index on the other nodes (for the leaders, the same
// ranks as `inter`), so that every rank of a node can carry a share of the
// node's traffic; null otherwise.
struct HierarchicalComms {
  std::shared_ptr<Communicator> intra;
  std::shared_ptr<Communicator> inter;
  std::shared_ptr<Communicator> across;
  int local_size = 1;
  int nodes = 1;         // how many nodes the group spans
  int largest_node = 1;  // ranks in its largest node

  bool is_leader() const { return inter != nullptr; }
  // One node, or one rank per node: a hierarchy with one level only, where
  // a reduction over it is the flat one with extra passes.
  bool single_level() const { return nodes == 1 || largest_node == 1; }
};

// Collective over `global`. node_of_rank[r] names the node of rank r of
// `global` (the same list on every rank).
HierarchicalComms make_hierarchical_comms(Communicator& global,
                                          const std::vector<int>& node_of_rank);

// Nodes of `local_size` consecutive ranks: node k holds ranks
// [k * local_size, (k + 1) * local_size); the last node may be smaller.
HierarchicalComms make_hierarchical_comms(Communicator& global, int local_size);

}  // namespace bagua

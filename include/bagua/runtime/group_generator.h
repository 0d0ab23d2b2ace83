// Ripples' group generator engine: the pure state machine that decides which
// ranks P-Reduce together, with no network (the GroupGenerator service runs it
// on one rank and answers the others' requests; tests drive it directly).
//
// Contract
// - Threading: thread-compatible. Const methods may run concurrently; anything
//   else needs exclusive access (the service holds one mutex around it).
// - Determinism: the same options (seed included) and the same sequence of
//   calls give the same groups on every platform (std::mt19937_64 with our own
//   uniform draw and shuffle; no std::*_distribution, no std::shuffle).
// - Group ids start at 1 and increase by one in creation (smart) or grant
//   (random) order; 0 is never an id. The id order is the global
//   serialisation order: every rank receives its groups in increasing id, so
//   every pair of ranks sees their shared groups in the same order.
// - Misuse raises InvalidArgument (ValueError in Python) naming the rank and
//   the group: a rank out of range, a request or poll while the rank still
//   executes a group, a second request while one is outstanding, a poll with
//   no outstanding request, completing a group the rank is not executing.
//
// Per rank w: a request counter c_w, a FIFO queue Q_w of assigned groups (the
// group buffer), busy_w (a group popped and not yet completed), left_w.
//
// mode random (the paper's basic GG):
//   request(i): c_i += 1; if Q_i is non-empty, pop its head (busy). Otherwise,
//   unless i is already in a pending group, draw G = {i} + a uniform sample of
//   min(k - 1, #non-left others) non-left others and append it to the pending
//   list P. grant(): scan P in order and grant G iff every member is unlocked
//   (locked = busy or Q non-empty) and in no earlier pending group (no
//   overtaking on shared members: no starvation, pairwise order = creation
//   order); granting gives the id and pushes G to every member's Q. Then
//   return the head of Q_i, or kWait (the rank polls later). complete(i, id)
//   unlocks i and grants again. At most one granted group per rank. A waiting
//   rank is always in a pending group; only complete() and leave() can grant
//   it, so a driver (the service) polls the ranks in waiting() after those.
// mode smart (group buffer + global division [+ inter-intra] [+ filter]):
//   request(i): c_i += 1; if Q_i is empty, run a global division; pop the head
//   (never waits). idle(w) <=> not left, Q_w empty, not busy. The division set
//   F = idle ranks w with c_i - c_w < slowdown_threshold (all idle ranks
//   without a threshold), always including i.
//   partition(F): shuffle; ceil(|F| / k) groups whose sizes differ by at most
//   one, so none exceeds k; singletons only when |F| = 1 or (k = 2 and |F|
//   odd). Groups take ids in order and are appended to their members' Q.
//   inter_intra (nodes: local_size consecutive ranks): per node v with idle
//   set F_v (in node order) a head h_v drawn from F_v; inter-phase groups =
//   partition({h_v}) then, node by node, partition(F_v - {h_v}); then the
//   intra-phase groups F_v, node by node. Every inter-phase id precedes every
//   intra-phase id; Q lengths <= 2.
//   Bounded isolation (ours; design 7.7, I6), with a threshold and K =
//   company_every >= 1: rank i is behind when a rank still training has made
//   C_thres or more requests than i (that rank's divisions leave i out). A
//   behind initiator whose first new group is {i} alone, after K - 1
//   consecutive groups alone, gets one companion: a busy rank w (executing,
//   or holding a group) with room in its buffer (Q_w shorter than 1, 2 with
//   inter_intra), not itself filtered out by i (c_i - c_w < C_thres), chosen
//   uniformly among those with the shortest Q_w (inter_intra: of another
//   node). w receives the group after the ones it holds (its id is the
//   largest yet) and runs it at its next request, while i, already there,
//   waits for it: w loses no step. With inter_intra a behind initiator heads
//   its node and takes no intra-phase group (its node's intra group is
//   F_v - {i}, dropped when of at most k ranks: it would repeat their one
//   inter-phase group), so no fast rank queues a group that waits for the
//   straggler's next request.
// leave(i): i is never chosen again; its request returns its remaining queued
//   groups, then kDone. Random mode removes i from pending groups (a pending
//   group i started is dropped, and a waiting rank left in no pending group
//   draws a new one; a group reduced to its initiator alone is granted as a
//   solo). Idempotent.
// linger(i): i stopped training but stays available to the others: it is
//   still chosen (divisions and random draws include it, the slowdown filter
//   skips it: it is done, not slow), but its requests create nothing and are
//   not counted in c_i: they return its queued groups, else kWait until a
//   group arrives. Once every
//   rank that has not left lingers, they all leave (their requests drain,
//   then kDone). So the ranks that finish first keep averaging with the last
//   one instead of leaving it to train alone. Idempotent; ignored after leave.
//   When that release finds no rank that left before (every rank lingered to
//   the end), final_round_id() names the first id after every group created:
//   the ranks may then run a schedule of their own together (the algorithm
//   P-Reduces the final weights through a period of the static schedule).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include "bagua/core/errors.h"

namespace bagua {

enum class GroupGenerationMode : std::uint8_t { kRandom, kSmart };

constexpr std::string_view to_string(GroupGenerationMode mode) {
  switch (mode) {
    case GroupGenerationMode::kRandom: return "random";
    case GroupGenerationMode::kSmart: return "smart";
  }
  return "unknown";
}

// "random" or "smart" (InvalidArgument otherwise, naming `mode`).
GroupGenerationMode parse_group_generation_mode(std::string_view name);

struct GroupGeneratorOptions {
  int world_size = 1;  // >= 1
  int group_size = 3;  // k >= 2: the maximum group size (may exceed world_size)
  GroupGenerationMode mode = GroupGenerationMode::kSmart;
  std::optional<std::int64_t> slowdown_threshold;  // C_thres >= 1; smart only; none: no filter
  std::optional<int> local_size;                   // ranks per node >= 1; none: one node
  bool inter_intra = false;                        // smart only
  // K >= 0: a behind rank is alone in at most K - 1 consecutive groups when
  // a busy rank has room (see above); 0: off, the paper's rule. Acts only
  // with a slowdown_threshold.
  int company_every = 1;
  std::uint64_t seed = 0;
};

// Throws InvalidArgument naming the first invalid field and its value.
void validate(const GroupGeneratorOptions& options);

struct Group {
  std::uint64_t id = 0;
  std::vector<int> ranks;  // sorted, distinct
  friend bool operator==(const Group&, const Group&) = default;
};

enum class ReplyKind : std::uint8_t {
  kGroup,  // `group` is the rank's next group: execute it, then complete()
  kWait,   // random mode: nothing granted yet; poll() later
  kDone,   // the rank has left and has no group left to execute
};

constexpr std::string_view to_string(ReplyKind kind) {
  switch (kind) {
    case ReplyKind::kGroup: return "group";
    case ReplyKind::kWait: return "wait";
    case ReplyKind::kDone: return "done";
  }
  return "unknown";
}

struct GroupReply {
  ReplyKind kind = ReplyKind::kWait;
  Group group;  // meaningful iff kind == kGroup
  friend bool operator==(const GroupReply&, const GroupReply&) = default;
};

struct GroupGeneratorStats {
  std::int64_t requests = 0;        // request() calls accepted
  std::int64_t groups = 0;          // groups created (smart) or granted (random)
  std::int64_t solo = 0;            // of those, groups of one rank
  double mean_group_size = 0.0;     // mean size of those groups (0 before the first)
  std::int64_t max_buffer_len = 0;  // longest group buffer (queue) any rank had
  std::int64_t divisions = 0;       // smart: global divisions run
  std::int64_t company = 0;         // smart: companions given to behind ranks
};

class GroupGeneratorEngine {
 public:
  explicit GroupGeneratorEngine(GroupGeneratorOptions options);

  const GroupGeneratorOptions& options() const { return options_; }
  int world_size() const { return options_.world_size; }

  // A rank asks for its next group (after its local update).
  GroupReply request(int rank);
  // A rank whose request returned kWait asks again without counting a new
  // request: kGroup once granted, kDone if it left meanwhile, else kWait.
  GroupReply poll(int rank);
  // The rank finished executing `group_id` (the group its last kGroup reply
  // named).
  void complete(int rank, std::uint64_t group_id);
  // The rank stops training: see the header comment.
  void leave(int rank);
  // The rank stops training and stays available until all do: see above.
  void linger(int rank);

  // Introspection.
  std::vector<bool> lock_vector() const;       // busy or holding a queued group
  std::vector<Group> buffer(int rank) const;   // queued groups, not yet handed out, in order
  std::vector<std::int64_t> counters() const;  // requests per rank
  GroupGeneratorStats stats() const;
  std::vector<int> waiting() const;    // ranks with an outstanding kWait request, ascending
  std::vector<Group> pending() const;  // random: drawn, not granted (id 0), in order
  std::optional<Group> executing(int rank) const;  // popped, not completed
  bool has_left(int rank) const;
  bool is_lingering(int rank) const;  // lingers and has not left yet
  // Set once every rank lingered to the end (see linger above): an id above
  // every group's; nullopt while any rank trains, or when one left first.
  std::optional<std::uint64_t> final_round_id() const { return final_round_id_; }
  // Groups handed to their members and not yet completed by all of them.
  std::int64_t outstanding_groups() const { return static_cast<std::int64_t>(groups_.size()); }
  // Nothing pending, queued or executing.
  bool drained() const { return groups_.empty() && pending_.empty(); }

 private:
  struct Record {
    Group group;
    int remaining;  // members that have not completed it
  };
  struct Pending {
    int initiator;
    std::vector<int> ranks;
  };

  void check_rank(int rank, std::string_view what) const;
  void mark_left(int rank);
  void release_if_all_linger();
  GroupReply pop(int rank);
  void create(std::vector<int> ranks);  // assigns the next id, queues it
  bool locked(int rank) const;
  bool in_pending(int rank) const;
  void draw_random_group(int rank);
  void grant();
  void divide(int rank);
  std::vector<int> division_set(int rank) const;
  void divide_by_node(const std::vector<int>& idle, int rank, bool behind);
  bool behind(int rank) const;
  bool wants_company(int rank, bool behind, const std::vector<int>& group) const;
  void add_company(int rank, std::vector<int>& group, bool other_node);
  std::vector<std::vector<int>> partition(std::vector<int> ranks);
  std::uint64_t uniform(std::uint64_t bound);  // in [0, bound)
  void shuffle(std::vector<int>& values);

  GroupGeneratorOptions options_;
  int local_size_;
  std::mt19937_64 rng_;
  std::uint64_t next_id_ = 1;
  std::optional<std::uint64_t> final_round_id_;
  std::vector<std::int64_t> counters_;
  std::vector<std::deque<std::uint64_t>> queues_;
  std::vector<std::optional<std::uint64_t>> executing_;
  std::vector<bool> left_;
  std::vector<bool> lingering_;
  std::vector<bool> waiting_;
  std::vector<std::int64_t> alone_;         // consecutive groups of one a rank popped
  std::map<std::uint64_t, Record> groups_;  // handed out, not completed by all members
  std::vector<Pending> pending_;            // random mode
  GroupGeneratorStats stats_;
  std::int64_t member_total_ = 0;  // sum of created group sizes
};

}  // namespace bagua

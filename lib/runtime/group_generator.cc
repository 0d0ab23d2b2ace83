// The group generator engine (include/bagua/runtime/group_generator.h).
#include "bagua/runtime/group_generator.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace bagua {

GroupGenerationMode parse_group_generation_mode(std::string_view name) {
  for (auto mode : {GroupGenerationMode::kRandom, GroupGenerationMode::kSmart}) {
    if (to_string(mode) == name) return mode;
  }
  throw InvalidArgument(fmt::format("unknown mode '{}' (supported: random, smart)", name));
}

void validate(const GroupGeneratorOptions& o) {
  BAGUA_CHECK_ARG(o.world_size >= 1, "group generator: world_size must be >= 1, got {}",
                  o.world_size);
  BAGUA_CHECK_ARG(o.group_size >= 2, "group generator: group_size must be >= 2, got {}",
                  o.group_size);
  BAGUA_CHECK_ARG(o.mode == GroupGenerationMode::kRandom || o.mode == GroupGenerationMode::kSmart,
                  "group generator: unknown mode {}", static_cast<int>(o.mode));
  if (o.slowdown_threshold) {
    BAGUA_CHECK_ARG(*o.slowdown_threshold >= 1,
                    "group generator: slowdown_threshold must be >= 1, got {}",
                    *o.slowdown_threshold);
    BAGUA_CHECK_ARG(o.mode == GroupGenerationMode::kSmart,
                    "group generator: slowdown_threshold = {} needs mode 'smart', got mode '{}'",
                    *o.slowdown_threshold, to_string(o.mode));
  }
  if (o.local_size) {
    BAGUA_CHECK_ARG(*o.local_size >= 1, "group generator: local_size must be >= 1, got {}",
                    *o.local_size);
  }
  BAGUA_CHECK_ARG(o.company_every >= 0, "group generator: company_every must be >= 0, got {}",
                  o.company_every);
  BAGUA_CHECK_ARG(!o.inter_intra || o.mode == GroupGenerationMode::kSmart,
                  "group generator: inter_intra = true needs mode 'smart', got mode '{}'",
                  to_string(o.mode));
}

GroupGeneratorEngine::GroupGeneratorEngine(GroupGeneratorOptions options)
    : options_(std::move(options)) {
  validate(options_);
  const auto n = static_cast<std::size_t>(options_.world_size);
  local_size_ = options_.local_size.value_or(options_.world_size);
  rng_.seed(options_.seed);
  counters_.assign(n, 0);
  queues_.resize(n);
  executing_.resize(n);
  left_.assign(n, false);
  lingering_.assign(n, false);
  waiting_.assign(n, false);
  alone_.assign(n, 0);
}

void GroupGeneratorEngine::check_rank(int rank, std::string_view what) const {
  BAGUA_CHECK_ARG(rank >= 0 && rank < options_.world_size,
                  "group generator {}: rank must be in [0, world_size = {}), got {}", what,
                  options_.world_size, rank);
}

// ---- requests --------------------------------------------------------------

GroupReply GroupGeneratorEngine::request(int rank) {
  check_rank(rank, "request");
  const auto r = static_cast<std::size_t>(rank);
  BAGUA_CHECK_ARG(!executing_[r],
                  "group generator request: rank {} is still executing group {}; complete it first",
                  rank, executing_[r].value_or(0));
  BAGUA_CHECK_ARG(!waiting_[r],
                  "group generator request: rank {} already has an outstanding request; poll it",
                  rank);
  ++stats_.requests;
  if (lingering_[r]) {  // no training step to count; creates nothing: waits to be chosen
    if (!queues_[r].empty()) return pop(rank);
    waiting_[r] = true;
    return {.kind = ReplyKind::kWait, .group = {}};
  }
  ++counters_[r];
  if (!queues_[r].empty()) return pop(rank);
  if (left_[r]) return {.kind = ReplyKind::kDone, .group = {}};
  if (options_.mode == GroupGenerationMode::kSmart) {
    divide(rank);
    return pop(rank);
  }
  if (!in_pending(rank)) draw_random_group(rank);
  grant();
  if (!queues_[r].empty()) return pop(rank);
  waiting_[r] = true;
  return {.kind = ReplyKind::kWait, .group = {}};
}

GroupReply GroupGeneratorEngine::poll(int rank) {
  check_rank(rank, "poll");
  const auto r = static_cast<std::size_t>(rank);
  BAGUA_CHECK_ARG(waiting_[r],
                  "group generator poll: rank {} has no outstanding request (executing: {})", rank,
                  executing_[r] ? fmt::format("group {}", *executing_[r]) : "none");
  if (!queues_[r].empty()) {
    waiting_[r] = false;
    return pop(rank);
  }
  if (left_[r]) {
    waiting_[r] = false;
    return {.kind = ReplyKind::kDone, .group = {}};
  }
  return {.kind = ReplyKind::kWait, .group = {}};
}

GroupReply GroupGeneratorEngine::pop(int rank) {
  auto& queue = queues_[static_cast<std::size_t>(rank)];
  const std::uint64_t id = queue.front();
  queue.pop_front();
  executing_[static_cast<std::size_t>(rank)] = id;
  const auto it = groups_.find(id);
  BAGUA_CHECK_INTERNAL(it != groups_.end(), "group {} queued for rank {} is unknown", id, rank);
  auto& alone = alone_[static_cast<std::size_t>(rank)];
  alone = it->second.group.ranks.size() == 1 ? alone + 1 : 0;
  return {.kind = ReplyKind::kGroup, .group = it->second.group};
}

void GroupGeneratorEngine::complete(int rank, std::uint64_t group_id) {
  check_rank(rank, "complete");
  const auto r = static_cast<std::size_t>(rank);
  BAGUA_CHECK_ARG(executing_[r] && *executing_[r] == group_id,
                  "group generator complete: rank {} is not executing group {} (executing: {})",
                  rank, group_id, executing_[r] ? fmt::format("group {}", *executing_[r]) : "none");
  executing_[r].reset();
  const auto it = groups_.find(group_id);
  BAGUA_CHECK_INTERNAL(it != groups_.end(), "group {} executed by rank {} is unknown", group_id,
                       rank);
  if (--it->second.remaining == 0) groups_.erase(it);
  if (options_.mode == GroupGenerationMode::kRandom) grant();
}

void GroupGeneratorEngine::leave(int rank) {
  check_rank(rank, "leave");
  if (left_[static_cast<std::size_t>(rank)]) return;
  mark_left(rank);
  release_if_all_linger();
}

void GroupGeneratorEngine::linger(int rank) {
  check_rank(rank, "linger");
  const auto r = static_cast<std::size_t>(rank);
  if (left_[r] || lingering_[r]) return;
  lingering_[r] = true;
  release_if_all_linger();
}

void GroupGeneratorEngine::release_if_all_linger() {
  bool anyone = false;
  for (int w = 0; w < options_.world_size; ++w) {
    const auto x = static_cast<std::size_t>(w);
    if (left_[x]) continue;
    if (!lingering_[x]) return;  // someone still trains: keep lingering
    anyone = true;
  }
  if (!anyone) return;
  const bool none_left = std::none_of(left_.begin(), left_.end(), [](bool left) { return left; });
  if (none_left) final_round_id_ = next_id_;
  for (int w = 0; w < options_.world_size; ++w) {
    if (!left_[static_cast<std::size_t>(w)]) mark_left(w);
  }
}

void GroupGeneratorEngine::mark_left(int rank) {
  const auto r = static_cast<std::size_t>(rank);
  left_[r] = true;
  lingering_[r] = false;
  if (options_.mode != GroupGenerationMode::kRandom) return;
  std::erase_if(pending_, [rank](const Pending& p) { return p.initiator == rank; });
  for (auto& p : pending_) std::erase(p.ranks, rank);
  // A waiting rank that was waiting for a dropped group draws its own, as its
  // request would have done, so it does not wait forever.
  for (int w = 0; w < options_.world_size; ++w) {
    const auto x = static_cast<std::size_t>(w);
    if (waiting_[x] && !left_[x] && !lingering_[x] && queues_[x].empty() && !in_pending(w)) {
      draw_random_group(w);
    }
  }
  grant();
}

// ---- group creation ----------------------------------------------------------

void GroupGeneratorEngine::create(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  const std::uint64_t id = next_id_++;
  for (int w : ranks) {
    auto& queue = queues_[static_cast<std::size_t>(w)];
    queue.push_back(id);
    stats_.max_buffer_len =
        std::max(stats_.max_buffer_len, static_cast<std::int64_t>(queue.size()));
  }
  ++stats_.groups;
  if (ranks.size() == 1) ++stats_.solo;
  member_total_ += static_cast<std::int64_t>(ranks.size());
  const int size = static_cast<int>(ranks.size());
  groups_.emplace(id,
                  Record{.group = Group{.id = id, .ranks = std::move(ranks)}, .remaining = size});
}

bool GroupGeneratorEngine::locked(int rank) const {
  const auto r = static_cast<std::size_t>(rank);
  return executing_[r].has_value() || !queues_[r].empty();
}

bool GroupGeneratorEngine::in_pending(int rank) const {
  return std::any_of(pending_.begin(), pending_.end(), [rank](const Pending& p) {
    return std::find(p.ranks.begin(), p.ranks.end(), rank) != p.ranks.end();
  });
}

void GroupGeneratorEngine::draw_random_group(int rank) {
  std::vector<int> others;
  for (int w = 0; w < options_.world_size; ++w) {
    if (w != rank && !left_[static_cast<std::size_t>(w)]) others.push_back(w);
  }
  const std::size_t take =
      std::min(others.size(), static_cast<std::size_t>(options_.group_size - 1));
  // A partial Fisher-Yates shuffle: the first `take` entries are a uniform sample.
  for (std::size_t i = 0; i < take; ++i) {
    const std::size_t j = i + static_cast<std::size_t>(uniform(others.size() - i));
    std::swap(others[i], others[j]);
  }
  std::vector<int> ranks(others.begin(), others.begin() + static_cast<std::ptrdiff_t>(take));
  ranks.push_back(rank);
  std::sort(ranks.begin(), ranks.end());
  pending_.push_back({.initiator = rank, .ranks = std::move(ranks)});
}

void GroupGeneratorEngine::grant() {
  std::vector<bool> earlier(static_cast<std::size_t>(options_.world_size), false);
  std::vector<Pending> still;
  for (auto& p : pending_) {
    const bool free = std::all_of(p.ranks.begin(), p.ranks.end(), [&](int w) {
      return !locked(w) && !earlier[static_cast<std::size_t>(w)];
    });
    if (free) {
      create(std::move(p.ranks));
    } else {
      for (int w : p.ranks) earlier[static_cast<std::size_t>(w)] = true;
      still.push_back(std::move(p));
    }
  }
  pending_ = std::move(still);
}

std::vector<std::vector<int>> GroupGeneratorEngine::partition(std::vector<int> ranks) {
  std::vector<std::vector<int>> out;
  if (ranks.empty()) return out;
  shuffle(ranks);
  const std::size_t f = ranks.size();
  const auto k = static_cast<std::size_t>(options_.group_size);
  const std::size_t count = (f + k - 1) / k;
  const std::size_t base = f / count;
  const std::size_t extra = f % count;  // the first `extra` groups take one more
  std::size_t at = 0;
  for (std::size_t g = 0; g < count; ++g) {
    const std::size_t size = base + (g < extra ? 1 : 0);
    out.emplace_back(ranks.begin() + static_cast<std::ptrdiff_t>(at),
                     ranks.begin() + static_cast<std::ptrdiff_t>(at + size));
    at += size;
  }
  return out;
}

std::vector<int> GroupGeneratorEngine::division_set(int rank) const {
  const std::int64_t c_i = counters_[static_cast<std::size_t>(rank)];
  std::vector<int> idle;
  for (int w = 0; w < options_.world_size; ++w) {
    const auto x = static_cast<std::size_t>(w);
    if (w != rank) {
      if (left_[x] || !queues_[x].empty() || executing_[x]) continue;
      if (options_.slowdown_threshold && !lingering_[x] &&
          c_i - counters_[x] >= *options_.slowdown_threshold) {
        continue;
      }
    }
    idle.push_back(w);
  }
  return idle;
}

void GroupGeneratorEngine::divide(int rank) {
  ++stats_.divisions;
  const bool lagging = options_.company_every >= 1 && behind(rank);
  std::vector<int> idle = division_set(rank);
  if (options_.inter_intra) {
    divide_by_node(idle, rank, lagging);
    return;
  }
  auto groups = partition(std::move(idle));
  for (auto& g : groups) {
    if (wants_company(rank, lagging, g)) add_company(rank, g, false);
  }
  for (auto& g : groups) create(std::move(g));
}

void GroupGeneratorEngine::divide_by_node(const std::vector<int>& idle, int rank, bool lagging) {
  // Idle ranks by node, in node order (idle is ascending, nodes are consecutive).
  std::vector<std::vector<int>> by_node;
  int last_node = -1;
  for (int w : idle) {
    const int node = w / local_size_;
    if (node != last_node) by_node.emplace_back();
    last_node = node;
    by_node.back().push_back(w);
  }
  std::vector<int> heads;
  std::vector<std::vector<int>> others;
  for (const auto& members : by_node) {
    // A behind initiator heads its node: its one group mixes across nodes.
    const auto self = std::find(members.begin(), members.end(), rank);
    const std::size_t h = lagging && self != members.end()
                              ? static_cast<std::size_t>(self - members.begin())
                              : static_cast<std::size_t>(uniform(members.size()));
    heads.push_back(members[h]);
    others.emplace_back(members);
    others.back().erase(others.back().begin() + static_cast<std::ptrdiff_t>(h));
  }
  std::vector<std::vector<int>> inter = partition(std::move(heads));
  for (auto& rest : others) {
    for (auto& g : partition(std::move(rest))) inter.push_back(std::move(g));
  }
  for (auto& g : inter) {
    // The behind initiator is a head: a companion of another node keeps its
    // group at one rank per node.
    if (wants_company(rank, lagging, g)) add_company(rank, g, true);
  }
  for (auto& g : inter) create(std::move(g));
  for (auto& members : by_node) {
    // A behind initiator's next request is a slow step away: the fast ranks
    // of its node must not queue a group that waits for it. Without it, up
    // to k of them would only repeat their inter-phase group (or sit alone).
    const auto group_size = static_cast<std::size_t>(options_.group_size);
    if (lagging && std::erase(members, rank) == 1 && members.size() <= group_size) continue;
    create(std::move(members));
  }
}

bool GroupGeneratorEngine::behind(int rank) const {
  if (!options_.slowdown_threshold) return false;
  const std::int64_t c_i = counters_[static_cast<std::size_t>(rank)];
  for (int w = 0; w < options_.world_size; ++w) {
    const auto x = static_cast<std::size_t>(w);
    if (!left_[x] && !lingering_[x] && counters_[x] - c_i >= *options_.slowdown_threshold) {
      return true;
    }
  }
  return false;
}

bool GroupGeneratorEngine::wants_company(int rank, bool lagging,
                                         const std::vector<int>& group) const {
  return lagging && group.size() == 1 && group.front() == rank &&
         alone_[static_cast<std::size_t>(rank)] + 1 >= options_.company_every;
}

void GroupGeneratorEngine::add_company(int rank, std::vector<int>& group, bool other_node) {
  // Busy ranks only: the idle ones are in the division already. A rank with
  // a group queued runs it first, so the shortest queues keep i's wait short.
  const std::size_t room = options_.inter_intra ? 2 : 1;
  const std::int64_t c_i = counters_[static_cast<std::size_t>(rank)];
  const int node = rank / local_size_;
  std::vector<int> candidates;
  std::size_t shortest = room;
  for (int w = 0; w < options_.world_size; ++w) {
    const auto x = static_cast<std::size_t>(w);
    if (w == rank || left_[x] || (queues_[x].empty() && !executing_[x])) continue;
    if (queues_[x].size() >= room) continue;
    if (other_node && w / local_size_ == node) continue;
    if (!lingering_[x] && c_i - counters_[x] >= *options_.slowdown_threshold) continue;
    if (queues_[x].size() < shortest) candidates.clear();
    shortest = std::min(shortest, queues_[x].size());
    if (queues_[x].size() == shortest) candidates.push_back(w);
  }
  if (candidates.empty()) return;
  group.push_back(candidates[static_cast<std::size_t>(uniform(candidates.size()))]);
  ++stats_.company;
}

// ---- randomness (portable: no std:: distributions or std::shuffle) ----------

std::uint64_t GroupGeneratorEngine::uniform(std::uint64_t bound) {
  BAGUA_CHECK_INTERNAL(bound > 0, "uniform draw from an empty range");
  // Rejection sampling: accept draws below the largest multiple of `bound`.
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t limit = max - (max % bound + 1) % bound;
  std::uint64_t x = rng_();
  while (x > limit) x = rng_();
  return x % bound;
}

void GroupGeneratorEngine::shuffle(std::vector<int>& values) {
  for (std::size_t i = values.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>(uniform(i));
    std::swap(values[i - 1], values[j]);
  }
}

// ---- introspection -----------------------------------------------------------

std::vector<bool> GroupGeneratorEngine::lock_vector() const {
  std::vector<bool> out;
  for (int w = 0; w < options_.world_size; ++w) out.push_back(locked(w));
  return out;
}

std::vector<Group> GroupGeneratorEngine::buffer(int rank) const {
  check_rank(rank, "buffer");
  std::vector<Group> out;
  for (std::uint64_t id : queues_[static_cast<std::size_t>(rank)]) {
    out.push_back(groups_.at(id).group);
  }
  return out;
}

std::vector<std::int64_t> GroupGeneratorEngine::counters() const { return counters_; }

GroupGeneratorStats GroupGeneratorEngine::stats() const {
  GroupGeneratorStats s = stats_;
  s.mean_group_size =
      s.groups == 0 ? 0.0 : static_cast<double>(member_total_) / static_cast<double>(s.groups);
  return s;
}

std::vector<int> GroupGeneratorEngine::waiting() const {
  std::vector<int> out;
  for (int w = 0; w < options_.world_size; ++w) {
    if (waiting_[static_cast<std::size_t>(w)]) out.push_back(w);
  }
  return out;
}

std::vector<Group> GroupGeneratorEngine::pending() const {
  std::vector<Group> out;
  for (const auto& p : pending_) out.push_back(Group{.id = 0, .ranks = p.ranks});
  return out;
}

std::optional<Group> GroupGeneratorEngine::executing(int rank) const {
  check_rank(rank, "executing");
  const auto& id = executing_[static_cast<std::size_t>(rank)];
  if (!id) return std::nullopt;
  return groups_.at(*id).group;
}

bool GroupGeneratorEngine::has_left(int rank) const {
  check_rank(rank, "has_left");
  return left_[static_cast<std::size_t>(rank)];
}

bool GroupGeneratorEngine::is_lingering(int rank) const {
  check_rank(rank, "is_lingering");
  return lingering_[static_cast<std::size_t>(rank)];
}

}  // namespace bagua

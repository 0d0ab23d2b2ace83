// What P-Reduces among the members of a group share (Ripples,
// design/ripples.md): the tags of their messages and the split of a buffer
// into one chunk per member.
//
// A tag names the group (its member set and id, plus a salt per protocol)
// and the step within the call, so messages of different groups, calls or
// steps never match one another (PeerMessage::tag). Tags are nonzero and
// below 2^56, the room a Gloo slot of ours has.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

namespace bagua::group_tags {

constexpr int kStepBits = 16;
constexpr int kKeyBits = 39;

// SplitMix64's finalizer: a well-mixed, portable 64-bit hash.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline std::uint64_t members_hash(std::span<const int> members) {
  std::uint64_t hash = mix64(members.size());
  for (int r : members) hash = mix64(hash ^ static_cast<std::uint64_t>(r));
  return hash;
}

// The key of one call: distinct per (protocol salt, members, group id) up to
// a 2^-39 chance of collision; nonzero.
inline std::uint64_t group_key(std::span<const int> members, std::uint64_t group_id,
                               std::uint64_t salt = 0) {
  const std::uint64_t key = mix64(members_hash(members) ^ mix64(group_id) ^ mix64(salt + 1));
  return (key & ((1ULL << kKeyBits) - 1)) | (1ULL << kKeyBits);
}

constexpr std::uint64_t step_tag(std::uint64_t group_key, int step) {
  return (group_key << kStepBits) | static_cast<std::uint64_t>(step);
}

// Chunk c of m over n elements: sizes differ by at most one.
struct Chunk {
  std::int64_t offset = 0;
  std::int64_t numel = 0;
};

constexpr Chunk chunk_of(std::int64_t n, int m, int c) {
  const std::int64_t base = n / m, rest = n % m;
  return {c * base + std::min<std::int64_t>(c, rest), base + (c < rest ? 1 : 0)};
}

}  // namespace bagua::group_tags

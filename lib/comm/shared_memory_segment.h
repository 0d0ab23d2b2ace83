// Lib-internal: setting up a shared-memory segment among the ranks of a
// communicator (rank 0 creates it under a unique name, the others map it by
// that name, then it is unlinked), shared by the collectives'
// segment (shared_memory.cc) and the point-to-point mailboxes
// (shared_memory_messages.cc).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "bagua/comm/communicator.h"

namespace bagua {
namespace shm {

inline constexpr std::size_t kNameBytes = 128;
inline constexpr std::size_t kKeyBytes = 256;

// A mapping of a named segment, or the reason there is none.
struct Mapping {
  void* base = MAP_FAILED;
  std::string error;
};

// Maps segment `name` of `bytes`; `create`: creates it, its pages reserved
// at once (a full /dev/shm is an error here, not a SIGBUS on first touch).
Mapping map_segment(const std::string& name, std::size_t bytes, bool create);

// A name no other segment of this host has: /bagua-{kind}-{pid}-...
std::string unique_segment_name(const char* kind);

// Collective over `comm`: rank 0 creates a segment of `bytes` named after
// `kind` and calls `construct(base)` on it before any peer maps it; the
// others map it by name; it is unlinked once all have it open. The same
// outcome on every rank: the mapping, or, when any rank failed, no mapping
// (released everywhere) and `error` naming that rank and why.
Mapping create_shared_segment(Communicator& comm, const char* kind, std::size_t bytes,
                              const std::function<void(void*)>& construct);

// Every rank's fixed-size record (`width` bytes, NUL-padded), gathered over
// `comm`. Collective.
std::vector<std::string> allgather_strings(Communicator& comm, const std::string& mine,
                                           std::size_t width);

}  // namespace shm
}  // namespace bagua

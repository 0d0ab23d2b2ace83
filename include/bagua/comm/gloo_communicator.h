// Factory of the Gloo backend (CPU tensors over TCP; large allreduces among
// ranks of one host through shared memory). The Gloo headers stay
// in lib/comm/gloo_communicator.cc.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "bagua/comm/communicator.h"
#include "bagua/comm/shared_memory.h"
#include "bagua/comm/store.h"

namespace bagua {

struct GlooOptions {
  // Keys of this communicator live under this prefix in the store.
  std::string prefix = "bagua";
  // Network interface (e.g. "eth0") or, if empty, `hostname`.
  std::string interface_name;
  // Address to bind and advertise; empty means 127.0.0.1.
  std::string hostname;
  // Bound on every wait; zero means BAGUA_COMM_TIMEOUT_S.
  std::chrono::milliseconds timeout{0};
  // Allreduce through shared memory among ranks on one host; unset means
  // from BAGUA_SHARED_MEMORY and BAGUA_SHARED_MEMORY_MIN_BYTES.
  std::optional<SharedMemoryOptions> shared_memory;
  // Which loopback this rank shares: ranks with equal identities reach each
  // other's 127.0.0.1. Empty: this machine and network namespace (boot id
  // and namespace inode). Tests set it to fake ranks on different hosts.
  std::string network_identity;
};

// Collective over the `size` ranks sharing `store`: connects a full mesh.
std::unique_ptr<Communicator> make_gloo_communicator(std::shared_ptr<Store> store, int rank,
                                                     int size, GlooOptions options = {});

}  // namespace bagua

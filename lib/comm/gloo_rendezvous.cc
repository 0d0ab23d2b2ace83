// The rendezvous of Gloo communicators; see comm/gloo_rendezvous.h.
#include "comm/gloo_rendezvous.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <gloo/transport/tcp/device.h>

#include "bagua/core/errors.h"

namespace bagua {
namespace {

// The tcp attributes Gloo binds and advertises for `options`.
::gloo::transport::tcp::attr device_attr(const GlooOptions& options) {
  ::gloo::transport::tcp::attr attr;
  if (!options.interface_name.empty()) {
    attr.iface = options.interface_name;
  } else {
    attr.hostname = options.hostname.empty() ? "127.0.0.1" : options.hostname;
  }
  return attr;
}

// The address a device for `options` will advertise (Gloo's own resolution),
// and whether it is a loopback address.
struct AdvertisedAddress {
  std::string text;
  bool loopback = false;
};

AdvertisedAddress advertised_address(const GlooOptions& options) {
  const auto resolved = ::gloo::transport::tcp::CreateDeviceAttr(device_attr(options));
  char text[INET6_ADDRSTRLEN] = {};
  AdvertisedAddress address;
  if (resolved.ai_addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&resolved.ai_addr);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    address.loopback = (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  } else if (resolved.ai_addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&resolved.ai_addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    address.loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) ||
                       (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127);
  }
  address.text = text;
  return address;
}

std::string this_hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Ranks with the same identity share a loopback interface: the same kernel
// (boot id) and network namespace. Falls back to the hostname.
std::string this_network_identity() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  struct stat netns {};
  if (std::getline(boot, boot_id) && !boot_id.empty() && stat("/proc/self/ns/net", &netns) == 0) {
    return fmt::format("{}/netns:{}", boot_id, netns.st_ino);
  }
  return "host:" + this_hostname();
}

// One TCP device per (interface, hostname) per process, shared by contexts.
std::shared_ptr<::gloo::transport::Device> shared_tcp_device(const GlooOptions& options) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, std::string>, std::shared_ptr<::gloo::transport::Device>>
      devices;
  std::lock_guard lock(mutex);
  auto key = std::make_pair(options.interface_name, options.hostname);
  auto& device = devices[key];
  if (!device) device = ::gloo::transport::tcp::CreateDevice(device_attr(options));
  return device;
}

}  // namespace

std::shared_ptr<::gloo::transport::Device> listening_device(const GlooOptions& options, int rank,
                                                            int size) {
  try {
    return shared_tcp_device(options);
  } catch (const std::exception& e) {  // Gloo's enforce errors are not gloo::Exception
    throw InvalidArgument(fmt::format(
        "rank {} of {}: Gloo cannot listen on {} (GLOO_SOCKET_IFNAME / BAGUA_GLOO_HOSTNAME): {}",
        rank, size,
        options.interface_name.empty() ? "address '" + device_attr(options).hostname + "'"
                                       : "interface '" + options.interface_name + "'",
        e.what()));
  }
}

// Before connecting: every rank publishes where its device will listen
// and which loopback it shares (options.network_identity), and reads the
// others'. A rank that never publishes is named after the timeout; a
// loopback address advertised to a rank on another host (a hostname that
// resolves to 127.0.0.1, no GLOO_SOCKET_IFNAME) is an InvalidArgument on
// every rank, as each sees the same table, instead of "Connection refused"
// on one rank and a wait on the other.
void check_gloo_addresses(Store& store, const GlooOptions& options, int rank, int size) {
  const AdvertisedAddress mine = advertised_address(options);
  const std::string identity =
      options.network_identity.empty() ? this_network_identity() : options.network_identity;
  const std::string record =
      fmt::format("{}\n{}\n{}\n{}", identity, this_hostname(), mine.text, mine.loopback ? 1 : 0);
  store.set(fmt::format("address/{}", rank), std::vector<char>(record.begin(), record.end()));

  struct Peer {
    std::string identity, hostname, address;
    bool loopback = false;
  };
  std::vector<Peer> peers(static_cast<std::size_t>(size));
  std::vector<int> missing;
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (int r = 0; r < size; ++r) {
    const std::string key = fmt::format("address/{}", r);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      store.wait({key}, std::max(left, std::chrono::milliseconds(1)));
    } catch (const Error&) {
      missing.push_back(r);
      continue;
    }
    const auto value = store.get(key);
    std::istringstream lines(std::string(value.begin(), value.end()));
    Peer& peer = peers[static_cast<std::size_t>(r)];
    std::string loopback;
    std::getline(lines, peer.identity);
    std::getline(lines, peer.hostname);
    std::getline(lines, peer.address);
    std::getline(lines, loopback);
    peer.loopback = loopback == "1";
  }
  if (!missing.empty()) {
    throw TimeoutError(fmt::format(
        "Gloo rendezvous of group '{}' on rank {} of {}: rank(s) [{}] did not arrive within {} "
        "ms (BAGUA_COMM_TIMEOUT_S)",
        options.prefix, rank, size, fmt::join(missing, ", "), options.timeout.count()));
  }
  for (int r = 0; r < size; ++r) {
    const Peer& local = peers[static_cast<std::size_t>(r)];
    if (!local.loopback) continue;
    for (int other = 0; other < size; ++other) {
      const Peer& remote = peers[static_cast<std::size_t>(other)];
      if (remote.identity == local.identity) continue;
      throw InvalidArgument(fmt::format(
          "Gloo rendezvous of group '{}' (seen on rank {} of {}): rank {} (host '{}') would "
          "advertise {} to its peers, a loopback address (does the hostname resolve to "
          "loopback?), but rank {} (host '{}') is on another host or network namespace and "
          "cannot reach it. Set GLOO_SOCKET_IFNAME to the network interface to use (e.g. eth0), "
          "or "
          "BAGUA_GLOO_HOSTNAME to an address of each host that the other hosts can reach",
          options.prefix, rank, size, r, local.hostname, local.address, other, remote.hostname));
    }
  }
}

}  // namespace bagua

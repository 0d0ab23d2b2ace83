// Lib-internal: how a Gloo communicator finds its peers (lib/comm/
// gloo_communicator.cc connects them): Gloo's store interface over ours, the
// TCP device it listens on, and the check of the addresses the ranks
// advertise before they connect.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/store.h"

namespace bagua {

// Gloo's rendezvous store interface on top of ours.
class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(bagua::Store& inner, std::chrono::milliseconds timeout)
      : inner_(inner), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    inner_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    inner_.wait({key}, timeout_);
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { inner_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    inner_.wait(keys, timeout);
  }

 private:
  bagua::Store& inner_;
  std::chrono::milliseconds timeout_;
};

// The process's TCP device for `options` (one per interface and hostname,
// shared by contexts); InvalidArgument naming the interface or address when
// Gloo cannot listen there.
std::shared_ptr<::gloo::transport::Device> listening_device(const GlooOptions& options, int rank,
                                                            int size);

// Before connecting: every rank publishes where its device will listen and
// which loopback it shares, and reads the others' (see the definition).
void check_gloo_addresses(Store& store, const GlooOptions& options, int rank, int size);

}  // namespace bagua

// Bagua's Store over Gloo's HashStore and FileStore, and the prefix store.
#include "bagua/comm/store.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {
namespace {

// Runs a Gloo store call, turning its exceptions into StoreError.
template <typename Fn>
auto guarded(const char* what, const std::string& key, Fn&& fn) {
  try {
    return fn();
  } catch (const ::gloo::Exception& e) {
    throw StoreError(fmt::format("store {} '{}' failed: {}", what, key, e.what()));
  }
}

class GlooBackedStore final : public Store {
 public:
  explicit GlooBackedStore(std::unique_ptr<::gloo::rendezvous::Store> inner)
      : inner_(std::move(inner)) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    guarded("set", key, [&] { inner_->set(key, value); });
  }
  std::vector<char> get(const std::string& key) override {
    return guarded("get", key, [&] { return inner_->get(key); });
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    guarded("wait", keys.empty() ? std::string() : keys.front(),
            [&] { inner_->wait(keys, timeout); });
  }

 private:
  std::unique_ptr<::gloo::rendezvous::Store> inner_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
      : prefix_(std::move(prefix)), inner_(std::move(inner)) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    inner_->set(join(key), value);
  }
  std::vector<char> get(const std::string& key) override { return inner_->get(join(key)); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> joined;
    joined.reserve(keys.size());
    for (const auto& key : keys) joined.push_back(join(key));
    inner_->wait(joined, timeout);
  }

 private:
  std::string join(const std::string& key) const { return prefix_ + "/" + key; }

  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace

std::shared_ptr<Store> make_hash_store() {
  return std::make_shared<GlooBackedStore>(std::make_unique<::gloo::rendezvous::HashStore>());
}

std::shared_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_shared<GlooBackedStore>(
      std::make_unique<::gloo::rendezvous::FileStore>(directory));
}

std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> inner) {
  BAGUA_CHECK_ARG(inner != nullptr, "make_prefix_store: inner store is null");
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(inner));
}

}  // namespace bagua

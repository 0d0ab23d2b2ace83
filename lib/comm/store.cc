// Bagua's Store over Gloo's HashStore and FileStore, and the prefix store.
#include "bagua/comm/store.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>

#include <fmt/format.h>

#include <mutex>

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
  // `serialize_updates`: Gloo's FileStore keeps an unguarded list of the
  // files it wrote, so its set and get must not run concurrently (threads
  // sharing one FileStore crash otherwise). Its wait only polls files and
  // stays unlocked so that a waiting thread never blocks another's set.
  GlooBackedStore(std::unique_ptr<::gloo::rendezvous::Store> inner, bool serialize_updates)
      : inner_(std::move(inner)), serialize_updates_(serialize_updates) {}

  void set(const std::string& key, const std::vector<char>& value) override {
    const auto lock = maybe_lock();
    guarded("set", key, [&] { inner_->set(key, value); });
  }
  std::vector<char> get(const std::string& key) override {
    const auto lock = maybe_lock();
    return guarded("get", key, [&] { return inner_->get(key); });
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    guarded("wait", keys.empty() ? std::string() : keys.front(),
            [&] { inner_->wait(keys, timeout); });
  }

 private:
  std::unique_lock<std::mutex> maybe_lock() {
    return serialize_updates_ ? std::unique_lock(mutex_) : std::unique_lock<std::mutex>();
  }

  std::unique_ptr<::gloo::rendezvous::Store> inner_;
  bool serialize_updates_;
  std::mutex mutex_;
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
  return std::make_shared<GlooBackedStore>(std::make_unique<::gloo::rendezvous::HashStore>(),
                                           /*serialize_updates=*/false);
}

std::shared_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_shared<GlooBackedStore>(
      std::make_unique<::gloo::rendezvous::FileStore>(directory), /*serialize_updates=*/true);
}

std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> inner) {
  BAGUA_CHECK_ARG(inner != nullptr, "make_prefix_store: inner store is null");
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(inner));
}

}  // namespace bagua

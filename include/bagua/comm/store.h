// Rendezvous key/value store.
//
// Contract: `set` publishes a value, `get` returns it (blocking until the key
// exists or the store's own timeout passes), `wait` blocks until every key
// exists or `timeout` passes, then throws StoreError. Implementations are
// thread-safe. From Python the store is PyTorch's c10d store (bridged in
// lib/python); in C++ tests it is Gloo's HashStore (threads in one process)
// or FileStore (processes sharing a directory).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace bagua {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};

// Gloo's in-memory store: every rank a thread of one process.
std::shared_ptr<Store> make_hash_store();
// Gloo's file store: ranks are processes sharing `directory`.
std::shared_ptr<Store> make_file_store(const std::string& directory);
// Keys of `inner` seen under "prefix/": keeps communicators' keys apart.
std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> inner);

}  // namespace bagua

// Runs a function once per rank, each rank a thread of this process, all
// sharing one in-memory store: how the C++ tests exercise multi-rank code.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/store.h"

namespace bagua::testing {

// Calls fn(communicator) on `world` threads, each communicator made with
// `options` (prefix "test"); rethrows the first failure. `store` defaults to
// a fresh in-memory HashStore.
inline void run_ranks_with(int world, GlooOptions options,
                           const std::function<void(Communicator&)>& fn,
                           std::shared_ptr<Store> store = nullptr) {
  if (!store) store = make_hash_store();
  options.prefix = "test";
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(world));
  {
    std::vector<std::jthread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          auto comm = make_gloo_communicator(store, rank, world, options);
          fn(*comm);
        } catch (...) {
          failures[static_cast<std::size_t>(rank)] = std::current_exception();
        }
      });
    }
  }
  for (auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
}

// run_ranks_with default options and `timeout` on every wait.
inline void run_ranks(int world, const std::function<void(Communicator&)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(20),
                      std::shared_ptr<Store> store = nullptr) {
  GlooOptions options;
  options.timeout = timeout;
  run_ranks_with(world, std::move(options), fn, std::move(store));
}

// Runs fn on every rank and collects one exception message per rank
// ("" when the rank succeeded).
inline std::vector<std::string> run_ranks_collect_errors(
    int world, const std::function<void(Communicator&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  run_ranks(
      world,
      [&](Communicator& comm) {
        try {
          fn(comm);
        } catch (const std::exception& e) {
          messages[static_cast<std::size_t>(comm.rank())] = e.what();
        }
      },
      timeout);
  return messages;
}

}  // namespace bagua::testing

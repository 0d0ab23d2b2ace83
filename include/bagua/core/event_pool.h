// A pool of reusable events (CUDA events in practice).
//
// Why: every tensor marked ready on a CUDA device records an event, several
// hundred per iteration for a large model. Creating and destroying a
// cudaEvent_t each time costs a driver call and, for destroy, may serialize
// with the device; the pool creates them once and recycles them.
//
// The create/destroy functions are parameters so the recycling logic is
// tested without a GPU. Thread-safe: events are taken on the training thread
// and given back on the communication thread.
#pragma once

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace bagua {

class EventPool {
 public:
  using CreateFn = std::function<void*()>;
  using DestroyFn = std::function<void(void*)>;

  // One event taken from the pool; goes back to it when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          event_(std::exchange(other.event_, nullptr)) {}
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        reset();
        pool_ = std::exchange(other.pool_, nullptr);
        event_ = std::exchange(other.event_, nullptr);
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    void* get() const { return event_; }
    explicit operator bool() const { return event_ != nullptr; }
    void reset() {
      if (pool_ != nullptr) pool_->give_back(event_);
      pool_ = nullptr;
      event_ = nullptr;
    }

   private:
    friend class EventPool;
    Lease(EventPool* pool, void* event) : pool_(pool), event_(event) {}
    EventPool* pool_ = nullptr;
    void* event_ = nullptr;
  };

  EventPool(CreateFn create, DestroyFn destroy)
      : create_(std::move(create)), destroy_(std::move(destroy)) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  // Leases still out must be returned first (they point here).
  ~EventPool() {
    for (void* event : free_) destroy_(event);
  }

  Lease acquire() {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        void* event = free_.back();
        free_.pop_back();
        return Lease(this, event);
      }
    }
    void* event = create_();  // outside the lock: a driver call
    std::lock_guard lock(mutex_);
    ++created_;
    return Lease(this, event);
  }

  // Events created so far and events waiting in the pool.
  std::size_t created() const {
    std::lock_guard lock(mutex_);
    return created_;
  }
  std::size_t available() const {
    std::lock_guard lock(mutex_);
    return free_.size();
  }

 private:
  void give_back(void* event) noexcept {
    std::lock_guard lock(mutex_);
    try {
      free_.push_back(event);
    } catch (...) {
      destroy_(event);
    }
  }

  CreateFn create_;
  DestroyFn destroy_;
  mutable std::mutex mutex_;
  std::vector<void*> free_;
  std::size_t created_ = 0;
};

}  // namespace bagua

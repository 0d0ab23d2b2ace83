// A caching allocator for temporary buffers: freed blocks are kept and
// handed out again instead of going back to the system.
//
// Why: cudaMalloc/cudaFree and cudaHostAlloc synchronize the device and cost
// tens of microseconds to milliseconds; a comm op that needs scratch memory
// every iteration would pay that every step. Sizes repeat from one
// iteration to the next (the buckets do not change), so a cache keyed by
// size serves almost every request after the first step.
//
// Policy (the same idea as PyTorch's CUDA caching allocator, much smaller):
// - requests are rounded up to a size class: multiples of 512 bytes below
//   1 MiB, multiples of 2 MiB above, so nearby sizes share blocks;
// - a request takes the smallest cached block of at least its class and at
//   most twice it (a much larger block would waste memory);
// - when the underlying allocation fails, the cache is released and the
//   allocation retried once before the error reaches the caller.
//
// The underlying functions are parameters, so the same logic serves device
// memory (cudaMalloc), pinned host memory (cudaHostAlloc) and, in the tests,
// plain malloc. Thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {

struct CachingAllocatorStats {
  std::size_t blocks_in_use = 0;
  std::size_t bytes_in_use = 0;  // size-class bytes handed out
  std::size_t blocks_cached = 0;
  std::size_t bytes_cached = 0;        // freed and kept for reuse
  std::size_t system_allocations = 0;  // calls to the underlying allocate
  std::size_t cache_hits = 0;
};

class CachingAllocator {
 public:
  // `allocate(bytes)` returns memory or throws; `release(pointer)` frees it.
  using AllocateFn = std::function<void*(std::size_t)>;
  using ReleaseFn = std::function<void(void*)>;

  // One block handed out; returns it to the cache when destroyed.
  class Block {
   public:
    Block() = default;
    Block(Block&& other) noexcept { *this = std::move(other); }
    Block& operator=(Block&& other) noexcept {
      if (this != &other) {
        reset();
        owner_ = std::exchange(other.owner_, nullptr);
        data_ = std::exchange(other.data_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
      }
      return *this;
    }
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    ~Block() { reset(); }

    void* data() const { return data_; }
    // The usable size: the request rounded up to its size class.
    std::size_t bytes() const { return bytes_; }
    void reset() {
      if (owner_ != nullptr) owner_->give_back(data_, bytes_);
      owner_ = nullptr;
      data_ = nullptr;
      bytes_ = 0;
    }

   private:
    friend class CachingAllocator;
    Block(CachingAllocator* owner, void* data, std::size_t bytes)
        : owner_(owner), data_(data), bytes_(bytes) {}
    CachingAllocator* owner_ = nullptr;
    void* data_ = nullptr;
    std::size_t bytes_ = 0;
  };

  CachingAllocator(std::string name, AllocateFn allocate, ReleaseFn release)
      : name_(std::move(name)), allocate_(std::move(allocate)), release_(std::move(release)) {}
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  // Blocks still handed out must be returned first (they point here).
  ~CachingAllocator() { empty_cache(); }

  static constexpr std::size_t kSmallGranule = 512;
  static constexpr std::size_t kLargeGranule = std::size_t{2} << 20;
  static constexpr std::size_t kLargeThreshold = std::size_t{1} << 20;

  static std::size_t size_class(std::size_t bytes) {
    if (bytes == 0) return 0;
    const std::size_t granule = bytes < kLargeThreshold ? kSmallGranule : kLargeGranule;
    return (bytes + granule - 1) / granule * granule;
  }

  // A block of at least `bytes` (an empty block for 0 bytes).
  Block allocate(std::size_t bytes) {
    const std::size_t wanted = size_class(bytes);
    if (wanted == 0) return {};
    std::lock_guard lock(mutex_);
    const auto found = cached_.lower_bound(wanted);
    if (found != cached_.end() && found->first <= 2 * wanted) {
      Block block(this, found->second, found->first);
      stats_.bytes_cached -= found->first;
      stats_.blocks_cached -= 1;
      cached_.erase(found);
      stats_.cache_hits += 1;
      note_in_use(block.bytes());
      return block;
    }
    void* data = nullptr;
    try {
      data = allocate_(wanted);
    } catch (const std::exception&) {
      // Out of memory, perhaps because the cache holds it: release, retry.
      release_cached_locked();
      try {
        data = allocate_(wanted);
      } catch (const std::exception& second) {
        throw BackendError(fmt::format("{}: cannot allocate {} bytes ({} in use): {}", name_,
                                       wanted, stats_.bytes_in_use, second.what()));
      }
    }
    BAGUA_CHECK_INTERNAL(data != nullptr, "{}: allocation of {} bytes returned null", name_,
                         wanted);
    stats_.system_allocations += 1;
    note_in_use(wanted);
    return Block(this, data, wanted);
  }

  // Frees every cached block (blocks in use are unaffected).
  void empty_cache() {
    std::lock_guard lock(mutex_);
    release_cached_locked();
  }

  CachingAllocatorStats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  const std::string& name() const { return name_; }

 private:
  void note_in_use(std::size_t bytes) {
    stats_.blocks_in_use += 1;
    stats_.bytes_in_use += bytes;
  }

  void give_back(void* data, std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    stats_.blocks_in_use -= 1;
    stats_.bytes_in_use -= bytes;
    try {
      cached_.emplace(bytes, data);
      stats_.blocks_cached += 1;
      stats_.bytes_cached += bytes;
    } catch (...) {
      release_(data);  // no memory for the map node: free the block instead
    }
  }

  void release_cached_locked() noexcept {
    for (const auto& [bytes, data] : cached_) release_(data);
    cached_.clear();
    stats_.blocks_cached = 0;
    stats_.bytes_cached = 0;
  }

  std::string name_;
  AllocateFn allocate_;
  ReleaseFn release_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cached_;  // size class -> free block
  CachingAllocatorStats stats_;
};

}  // namespace bagua

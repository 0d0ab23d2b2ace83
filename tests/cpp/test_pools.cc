// The caching allocator and the event pool, over host functions standing in
// for cudaMalloc / cudaEventCreate (their logic is the same on the device);
// the HostCompute primitives the ops are written against.
#include <doctest/doctest.h>

#include <cstdlib>
#include <new>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bagua/core/caching_allocator.h"
#include "bagua/core/cuda.h"
#include "bagua/core/event_pool.h"
#include "bagua/runtime/compute.h"
#include "typed_buffer.h"

using namespace bagua;

namespace {

// malloc with a counter and an optional limit on the bytes held.
struct CountingSystem {
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t held = 0;
  std::size_t limit = static_cast<std::size_t>(-1);
  std::set<void*> live;

  CachingAllocator make() {
    return CachingAllocator(
        "test pool",
        [this](std::size_t bytes) {
          if (held + bytes > limit) throw std::bad_alloc();
          void* p = std::malloc(bytes);
          if (p == nullptr) throw std::bad_alloc();
          ++allocations;
          held += bytes;
          live.insert(p);
          sizes.push_back({p, bytes});
          return p;
        },
        [this](void* p) {
          for (auto& [ptr, bytes] : sizes) {
            if (ptr == p) {
              held -= bytes;
              ptr = nullptr;
            }
          }
          live.erase(p);
          ++frees;
          std::free(p);
        });
  }
  std::vector<std::pair<void*, std::size_t>> sizes;
};

}  // namespace

TEST_CASE("size classes round small requests to 512 B and large ones to 2 MiB") {
  CHECK(CachingAllocator::size_class(0) == 0);
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(512) == 512);
  CHECK(CachingAllocator::size_class(513) == 1024);
  CHECK(CachingAllocator::size_class((1 << 20) - 1) == (1 << 20));
  CHECK(CachingAllocator::size_class((1 << 20) + 1) == (2 << 20));
  CHECK(CachingAllocator::size_class((3 << 20) + 1) == (4 << 20));
}

TEST_CASE("the caching allocator reuses freed blocks and keeps statistics") {
  CountingSystem system;
  auto pool = system.make();
  void* first = nullptr;
  {
    auto block = pool.allocate(1000);
    CHECK(block.bytes() == 1024);
    first = block.data();
    CHECK(pool.stats().blocks_in_use == 1);
    CHECK(pool.stats().bytes_in_use == 1024);
  }
  CHECK(pool.stats().blocks_cached == 1);
  CHECK(pool.stats().bytes_in_use == 0);
  {
    // Same class: the cached block comes back, no new system allocation.
    auto again = pool.allocate(900);
    CHECK(again.data() == first);
    CHECK(system.allocations == 1);
    CHECK(pool.stats().cache_hits == 1);
    // A second block while the first is in use is a new allocation.
    auto other = pool.allocate(900);
    CHECK(other.data() != first);
    CHECK(system.allocations == 2);
  }
  // A smaller request takes a cached block up to twice its class...
  {
    auto small = pool.allocate(100);
    CHECK(small.bytes() == 1024);
    CHECK(system.allocations == 2);
  }
  // ...but not a much larger one.
  { auto large = pool.allocate(8192); }
  {
    auto a = pool.allocate(1000);
    auto b = pool.allocate(1000);
    auto tiny = pool.allocate(10);
    CHECK(tiny.bytes() == 512);
    CHECK(system.allocations == 4);
  }
  auto empty = pool.allocate(0);
  CHECK(empty.data() == nullptr);
  pool.empty_cache();
  CHECK(pool.stats().blocks_cached == 0);
  CHECK(system.frees == 4);
  CHECK(system.live.empty());
}

TEST_CASE("the caching allocator releases its cache and retries when memory runs out") {
  CountingSystem system;
  system.limit = 3 << 20;
  auto pool = system.make();
  { auto a = pool.allocate(2 << 20); }  // cached: 2 MiB held by the system
  // 3 MiB rounds to 4 MiB, over the limit even with the cache released: the
  // error names the pool, and the cache was released trying.
  CHECK_THROWS_WITH_AS(pool.allocate(3 << 20), doctest::Contains("test pool"), BackendError);
  CHECK(pool.stats().blocks_cached == 0);
  system.limit = 5 << 20;
  { auto b = pool.allocate(2 << 20); }
  // 2 MiB cached + 4 MiB new is over 5 MiB: the first try fails, the retry
  // after releasing the cache succeeds.
  auto c = pool.allocate(3 << 20);
  CHECK(c.bytes() == (4 << 20));
  CHECK(system.held == (4 << 20));
}

TEST_CASE("caching allocator blocks move and are returned from other threads") {
  CountingSystem system;
  auto pool = system.make();
  std::vector<CachingAllocator::Block> blocks;
  blocks.reserve(8);
  for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(4096));
  CachingAllocator::Block moved = std::move(blocks.back());
  blocks.pop_back();
  CHECK(moved.bytes() == 4096);
  std::thread releaser([&] { blocks.clear(); });
  releaser.join();
  CHECK(pool.stats().blocks_cached == 7);
  CHECK(pool.stats().blocks_in_use == 1);
}

TEST_CASE("the event pool recycles events instead of creating new ones") {
  int created = 0;
  int destroyed = 0;
  std::vector<int> storage(16);
  {
    EventPool pool(
        [&] { return static_cast<void*>(&storage.at(static_cast<std::size_t>(created++))); },
        [&](void*) { ++destroyed; });
    void* first = nullptr;
    {
      auto a = pool.acquire();
      auto b = pool.acquire();
      CHECK(a.get() != b.get());
      first = a.get();
      CHECK(pool.created() == 2);
      CHECK(pool.available() == 0);
    }
    CHECK(pool.available() == 2);
    // A hundred iterations of 2 tensors create no new events.
    for (int i = 0; i < 100; ++i) {
      auto a = pool.acquire();
      auto b = pool.acquire();
      CHECK(a);
    }
    CHECK(pool.created() == 2);
    auto lease = pool.acquire();
    EventPool::Lease moved = std::move(lease);
    CHECK_FALSE(lease);
    CHECK((moved.get() == first || moved.get() == &storage[1]));
  }
  CHECK(destroyed == 2);
}

TEST_CASE("HostCompute: convert, axpby, chunked compression and scratch") {
  HostCompute c;
  bagua::testing::TypedBuffer half(DType::kFloat16, 5);
  bagua::testing::TypedBuffer f32(DType::kFloat32, 5);
  for (int i = 0; i < 5; ++i) half.set(i, 0.5 * i - 1.0);
  c.convert(half.view(), f32.view());
  for (int i = 0; i < 5; ++i) CHECK(f32.get(i) == doctest::Approx(0.5 * i - 1.0));

  bagua::testing::TypedBuffer y(DType::kFloat32, 5);
  for (int i = 0; i < 5; ++i) y.set(i, 10.0);
  c.axpby(2.0, f32.view(), -1.0, y.view());  // y = 2x - y
  for (int i = 0; i < 5; ++i) CHECK(y.get(i) == doctest::Approx(2 * (0.5 * i - 1.0) - 10.0));

  // Chunked compression equals compressing each chunk on its own.
  bagua::testing::TypedBuffer x(DType::kFloat32, 10);
  for (int i = 0; i < 10; ++i) x.set(i, (i * 37 % 11) - 5.0);
  std::vector<std::byte> whole(2 * minmax_uint8::compressed_bytes(4) +
                               minmax_uint8::compressed_bytes(2));
  c.compress(x.view(), 4, whole.data());
  std::vector<std::byte> piece(minmax_uint8::compressed_bytes(2));
  minmax_uint8::compress_view(x.view().slice(8, 2), piece.data());
  CHECK(std::equal(piece.begin(), piece.end(), whole.end() - static_cast<long>(piece.size())));

  auto block = c.scratch(100);
  const TensorView v = c.view(block, 25, DType::kFloat32);
  c.zero(v.data, v.nbytes());
  CHECK(static_cast<float*>(v.data)[24] == 0.0f);
  CHECK_THROWS_AS(c.view(block, 1000, DType::kFloat32), InternalError);
  if (cuda_device_count() == 0) {
    // No GPU: asking for device compute is a clear error, not a crash.
    CHECK_THROWS_AS(compute_for(Device{DeviceType::kCUDA, 0}), Error);
  }
}

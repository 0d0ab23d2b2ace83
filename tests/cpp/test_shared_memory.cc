// The shared-memory allreduce (ranks as threads of this process share a
// host): results against the reference for every op and dtype with pieces
// far smaller than the buffers, broadcast from every root, identical bits on every rank, the
// segment really in use, and a missing peer as a TimeoutError naming it.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/shared_memory.h"
#include "collective_reference.h"
#include "rank_threads.h"

using namespace bagua;
using namespace bagua::testing;

namespace {

// Every allreduce through shared memory, in pieces of `slot_bytes`, or
// direct from `direct_min_bytes` on (0: never).
GlooOptions shared_memory_options(std::size_t slot_bytes,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(20),
                                  std::int64_t direct_min_bytes = 0) {
  GlooOptions options;
  options.timeout = timeout;
  options.shared_memory = SharedMemoryOptions{.enabled = true,
                                              .min_bytes = 1,
                                              .slot_bytes = slot_bytes,
                                              .direct_min_bytes = direct_min_bytes};
  return options;
}

// Whether this process maps one of bagua's segments for collectives (a
// communicator of ranks on one host also maps the P-Reduce's mailboxes).
bool maps_a_segment() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/dev/shm/bagua-collectives-") != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("shared-memory allreduce matches the reference for every op and dtype, in many pieces") {
  for (int world = 2; world <= 5; ++world) {
    // direct: every allreduce straight between the buffers, else through
    // slots (the bits test below has buffers of several direct blocks)
    for (const std::int64_t direct : {0, 1}) {
      CAPTURE(world);
      CAPTURE(direct);
      // 256-byte slots: a 4099-element buffer takes up to 129 pieces, so both
      // slot sets are reused many times within one call.
      run_ranks_with(
          world, shared_memory_options(256, std::chrono::seconds(20), direct),
          [&](Communicator& comm) {
            for (DType dtype : all_dtypes()) {
              const bool integer = !is_floating_point(dtype);
              for (std::int64_t n : {1, 13, 100, 4099}) {
                for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                    ReduceOp::kProduct}) {
                  CAPTURE(to_string(dtype));
                  CAPTURE(n);
                  TypedBuffer in(dtype, n), out(dtype, n);
                  fill(in, comm.rank(), op);
                  comm.allreduce(in.view(), out.view(), op);  // out of place
                  comm.allreduce(in.view(), in.view(), op);   // in place
                  for (std::int64_t i = 0; i < n; ++i) {
                    const double expected = reference(op, world, i, integer);
                    REQUIRE(std::abs(out.get(i) - expected) <= tolerance(dtype, expected));
                    REQUIRE(in.get(i) == out.get(i));
                  }
                }
              }
            }
            CHECK(maps_a_segment());
          });
    }
  }
}

TEST_CASE("shared-memory allgather and alltoall move the right bytes, in many pieces") {
  // Byte b of what rank r sends to rank d (d = 0 for allgather).
  const auto payload = [](int r, int d, std::int64_t b) {
    return static_cast<std::uint8_t>((r * 31 + d * 7 + b) % 251);
  };
  for (int world = 2; world <= 5; ++world) {
    CAPTURE(world);
    run_ranks_with(world, shared_memory_options(320), [&](Communicator& comm) {
      const int rank = comm.rank();
      for (std::int64_t n : {1, 100, 5000}) {
        CAPTURE(n);
        std::vector<std::uint8_t> send(n), gathered(n * world);
        for (std::int64_t b = 0; b < n; ++b) send[b] = payload(rank, 0, b);
        const auto view = [](std::vector<std::uint8_t>& v) {
          return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kUInt8, {}};
        };
        comm.allgather(view(send), view(gathered));
        for (int r = 0; r < world; ++r) {
          for (std::int64_t b = 0; b < n; ++b) REQUIRE(gathered[r * n + b] == payload(r, 0, b));
        }
        std::vector<std::uint8_t> out(n * world), in(n * world);
        for (int d = 0; d < world; ++d) {
          for (std::int64_t b = 0; b < n; ++b) out[d * n + b] = payload(rank, d, b);
        }
        comm.alltoall(view(out), view(in));
        for (int r = 0; r < world; ++r) {
          for (std::int64_t b = 0; b < n; ++b) REQUIRE(in[r * n + b] == payload(r, rank, b));
        }
      }
      CHECK(maps_a_segment());
    });
  }
}

TEST_CASE(
    "shared-memory broadcast gives every rank the root's bytes, from any root, in many pieces") {
  for (int world = 2; world <= 5; ++world) {
    CAPTURE(world);
    run_ranks_with(world, shared_memory_options(192), [&](Communicator& comm) {
      for (int root = 0; root < world; ++root) {
        for (std::int64_t n : {1, 100, 5000}) {
          CAPTURE(root);
          CAPTURE(n);
          std::vector<std::uint8_t> buffer(n);
          for (std::int64_t b = 0; b < n; ++b) {
            buffer[b] = static_cast<std::uint8_t>((comm.rank() * 53 + b) % 251);
          }
          comm.broadcast(TensorView{buffer.data(), n, DType::kUInt8, {}}, root);
          for (std::int64_t b = 0; b < n; ++b) {
            REQUIRE(buffer[b] == static_cast<std::uint8_t>((root * 53 + b) % 251));
          }
        }
      }
      CHECK(maps_a_segment());
    });
  }
}

TEST_CASE("shared-memory allreduce leaves identical bits on every rank: the rank-order sum") {
  constexpr std::int64_t kN = 100'003;  // not a multiple of the world size or of a piece
  const auto inputs_of = [](int rank) {
    std::mt19937 random(static_cast<unsigned>(rank));
    std::normal_distribution<float> normal;
    std::vector<float> data(kN);
    for (float& x : data) x = normal(random);
    return data;
  };
  for (int world = 2; world <= 5; ++world) {
    for (const auto& [op, direct] : {std::pair{ReduceOp::kSum, 0}, std::pair{ReduceOp::kAvg, 0},
                                     std::pair{ReduceOp::kSum, 1}, std::pair{ReduceOp::kAvg, 1}}) {
      CAPTURE(world);
      CAPTURE(to_string(op));
      CAPTURE(direct);
      std::vector<std::vector<float>> results(world);
      run_ranks_with(world,
                     shared_memory_options(std::size_t{64} << 10, std::chrono::seconds(20), direct),
                     [&](Communicator& comm) {
                       std::vector<float> data = inputs_of(comm.rank());
                       comm.allreduce(TensorView{data.data(), kN, DType::kFloat32, {}},
                                      TensorView{data.data(), kN, DType::kFloat32, {}}, op);
                       results[static_cast<std::size_t>(comm.rank())] = data;
                     });
      for (int r = 1; r < world; ++r) {  // the bits, not the values: -0.0 and NaNs count too
        // NOLINTNEXTLINE(bugprone-suspicious-memory-comparison)
        CHECK(std::memcmp(results[0].data(), results[r].data(), kN * sizeof(float)) == 0);
      }
      // every element is the sum in rank order (each rank reduces its own
      // segment with its copy read from its buffer), then the division
      std::vector<std::vector<float>> inputs;
      inputs.reserve(static_cast<std::size_t>(world));
      for (int r = 0; r < world; ++r) inputs.push_back(inputs_of(r));
      std::int64_t wrong = 0;
      for (std::int64_t i = 0; i < kN; ++i) {
        float expected = inputs[0][i];
        for (int r = 1; r < world; ++r) expected += inputs[r][i];
        if (op == ReduceOp::kAvg) expected /= static_cast<float>(world);
        wrong += results[0][i] != expected;
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("the direct allreduce is in use from its threshold on, and the slots below it") {
  GlooOptions plain;  // the group below sets up its own segment
  plain.shared_memory = SharedMemoryOptions{.enabled = false};
  run_ranks_with(3, plain, [&](Communicator& comm) {
    const auto shm = SharedMemoryGroup::attach(comm, SharedMemoryOptions{.direct_min_bytes = 4096},
                                               "direct-threshold");
    REQUIRE(shm != nullptr);
    CHECK(shm->direct(4096));
    CHECK_FALSE(shm->direct(4095));
    const std::atomic<bool> aborted{false};
    for (const std::int64_t n : {1023, 1024, 100'000}) {  // slots, then direct, direct
      CAPTURE(n);
      std::vector<float> data(static_cast<std::size_t>(n), static_cast<float>(comm.rank() + 1));
      shm->allreduce(TensorView{data.data(), n, DType::kFloat32, {}}, ReduceOp::kSum,
                     std::chrono::seconds(20), aborted);
      CHECK(data.front() == 6.0f);
      CHECK(data.back() == 6.0f);
    }
  });
}

TEST_CASE("below the size threshold, or disabled, allreduce stays on Gloo") {
  GlooOptions small = shared_memory_options(0);
  small.shared_memory->min_bytes = 1 << 20;
  GlooOptions disabled = shared_memory_options(0);
  disabled.shared_memory->enabled = false;
  for (const GlooOptions& options : {small, disabled}) {
    run_ranks_with(2, options, [&](Communicator& comm) {
      std::vector<float> data(1000, static_cast<float>(comm.rank() + 1));
      const TensorView view{data.data(), 1000, DType::kFloat32, {}};
      comm.allreduce(view, view, ReduceOp::kSum);
      CHECK(data[999] == 3.0f);
      CHECK_FALSE(maps_a_segment());
    });
  }
}

TEST_CASE("a peer missing from a shared-memory allreduce is a TimeoutError naming it") {
  for (const std::int64_t direct : {0, 1}) {
    CAPTURE(direct);
    std::vector<std::string> errors(3);
    run_ranks_with(3, shared_memory_options(0, std::chrono::milliseconds(1000), direct),
                   [&](Communicator& comm) {
                     std::vector<float> data(1000, 1.0f);
                     const TensorView view{data.data(), 1000, DType::kFloat32, {}};
                     comm.allreduce(view, view, ReduceOp::kSum);  // sets the segment up
                     if (comm.rank() == 2) {  // stays alive but skips the next one
                       std::this_thread::sleep_for(std::chrono::milliseconds(2000));
                       return;
                     }
                     try {
                       comm.allreduce(view, view, ReduceOp::kSum);
                     } catch (const TimeoutError& e) {
                       errors[static_cast<std::size_t>(comm.rank())] = e.what();
                     }
                   });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(errors[r]);
      CHECK(errors[r].find(fmt::format("rank {} of 3 (shared memory", r)) != std::string::npos);
      CHECK(errors[r].find("waiting for ranks 2") != std::string::npos);
    }
  }
}

TEST_CASE("the host key names this boot and these namespaces") {
  const std::string key = shared_memory_host_key();
  CHECK_FALSE(key.empty());
  CHECK(key.find("net:[") != std::string::npos);
  CHECK(key == shared_memory_host_key());
}

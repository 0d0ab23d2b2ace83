// Every collective of the Gloo communicator, 1 to 5 ranks as threads, every
// dtype, sizes 0, 1, odd and not divisible by the world size, against
// references computed here from the known inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <thread>

#include "bagua/comm/communicator.h"
#include "bagua/comm/host_staging.h"
#include "bagua/core/cuda.h"
#include "collective_reference.h"
#include "rank_threads.h"
#include "typed_buffer.h"

using namespace bagua;
using bagua::testing::TypedBuffer;
using namespace bagua::testing;  // the reference inputs and results

namespace {

const std::vector<std::int64_t> kSizes{0, 1, 13, 4099};
const std::vector<ReduceOp> kOps{ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                 ReduceOp::kProduct};

}  // namespace

TEST_CASE("allreduce, reduce and reduce_scatter match the reference for every op and dtype") {
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      const int rank = comm.rank();
      for (DType dtype : testing::all_dtypes()) {
        const bool integer = !is_floating_point(dtype);
        for (std::int64_t n : kSizes) {
          for (ReduceOp op : kOps) {
            TypedBuffer in(dtype, n), out(dtype, n);
            fill(in, rank, op);
            comm.allreduce(in.view(), out.view(), op);  // out of place
            comm.allreduce(in.view(), in.view(), op);   // in place
            for (std::int64_t i = 0; i < n; ++i) {
              const double expected = reference(op, world, i, integer);
              REQUIRE(std::abs(out.get(i) - expected) <= testing::tolerance(dtype, expected));
              REQUIRE(in.get(i) == out.get(i));
            }

            const int root = world - 1;
            TypedBuffer send(dtype, n), recv(dtype, n);
            fill(send, rank, op);
            comm.reduce(send.view(), recv.view(), root, op);
            if (rank == root) {
              for (std::int64_t i = 0; i < n; ++i) {
                const double expected = reference(op, world, i, integer);
                REQUIRE(std::abs(recv.get(i) - expected) <= testing::tolerance(dtype, expected));
              }
            }
            // A non-root's input is left as it was.
            for (std::int64_t i = 0; i < n; ++i) {
              REQUIRE(send.get(i) ==
                      (op == ReduceOp::kProduct ? product_input(rank, i) : input_value(rank, i)));
            }

            TypedBuffer whole(dtype, n * world), part(dtype, n);
            fill(whole, rank, op);
            comm.reduce_scatter(whole.view(), part.view(), op);
            for (std::int64_t i = 0; i < n; ++i) {
              const double expected = reference(op, world, rank * n + i, integer);
              REQUIRE(std::abs(part.get(i) - expected) <= testing::tolerance(dtype, expected));
            }
          }
        }
      }
    });
  }
}

TEST_CASE("broadcast, allgather, gather, scatter and alltoall move the right data") {
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      const int rank = comm.rank();
      for (DType dtype : testing::all_dtypes()) {
        for (std::int64_t n : kSizes) {
          const int root = world / 2;
          TypedBuffer buffer(dtype, n);
          for (std::int64_t i = 0; i < n; ++i) buffer.set(i, input_value(rank, i));
          comm.broadcast(buffer.view(), root);
          for (std::int64_t i = 0; i < n; ++i) REQUIRE(buffer.get(i) == input_value(root, i));

          TypedBuffer mine(dtype, n), all(dtype, n * world);
          for (std::int64_t i = 0; i < n; ++i) mine.set(i, input_value(rank, i));
          comm.allgather(mine.view(), all.view());
          for (int r = 0; r < world; ++r) {
            for (std::int64_t i = 0; i < n; ++i) REQUIRE(all.get(r * n + i) == input_value(r, i));
          }

          TypedBuffer gathered(dtype, n * world);
          comm.gather(mine.view(), gathered.view(), root);
          if (rank == root) {
            for (int r = 0; r < world; ++r) {
              for (std::int64_t i = 0; i < n; ++i) {
                REQUIRE(gathered.get(r * n + i) == input_value(r, i));
              }
            }
          }

          TypedBuffer source(dtype, n * world), chunk(dtype, n);
          for (std::int64_t i = 0; i < n * world; ++i) source.set(i, input_value(rank, i));
          comm.scatter(source.view(), chunk.view(), root);
          for (std::int64_t i = 0; i < n; ++i)
            REQUIRE(chunk.get(i) == input_value(root, rank * n + i));

          // alltoall: chunk j sent by rank i holds values tagged (i, j).
          TypedBuffer outgoing(dtype, n * world), incoming(dtype, n * world);
          for (int j = 0; j < world; ++j) {
            for (std::int64_t i = 0; i < n; ++i)
              outgoing.set(j * n + i, static_cast<double>((rank * 5 + j + i) % 50));
          }
          comm.alltoall(outgoing.view(), incoming.view());
          for (int j = 0; j < world; ++j) {
            for (std::int64_t i = 0; i < n; ++i) {
              REQUIRE(incoming.get(j * n + i) == static_cast<double>((j * 5 + rank + i) % 50));
            }
          }
        }
      }
    });
  }
}

TEST_CASE("send and recv around a ring, and barrier") {
  for (int world = 2; world <= 5; ++world) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      const int rank = comm.rank();
      const int right = (rank + 1) % world;
      const int left = (rank + world - 1) % world;
      for (int round = 0; round < 3; ++round) {
        std::vector<float> out(17, static_cast<float>(rank * 100 + round));
        std::vector<float> in(17, -1.0f);
        // Even ranks send first, odd ranks receive first: no cycle of waits.
        TensorView out_view{out.data(), 17, DType::kFloat32, {}};
        TensorView in_view{in.data(), 17, DType::kFloat32, {}};
        if (rank % 2 == 0) {
          comm.send(out_view, right);
          comm.recv(in_view, left);
        } else {
          comm.recv(in_view, left);
          comm.send(out_view, right);
        }
        for (float v : in) REQUIRE(v == static_cast<float>(left * 100 + round));
        comm.barrier();
      }
    });
  }
}

TEST_CASE("subgroups and the hierarchical pair") {
  for (int world = 1; world <= 5; ++world) {
    for (int local_size = 1; local_size <= world; ++local_size) {
      CAPTURE(world);
      CAPTURE(local_size);
      testing::run_ranks(world, [&](Communicator& comm) {
        const int rank = comm.rank();
        // Odd ranks form a subgroup.
        std::vector<int> odd;
        for (int r = 1; r < world; r += 2) odd.push_back(r);
        if (!odd.empty()) {
          auto group = comm.new_group(odd);
          REQUIRE((group != nullptr) == (rank % 2 == 1));
          if (group) {
            std::int64_t value = rank;
            group->allreduce(TensorView{&value, 1, DType::kInt64, {}},
                             TensorView{&value, 1, DType::kInt64, {}}, ReduceOp::kSum);
            std::int64_t expected = 0;
            for (int r : odd) expected += r;
            REQUIRE(value == expected);
            REQUIRE(group->rank() == rank / 2);
          }
        }
        auto hierarchy = make_hierarchical_comms(comm, local_size);
        REQUIRE(hierarchy.is_leader() == (rank % local_size == 0));
        REQUIRE(hierarchy.intra->rank() == rank % local_size);
        const int nodes = (world + local_size - 1) / local_size;
        REQUIRE(hierarchy.nodes == nodes);
        REQUIRE(hierarchy.largest_node == local_size);
        REQUIRE(hierarchy.single_level() == (nodes == 1 || local_size == 1));
        // `across`: the ranks of this local index on every node, when nodes are equal.
        const bool equal_nodes = world % local_size == 0;
        REQUIRE((hierarchy.across != nullptr) == (equal_nodes && !hierarchy.single_level()));
        if (hierarchy.across) {
          REQUIRE(hierarchy.across->size() == nodes);
          REQUIRE(hierarchy.across->rank() == rank / local_size);
          std::int64_t ranks_sum = rank;
          TensorView one{&ranks_sum, 1, DType::kInt64, {}};
          hierarchy.across->allreduce(one, one, ReduceOp::kSum);
          std::int64_t expected = 0;
          for (int node = 0; node < nodes; ++node)
            expected += node * local_size + rank % local_size;
          REQUIRE(ranks_sum == expected);
        }
        std::int64_t value = rank;
        TensorView view{&value, 1, DType::kInt64, {}};
        hierarchy.intra->reduce(view, view, 0, ReduceOp::kSum);
        if (hierarchy.is_leader()) hierarchy.inter->allreduce(view, view, ReduceOp::kSum);
        hierarchy.intra->broadcast(view, 0);
        REQUIRE(value == static_cast<std::int64_t>(world) * (world - 1) / 2);
      });
    }
  }
}

TEST_CASE("bad arguments are InvalidArgument, before any communication") {
  testing::run_ranks(2, [&](Communicator& comm) {
    std::vector<float> a(4), b(5);
    TensorView va{a.data(), 4, DType::kFloat32, {}};
    TensorView vb{b.data(), 5, DType::kFloat32, {}};
    CHECK_THROWS_AS(comm.allreduce(va, vb, ReduceOp::kSum), InvalidArgument);
    CHECK_THROWS_AS(comm.broadcast(va, 2), InvalidArgument);
    CHECK_THROWS_AS(comm.send(va, comm.rank()), InvalidArgument);
    CHECK_THROWS_AS(comm.allgather(va, vb), InvalidArgument);
    CHECK_THROWS_AS(comm.alltoall(vb, vb), InvalidArgument);  // 5 does not split in 2
    const int ranks[] = {1, 0};
    CHECK_THROWS_AS(comm.new_group(ranks), InvalidArgument);
  });
}

TEST_CASE("verify_same_call turns different sizes on different ranks into an error on every rank") {
  for (int world = 2; world <= 5; ++world) {
    auto errors = testing::run_ranks_collect_errors(world, [&](Communicator& comm) {
      std::vector<float> data(static_cast<std::size_t>(comm.rank() == 1 ? 5 : 4));
      TensorView view{data.data(), static_cast<std::int64_t>(data.size()), DType::kFloat32, {}};
      comm.verify_same_call("allreduce", view);
    });
    for (const auto& message : errors) {
      CAPTURE(message);
      CHECK(message.find("different tensors") != std::string::npos);
      CHECK(message.find("rank 1: float32[5]") != std::string::npos);
    }
  }
  // Equal calls pass.
  testing::run_ranks(3, [&](Communicator& comm) {
    std::vector<float> data(4);
    comm.verify_same_call("allreduce", TensorView{data.data(), 4, DType::kFloat32, {}});
  });
}

TEST_CASE("verify_same_call against another collective names the ranks out of step") {
  // Rank 1 runs an allgather of the check's size whose bytes are not a check
  // (as a rank that runs a new op's check alone meets the others' data).
  auto errors = testing::run_ranks_collect_errors(2, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      std::array<std::int64_t, 5> payload{7, 7, 7, 7, 0x5a5a5a5a5a5a};
      std::vector<std::int64_t> gathered(10);
      comm.allgather(TensorView{payload.data(), 5, DType::kInt64, {}},
                     TensorView{gathered.data(), 10, DType::kInt64, {}});
      return;
    }
    std::vector<float> data(4);
    comm.verify_same_call("C_LP_S: segment", TensorView{data.data(), 4, DType::kFloat32, {}});
  });
  CAPTURE(errors[0]);
  CHECK(errors[0].find(
            "C_LP_S: segment on rank 0 of 2: rank 1 sent something other than this check") !=
        std::string::npos);
  CHECK(errors[0].find("out of step") != std::string::npos);
  CHECK(errors[1].empty());
}

TEST_CASE("a peer that never arrives is a TimeoutError naming the op and rank") {
  auto errors = testing::run_ranks_collect_errors(
      2,
      [&](Communicator& comm) {
        if (comm.rank() == 1) {  // rank 1 stays connected but skips the collective
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));
          return;
        }
        float value = 1.0f;
        TensorView view{&value, 1, DType::kFloat32, {}};
        comm.allreduce(view, view, ReduceOp::kSum);
      },
      std::chrono::milliseconds(1500));
  CAPTURE(errors[0]);
  CHECK(errors[0].find("allreduce on rank 0") != std::string::npos);
  CHECK(errors[0].find("timed out") != std::string::npos);
  CHECK(errors[1].empty());
}

// Connects `world` ranks as threads with per-rank options; one message per
// rank ("" where it connected).
std::vector<std::string> connect_errors(int world,
                                        const std::function<GlooOptions(int)>& options_of,
                                        std::vector<double>* seconds = nullptr) {
  auto store = make_hash_store();
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  if (seconds) seconds->assign(static_cast<std::size_t>(world), 0.0);
  {
    std::vector<std::jthread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        const auto start = std::chrono::steady_clock::now();
        try {
          make_gloo_communicator(store, rank, world, options_of(rank));
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(rank)] = e.what();
        }
        if (seconds) {
          (*seconds)[static_cast<std::size_t>(rank)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
      });
    }
  }
  return errors;
}

TEST_CASE("rendezvous: loopback advertised to a rank on another host is an error on every rank") {
  // Two ranks claim different hosts (the test hook) while Gloo would bind
  // 127.0.0.1, as on hosts whose hostname resolves to loopback: the peer
  // would connect to its own loopback ("Connection refused") or wait.
  const auto errors = connect_errors(2, [](int rank) {
    GlooOptions options;
    options.prefix = "loopback";
    options.timeout = std::chrono::milliseconds(3000);
    options.network_identity = rank == 0 ? "host-a" : "host-b";
    return options;
  });
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    CAPTURE(errors[static_cast<std::size_t>(rank)]);
    const std::string& e = errors[static_cast<std::size_t>(rank)];
    CHECK(e.find("127.0.0.1") != std::string::npos);
    CHECK(e.find("loopback") != std::string::npos);
    CHECK(e.find("GLOO_SOCKET_IFNAME") != std::string::npos);
    CHECK(e.find("BAGUA_GLOO_HOSTNAME") != std::string::npos);
    CHECK(e.find("rank 0") != std::string::npos);
    CHECK(e.find("rank 1") != std::string::npos);
    CHECK(e.find("rank -1") == std::string::npos);
  }
  // The same identity (one host): loopback is fine.
  const auto same = connect_errors(2, [](int) {
    GlooOptions options;
    options.prefix = "same-host";
    options.network_identity = "host-a";
    return options;
  });
  CHECK(same == std::vector<std::string>{"", ""});
}

TEST_CASE("rendezvous: a rank that never arrives fails the others within the timeout, named") {
  std::vector<double> seconds;
  const auto errors = connect_errors(
      3,
      [](int rank) {
        GlooOptions options;
        // Rank 2 joins another rendezvous: for the others it never arrives.
        options.prefix = rank == 2 ? "elsewhere" : "missing";
        options.timeout = std::chrono::milliseconds(1000);
        return options;
      },
      &seconds);
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    CAPTURE(errors[static_cast<std::size_t>(rank)]);
    const std::string& e = errors[static_cast<std::size_t>(rank)];
    CHECK(e.find(fmt::format("rank {} of 3", rank)) != std::string::npos);
    CHECK(e.find("[2]") != std::string::npos);  // the missing rank
    CHECK(e.find("rank -1") == std::string::npos);
    CHECK(seconds[static_cast<std::size_t>(rank)] < 1.8);
  }
}

TEST_CASE("rendezvous through Gloo's FileStore (ranks sharing a directory)") {
  char pattern[] = "/tmp/bagua-filestore-XXXXXX";
  REQUIRE(mkdtemp(pattern) != nullptr);
  const std::string directory = pattern;
  testing::run_ranks(
      3,
      [&](Communicator& comm) {
        std::int64_t value = comm.rank() + 1;
        TensorView view{&value, 1, DType::kInt64, {}};
        comm.allreduce(view, view, ReduceOp::kSum);
        REQUIRE(value == 6);
      },
      std::chrono::seconds(20), make_file_store(directory));
  std::filesystem::remove_all(directory);
}

TEST_CASE("host staging passes host buffers through and reports the inner counters") {
  testing::run_ranks(3, [&](Communicator& plain) {
    std::vector<int> all{0, 1, 2};
    auto staged = with_host_staging(plain.new_group(all));
    CHECK(staged->supports(DeviceType::kCPU));
    CHECK(staged->supports(DeviceType::kCUDA) == cuda_compiled());
    std::vector<float> x(10, static_cast<float>(staged->rank() + 1));
    TensorView view{x.data(), 10, DType::kFloat32, {}};
    staged->allreduce(view, view, ReduceOp::kSum);
    for (float v : x) CHECK(v == 6.0f);
    CHECK(staged->counters().bytes_sent == 2 * 2 * 40 / 3);
    auto sub = staged->new_group(std::vector<int>{0, 2});
    if (sub) {
      CHECK(sub->size() == 2);
      CHECK(sub->backend_name().find("staged") != std::string::npos);
    }
  });
}

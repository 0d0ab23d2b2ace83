// Decentralized primitives: shift_one pairing, one D_FP_S step of each mode
// against a reference computed here, and the asynchronous model average's
// rounds, abort agreement and resume, and its weight lock surviving a
// failure.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <numeric>
#include <thread>

#include "bagua/ops/asynchronous_model_average.h"
#include "bagua/ops/decentralized_synchronous.h"
#include "bagua/ops/neighbor_allreduce_op.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

std::shared_ptr<Communicator> all_ranks(Communicator& comm) {
  std::vector<int> ranks(static_cast<std::size_t>(comm.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return comm.new_group(ranks);
}

TensorView view_of(std::vector<double>& v) {
  return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kFloat64, {}};
}

double weight_of(int rank, int i) { return rank * 10.0 + i; }

}  // namespace

TEST_CASE("shift_one pairs follow the formula, are symmetric, and change every step") {
  for (int n = 1; n <= 8; ++n) {
    for (std::int64_t step = 0; step < 12; ++step) {
      int sitting_out = 0;
      for (int rank = 0; rank < n; ++rank) {
        const int peer = shift_one_peer(rank, n, step);
        if (n % 2 == 0) {
          const int h = n / 2;
          const int expected = rank < h ? static_cast<int>((step + rank) % h) + h
                                        : static_cast<int>((((rank - h - step) % h) + h) % h);
          CHECK(peer == expected);
        }
        if (peer < 0) {
          ++sitting_out;
          continue;
        }
        CHECK(peer != rank);
        CHECK(shift_one_peer(peer, n, step) == rank);  // the partner names us back
      }
      CHECK(sitting_out == n % 2);  // odd sizes: exactly one rank rests per step
    }
    if (n % 2 == 0 && n >= 4) {  // partners change from one step to the next
      CHECK(shift_one_peer(0, n, 0) != shift_one_peer(0, n, 1));
    }
  }
}

TEST_CASE("one D_FP_S step of every mode equals the reference average") {
  for (int world = 1; world <= 5; ++world) {
    for (auto mode : {PeerSelection::kAll, PeerSelection::kShiftOne, PeerSelection::kRing}) {
      CAPTURE(world);
      CAPTURE(to_string(mode));
      testing::run_ranks(world, [&](Communicator& comm) {
        auto bucket_comm = all_ranks(comm);
        const int rank = comm.rank();
        const int n = 7;
        std::vector<double> x(n), peer_weight(n);
        for (int i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = weight_of(rank, i);
        Bucket bucket("w", {{"x", view_of(x)}});
        auto op = std::make_shared<DecentralizedSynchronousOp>(
            bucket_comm, nullptr, view_of(peer_weight), n, DType::kFloat64,
            DecentralizedSynchronousOptions{.hierarchical = false, .peer_selection = mode});
        for (std::int64_t step = 0; step < 3; ++step) {
          op->execute(bucket);
          for (int i = 0; i < n; ++i) CHECK(x[static_cast<std::size_t>(i)] == weight_of(rank, i));
          for (int i = 0; i < n; ++i) {
            double expected = weight_of(rank, i);
            if (mode == PeerSelection::kAll) {
              expected = 0;
              for (int r = 0; r < world; ++r) expected += weight_of(r, i);
              expected /= world;
            } else if (mode == PeerSelection::kShiftOne) {
              const int peer = shift_one_peer(rank, world, step);
              if (peer >= 0) expected = (weight_of(rank, i) + weight_of(peer, i)) / 2;
            } else if (world == 2) {
              expected = (weight_of(0, i) + weight_of(1, i)) / 2;
            } else if (world > 2) {
              expected = (weight_of(rank, i) + weight_of((rank + world - 1) % world, i) +
                          weight_of((rank + 1) % world, i)) /
                         3;
            }
            REQUIRE(std::abs(peer_weight[static_cast<std::size_t>(i)] - expected) < 1e-12);
          }
          CHECK(op->communication_step() == step + 1);
        }
        op->copy_back_peer_weight(bucket);
        CHECK(x == peer_weight);
      });
    }
  }
}

TEST_CASE("neighbor_allreduce bucket op: each execution follows the pattern set last") {
  // Step s: every rank receives from rank (r - s - 1) mod n with weight 1/2
  // (a dynamic one-peer schedule); world 1 keeps its weights.
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      auto bucket_comm = all_ranks(comm);
      const int rank = comm.rank();
      const int n = 5;
      std::vector<double> x(n), peer_weight(n);
      for (int i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = weight_of(rank, i);
      Bucket bucket("w", {{"x", view_of(x)}});
      auto op = std::make_shared<NeighborAllreduceOp>(bucket_comm, view_of(peer_weight), n,
                                                      DType::kFloat64);
      for (int step = 0; step < 3; ++step) {
        const int shift = world > 1 ? 1 + step % (world - 1) : 0;
        const int from = (rank - shift + world) % world, to = (rank + shift) % world;
        NeighborAllreduceOptions pattern;
        pattern.self_weight = 0.5;
        pattern.check_pattern = step == 0;
        if (world > 1) {
          pattern.sources = {{from, 0.5}};
          pattern.destinations = {{to, 1.0}};
        } else {
          pattern.self_weight = 1.0;
        }
        op->set_pattern(pattern);
        op->execute(bucket);
        for (int i = 0; i < n; ++i) {
          CHECK(x[static_cast<std::size_t>(i)] == weight_of(rank, i));  // the bucket is untouched
          const double expected =
              world > 1 ? (weight_of(rank, i) + weight_of(from, i)) / 2 : weight_of(rank, i);
          REQUIRE(std::abs(peer_weight[static_cast<std::size_t>(i)] - expected) < 1e-12);
        }
      }
      op->copy_back_peer_weight(bucket);
      CHECK(x == peer_weight);
    });
  }
}

TEST_CASE("asynchronous model average: idle ranks converge to the mean; abort agrees; resume") {
  const int world = 4;
  std::vector<double> final_sum(world, 0.0), increments(world, 0.0);
  testing::run_ranks(world, [&](Communicator& comm) {
    auto dedicated = all_ranks(comm);
    const int rank = comm.rank();
    std::vector<double> w(5, static_cast<double>(rank));
    Bucket bucket("w", {{"w", view_of(w)}});
    auto op = std::make_shared<AsyncModelAverageOp>(
        dedicated, bucket,
        AsyncModelAverageOptions{.peer_selection = PeerSelection::kAll,
                                 .sync_interval = std::chrono::milliseconds(5)});
    CHECK(op->status() == AsyncStatus::kIdle);
    op->execute(bucket);
    CHECK(op->status() == AsyncStatus::kRunning);
    // Nobody trains: the background thread takes the free lock itself.
    while (op->completed_rounds() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    op->lock_weight();
    for (double v : w) CHECK(v == doctest::Approx(1.5));  // (0 + 1 + 2 + 3) / 4
    op->unlock_weight();

    // Uneven abort/resume cycles: only rank 0 asks to abort; all stop.
    for (int cycle = 0; cycle < 10; ++cycle) {
      for (int step = 0; step < (rank + cycle) % 3 + 1; ++step) {
        op->lock_weight();
        for (auto& v : w) v += 0.001;  // training progress
        increments[static_cast<std::size_t>(rank)] += 0.001;
        op->unlock_weight();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (rank == 0) op->abort();
      while (op->status() == AsyncStatus::kRunning) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      CHECK(op->status() == AsyncStatus::kStopped);
      op->abort();  // already stopped: returns at once
      op->resume();
    }
    op->abort();
    CHECK(op->status() == AsyncStatus::kStopped);
    op->rethrow_failure();
    final_sum[static_cast<std::size_t>(rank)] = w[0];
  });
  // No lost update: averaging keeps the sum over ranks, so the final sum is
  // the initial one (0 + 1 + 2 + 3) plus every training increment.
  const double total = std::accumulate(final_sum.begin(), final_sum.end(), 0.0);
  const double expected = 6.0 + std::accumulate(increments.begin(), increments.end(), 0.0);
  CHECK(total == doctest::Approx(expected).epsilon(1e-12));
}

TEST_CASE("asynchronous model average rejects unsupported modes and dtypes") {
  testing::run_ranks(1, [&](Communicator& comm) {
    auto dedicated = all_ranks(comm);
    std::vector<double> w(3);
    Bucket bucket("w", {{"w", view_of(w)}});
    CHECK_THROWS_AS(AsyncModelAverageOp(
                        dedicated, bucket,
                        AsyncModelAverageOptions{.peer_selection = PeerSelection::kRing,
                                                 .sync_interval = std::chrono::milliseconds(5)}),
                    InvalidArgument);
    std::vector<std::int32_t> ints(3);
    Bucket int_bucket("i", {{"i", TensorView{ints.data(), 3, DType::kInt32, {}}}});
    CHECK_THROWS_AS(AsyncModelAverageOp(dedicated, int_bucket, AsyncModelAverageOptions{}),
                    InvalidArgument);
    CHECK_THROWS_AS(parse_peer_selection("star"), InvalidArgument);
  });
}

TEST_CASE("asynchronous model average: a failure while servicing the weights releases their lock") {
  using namespace std::chrono_literals;
  testing::run_ranks(1, [&](Communicator& comm) {
    std::vector<double> w(4, 1.0);
    Bucket bucket("w", {{"w", view_of(w)}});
    auto op = std::make_shared<AsyncModelAverageOp>(
        all_ranks(comm), bucket,
        AsyncModelAverageOptions{.peer_selection = PeerSelection::kAll, .sync_interval = 1ms});
    // The first service (the background thread's snapshot, taken while the
    // training thread does not hold the lock) fails as a device wait would.
    auto faults = std::make_shared<std::atomic<int>>(0);
    op->set_service_fault_for_testing([faults] {
      if (faults->fetch_add(1) == 0) throw TimeoutError("injected: device work did not finish");
    });
    op->execute(bucket);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (op->status() == AsyncStatus::kRunning && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    REQUIRE(op->status() == AsyncStatus::kFailed);
    CHECK_THROWS_WITH_AS(op->rethrow_failure(), doctest::Contains("injected"), TimeoutError);
    // Training goes on locking the weights. A lock left held by the failure
    // would block forever: try from a thread of its own (detached, keeping
    // the op alive, so that a regression fails here instead of hanging).
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([op, done] {
      op->lock_weight();
      op->unlock_weight();
      done->store(true);
    }).detach();
    const auto lock_deadline = std::chrono::steady_clock::now() + 3s;
    while (!done->load() && std::chrono::steady_clock::now() < lock_deadline) {
      std::this_thread::sleep_for(1ms);
    }
    CHECK_MESSAGE(done->load(), "lock_weight() blocked: the failed service left the lock held");
    if (!done->load()) return;
    // reset() clears the failure; the rounds start again and average.
    op->reset();
    op->execute(bucket);
    while (op->completed_rounds() < 1) std::this_thread::sleep_for(1ms);
    op->abort();
    op->rethrow_failure();
    CHECK(op->status() == AsyncStatus::kStopped);
  });
}

TEST_CASE("asynchronous model average: bounded staleness and the drift of each round") {
  using namespace std::chrono_literals;
  const int world = 3;  // odd: the mean is not a midpoint
  const std::int64_t bound = 2;
  testing::run_ranks(world, [&](Communicator& comm) {
    const int rank = comm.rank();
    std::vector<double> w(5, static_cast<double>(rank));
    Bucket bucket("w", {{"w", view_of(w)}});
    auto op = std::make_shared<AsyncModelAverageOp>(
        all_ranks(comm), bucket,
        AsyncModelAverageOptions{.sync_interval = 20ms, .max_staleness_steps = bound});
    op->execute(bucket);
    // Steps far faster than the rounds: each rank must wait for them.
    for (int step = 0; step < 12; ++step) {
      op->wait_within_staleness();
      op->lock_weight();
      for (auto& v : w) v += 0.001;
      op->unlock_weight();
      op->count_step();
    }
    const AsyncRoundStats s = op->stats();
    op->abort();
    CHECK(s.steps == 12);
    CHECK(s.max_round_steps <= bound);
    CHECK(s.staleness_waits >= 1);
    CHECK(s.rounds >= 12 / bound - 1);
    // The first round averaged weights 0, 1, 2 (training waited for it):
    // this rank's distance to the mean 1 over 5 elements, the largest of
    // all rounds (training adds the same amount on every rank).
    CHECK(s.max_drift_sq == doctest::Approx(5.0 * (rank - 1) * (rank - 1)).epsilon(1e-2).scale(1));
    CHECK(s.last_round_ms > 0);
    // After abort (stopped): no waiting, whatever the count.
    op->wait_within_staleness();
  });
}

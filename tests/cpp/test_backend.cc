// The backend: buckets run in registration order whatever order tensors
// become ready in, the C_FP_S op gives the reference sum/average (flat,
// scatter-gather, hierarchical; flattened or not), failures and hangs reach
// the waiting thread with rank, op and bucket named, and a failed rank runs
// no further bucket, aborts its communicators and is destroyed promptly.
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <thread>

#include "bagua/comm/nccl_communicator.h"
#include "bagua/ops/callback_op.h"
#include "bagua/ops/centralized_synchronous.h"
#include "bagua/runtime/backend.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

TensorView view_of(std::vector<float>& data) {
  return TensorView{data.data(), static_cast<std::int64_t>(data.size()), DType::kFloat32, {}};
}

// A collective whose peer never arrives, on a transport that hangs until its
// own timeout (as NCCL's kernels do) unless aborted.
class StuckOp final : public CommOp {
 public:
  StuckOp(std::chrono::milliseconds timeout, std::atomic<int>& started)
      : timeout_(timeout), started_(started) {}
  std::string_view name() const override { return "stuck_collective"; }
  void execute(Bucket& /*bucket*/) override {
    ++started_;
    std::unique_lock lock(mutex_);
    if (!aborted_changed_.wait_for(lock, timeout_, [&] { return aborted_; })) {
      throw TimeoutError("stuck_collective: the peer never arrived");
    }
    throw BackendError("stuck_collective: the communicator was aborted");
  }
  void abort_communication() noexcept override {
    {
      std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    aborted_changed_.notify_all();
  }

 private:
  std::chrono::milliseconds timeout_;
  std::atomic<int>& started_;
  std::mutex mutex_;
  std::condition_variable aborted_changed_;
  bool aborted_ = false;
};

}  // namespace

TEST_CASE("buckets execute in registration order, not readiness order") {
  Backend backend(
      BackendOptions{.rank = 0, .timeout = std::chrono::seconds(10), .timeline = nullptr});
  std::vector<std::vector<float>> data(3, std::vector<float>(4));
  std::mutex mutex;
  std::vector<std::string> executed;
  std::vector<std::shared_ptr<Bucket>> buckets;
  for (int b = 0; b < 3; ++b) {
    auto bucket = std::make_shared<Bucket>(
        fmt::format("b{}", b),
        std::vector<BucketTensor>{{fmt::format("t{}", b), view_of(data[b])}});
    bucket->append_op(std::make_unique<CallbackOp>([&](const std::string& name) {
      std::lock_guard lock(mutex);
      executed.push_back(name);
    }));
    buckets.push_back(bucket);
  }
  backend.register_ordered_buckets(buckets);
  for (int iteration = 0; iteration < 3; ++iteration) {
    executed.clear();
    backend.mark_communication_ready("t2");
    backend.mark_communication_ready("t1");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    {
      std::lock_guard lock(mutex);
      CHECK(executed.empty());  // b0 is not ready, so nothing may start
    }
    backend.mark_communication_ready("t0");
    backend.wait_pending_comm_ops();
    CHECK(executed == std::vector<std::string>{"b0", "b1", "b2"});
    CHECK(backend.last_ready_order() == std::vector<std::string>{"t2", "t1", "t0"});
  }
  CHECK(backend.completed_iterations() == 3);
  const auto stats = nlohmann::json::parse(backend.stats_json());
  CHECK(stats["completed_iterations"] == 3);
  REQUIRE(stats["buckets"].size() == 3);
  CHECK(stats["buckets"][1]["name"] == "b1");
  CHECK(stats["buckets"][1]["bytes"] == 16);
  CHECK(stats["buckets"][1]["ops"][0]["name"] == "python_op");
  CHECK(stats["buckets"][1]["ops"][0]["executions"] == 3);
}

TEST_CASE("readiness errors: unknown tensor, marked twice") {
  Backend backend(
      BackendOptions{.rank = 3, .timeout = std::chrono::seconds(10), .timeline = nullptr});
  std::vector<float> a(2), b(2);
  auto bucket = std::make_shared<Bucket>(
      "only", std::vector<BucketTensor>{{"a", view_of(a)}, {"b", view_of(b)}});
  backend.register_ordered_buckets({bucket});
  CHECK_THROWS_AS(backend.mark_communication_ready("missing"), InvalidArgument);
  backend.mark_communication_ready("a");
  CHECK_THROWS_WITH_AS(backend.mark_communication_ready("a"),
                       doctest::Contains("marked ready twice"), InvalidArgument);
  backend.mark_remaining_ready();
  backend.wait_pending_comm_ops();
}

TEST_CASE("a bucket that never becomes ready is a TimeoutError naming it and its tensors") {
  Backend backend(
      BackendOptions{.rank = 1, .timeout = std::chrono::milliseconds(300), .timeline = nullptr});
  std::vector<float> a(2), b(2);
  auto bucket = std::make_shared<Bucket>(
      "grads0", std::vector<BucketTensor>{{"w", view_of(a)}, {"bias", view_of(b)}});
  backend.register_ordered_buckets({bucket});
  backend.mark_communication_ready("w");
  CHECK_THROWS_WITH_AS(backend.wait_pending_comm_ops(),
                       doctest::Contains("rank 1: wait_pending_comm_ops timed out"), TimeoutError);
  // The backend stays failed.
  CHECK_THROWS_AS(backend.wait_pending_comm_ops(), TimeoutError);
}

TEST_CASE("a failing op reaches the waiting thread with op and bucket named") {
  Backend backend(
      BackendOptions{.rank = 2, .timeout = std::chrono::seconds(10), .timeline = nullptr});
  std::vector<float> a(2);
  auto bucket = std::make_shared<Bucket>("bad", std::vector<BucketTensor>{{"a", view_of(a)}});
  bucket->append_op(std::make_unique<CallbackOp>(
      [](const std::string&) { throw InvalidArgument("deliberate failure"); }));
  backend.register_ordered_buckets({bucket});
  backend.mark_communication_ready("a");
  CHECK_THROWS_WITH_AS(
      backend.wait_pending_comm_ops(),
      doctest::Contains("rank 2: op 'python_op' of bucket 'bad': deliberate failure"),
      InvalidArgument);
}

TEST_CASE("a bucket rejects mixed dtypes") {
  std::vector<float> a(2);
  std::vector<double> b(2);
  CHECK_THROWS_AS(
      Bucket("mixed", {{"a", view_of(a)}, {"b", TensorView{b.data(), 2, DType::kFloat64, {}}}}),
      InvalidArgument);
}

TEST_CASE("C_FP_S gives the sum or average for every mode, flat or not, unequal buckets") {
  struct Mode {
    bool hierarchical, average, scattergather, flat;
  };
  const std::vector<Mode> modes{
      {false, true, false, true},  {false, false, false, false}, {false, true, true, true},
      {false, false, true, false}, {true, true, false, true},    {true, false, true, false},
  };
  for (int world = 1; world <= 5; ++world) {
    for (const Mode& mode : modes) {
      CAPTURE(world);
      CAPTURE(mode.hierarchical);
      CAPTURE(mode.average);
      CAPTURE(mode.scattergather);
      CAPTURE(mode.flat);
      testing::run_ranks(world, [&](Communicator& comm_ref) {
        const int rank = comm_ref.rank();
        // The op owns shared communicators: make one for the bucket ops.
        std::shared_ptr<Communicator> comm = comm_ref.new_group([&] {
          std::vector<int> all(static_cast<std::size_t>(world));
          std::iota(all.begin(), all.end(), 0);
          return all;
        }());
        auto hierarchy = std::make_shared<HierarchicalComms>(make_hierarchical_comms(*comm, 2));
        // Bucket sizes 1, 7, 3 x 333 and 8 elements (tensors of 333, 1 and 665 in one
        // bucket; 8 splits into equal shares at every node size, odd ones do not).
        const std::vector<std::vector<std::int64_t>> layout{{1}, {3, 4}, {333, 1, 665}, {5, 3}};
        std::vector<std::vector<float>> storage;
        std::vector<std::shared_ptr<Bucket>> buckets;
        Backend backend(
            BackendOptions{.rank = rank, .timeout = std::chrono::seconds(20), .timeline = nullptr});
        int tensor_id = 0;
        for (std::size_t b = 0; b < layout.size(); ++b) {
          std::int64_t total = std::accumulate(layout[b].begin(), layout[b].end(), std::int64_t{0});
          std::vector<BucketTensor> tensors;
          if (mode.flat) {
            storage.emplace_back(static_cast<std::size_t>(total));
            std::int64_t offset = 0;
            for (auto n : layout[b]) {
              tensors.push_back(
                  {fmt::format("t{}", tensor_id++), view_of(storage.back()).slice(offset, n)});
              offset += n;
            }
          } else {
            for (auto n : layout[b]) {
              storage.emplace_back(static_cast<std::size_t>(n));
              tensors.push_back({fmt::format("t{}", tensor_id++), view_of(storage.back())});
            }
          }
          auto bucket = std::make_shared<Bucket>(fmt::format("bucket{}", b), std::move(tensors));
          CHECK(bucket->is_flat() == (mode.flat || layout[b].size() == 1));
          bucket->append_op(std::make_unique<CentralizedSynchronousOp>(
              comm, hierarchy,
              CentralizedSynchronousOptions{.hierarchical = mode.hierarchical,
                                            .average = mode.average,
                                            .scattergather = mode.scattergather}));
          buckets.push_back(bucket);
        }
        backend.register_ordered_buckets(buckets);
        for (int iteration = 0; iteration < 2; ++iteration) {
          for (auto& bucket : buckets) {
            for (auto& tensor : bucket->tensors()) {
              for (std::int64_t i = 0; i < tensor.view.numel; ++i) {
                tensor.view.data_as<float>()[i] =
                    static_cast<float>(rank + 1) * static_cast<float>(i % 5 + iteration);
              }
            }
          }
          // Ready in reverse order, as gradients are.
          for (int t = tensor_id - 1; t >= 0; --t)
            backend.mark_communication_ready(fmt::format("t{}", t));
          backend.wait_pending_comm_ops();
          const float rank_sum = static_cast<float>(world * (world + 1)) / 2.0f;
          for (auto& bucket : buckets) {
            for (auto& tensor : bucket->tensors()) {
              for (std::int64_t i = 0; i < tensor.view.numel; ++i) {
                float expected = rank_sum * static_cast<float>(i % 5 + iteration);
                if (mode.average) expected /= static_cast<float>(world);
                REQUIRE(tensor.view.data_as<float>()[i] == doctest::Approx(expected).epsilon(1e-6));
              }
            }
          }
        }
      });
    }
  }
}

TEST_CASE("a rank that never joins a bucket's collective: the watchdog names rank, op and bucket") {
  auto errors = testing::run_ranks_collect_errors(
      2,
      [&](Communicator& comm_ref) {
        std::shared_ptr<Communicator> comm = comm_ref.new_group(std::vector<int>{0, 1});
        std::vector<float> data(8, 1.0f);
        auto bucket =
            std::make_shared<Bucket>("grads7", std::vector<BucketTensor>{{"w", view_of(data)}});
        bucket->append_op(std::make_unique<CentralizedSynchronousOp>(
            comm, nullptr, CentralizedSynchronousOptions{}));
        Backend backend(BackendOptions{
            .rank = comm->rank(), .timeout = std::chrono::milliseconds(1500), .timeline = nullptr});
        backend.register_ordered_buckets({bucket});
        if (comm->rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));
          return;  // never marks its tensor ready
        }
        backend.mark_communication_ready("w");
        backend.wait_pending_comm_ops();
      },
      std::chrono::milliseconds(1500));
  CAPTURE(errors[0]);
  CHECK(errors[0].find("rank 0") != std::string::npos);
  CHECK(errors[0].find("bucket 'grads7'") != std::string::npos);
  CHECK(errors[0].find("centralized_synchronous") != std::string::npos);
}

TEST_CASE(
    "a rank that never arrives: the others fail within the timeout, run no later bucket, "
    "abort, and are destroyed promptly") {
  using Clock = std::chrono::steady_clock;
  const auto timeout = std::chrono::milliseconds(1000);
  const int world = 3;
  const int missing = 2;
  // Waiting at once, and after 2.5 timeouts of computing (the backward pass
  // of a large model): by then b0's allreduce has long timed out, and b1
  // and b2 are queued behind it.
  for (const auto compute : {std::chrono::milliseconds(0), 5 * timeout / 2}) {
    CAPTURE(compute.count());
    std::vector<std::string> errors(world);
    std::vector<double> seconds_to_error(world, 0.0), seconds_to_destroy(world, 0.0);
    std::vector<int> later_buckets_run(world, 0);
    std::vector<std::string> after_abort(world);
    std::atomic<int> finished{0};
    testing::run_ranks(
        world,
        [&](Communicator& comm_ref) {
          const int rank = comm_ref.rank();
          std::shared_ptr<Communicator> comm = comm_ref.new_group(std::vector<int>{0, 1, 2});
          std::vector<std::vector<float>> data(3, std::vector<float>(64, 1.0f));
          std::atomic<int> ran_after_b0{0};
          std::vector<std::shared_ptr<Bucket>> buckets;
          for (int b = 0; b < 3; ++b) {
            auto bucket = std::make_shared<Bucket>(
                fmt::format("b{}", b),
                std::vector<BucketTensor>{{fmt::format("t{}", b), view_of(data[b])}});
            if (b > 0) {
              bucket->append_op(
                  std::make_unique<CallbackOp>([&](const std::string&) { ++ran_after_b0; }));
            }
            bucket->append_op(std::make_unique<CentralizedSynchronousOp>(
                comm, nullptr, CentralizedSynchronousOptions{}));
            buckets.push_back(bucket);
          }
          auto backend = std::make_unique<Backend>(
              BackendOptions{.rank = rank, .timeout = timeout, .timeline = nullptr});
          backend->register_ordered_buckets(buckets);
          if (rank == missing) {  // alive, connected, but never marks anything
            const auto limit = Clock::now() + 10 * timeout;
            while (finished.load() < world - 1 && Clock::now() < limit) {
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
            return;
          }
          const auto start = Clock::now();
          for (int b = 0; b < 3; ++b) backend->mark_communication_ready(fmt::format("t{}", b));
          std::this_thread::sleep_for(compute);
          try {
            backend->wait_pending_comm_ops();
          } catch (const TimeoutError& e) {
            errors[rank] = e.what();
          }
          seconds_to_error[rank] = std::chrono::duration<double>(Clock::now() - start).count();
          const auto destroy = Clock::now();
          backend.reset();
          seconds_to_destroy[rank] = std::chrono::duration<double>(Clock::now() - destroy).count();
          later_buckets_run[rank] = ran_after_b0.load();
          // The bucket communicator was aborted: a later collective fails at once.
          std::vector<float> probe(4);
          try {
            comm->allreduce(view_of(probe), view_of(probe), ReduceOp::kSum);
          } catch (const std::exception& e) {
            after_abort[rank] = e.what();
          }
          ++finished;
        },
        timeout);
    const double seconds = std::chrono::duration<double>(timeout).count();
    const double waited = std::chrono::duration<double>(compute).count();
    for (int rank = 0; rank < world; ++rank) {
      if (rank == missing) continue;
      CAPTURE(rank);
      CAPTURE(errors[rank]);
      CHECK(errors[rank].find(fmt::format("rank {}", rank)) != std::string::npos);
      CHECK(errors[rank].find("'b0'") != std::string::npos);
      CHECK(errors[rank].find("centralized_synchronous") != std::string::npos);
      CHECK(seconds_to_error[rank] < std::max(waited, seconds) + 0.6 * seconds);
      CHECK(later_buckets_run[rank] == 0);  // b1 and b2 failed fast: nothing issued
      CHECK(seconds_to_destroy[rank] < 0.5 * seconds);
      CHECK(after_abort[rank].find("aborted") != std::string::npos);
    }
  }
}

TEST_CASE("after a failure no bucket starts and destruction does not wait for stuck collectives") {
  using Clock = std::chrono::steady_clock;
  const auto timeout = std::chrono::milliseconds(400);
  struct Case {
    std::chrono::milliseconds op_timeout;  // the transport's own
    std::chrono::milliseconds compute;     // before wait_pending_comm_ops
  };
  // The transport gives up later than the backend (the wait times out with
  // b0 in flight: it must be aborted); or as late, with the training thread
  // computing while b0 fails (b1 and b2 must not start).
  for (const Case c :
       {Case{3 * timeout, std::chrono::milliseconds(0)}, Case{timeout, 3 * timeout / 2}}) {
    CAPTURE(c.op_timeout.count());
    CAPTURE(c.compute.count());
    std::atomic<int> started{0};
    std::vector<std::vector<float>> data(3, std::vector<float>(4));
    std::vector<std::shared_ptr<Bucket>> buckets;
    for (int b = 0; b < 3; ++b) {
      auto bucket = std::make_shared<Bucket>(
          fmt::format("b{}", b),
          std::vector<BucketTensor>{{fmt::format("t{}", b), view_of(data[b])}});
      bucket->append_op(std::make_shared<StuckOp>(c.op_timeout, started));
      buckets.push_back(bucket);
    }
    auto backend = std::make_unique<Backend>(
        BackendOptions{.rank = 4, .timeout = timeout, .timeline = nullptr});
    backend->register_ordered_buckets(buckets);
    for (int b = 0; b < 3; ++b) backend->mark_communication_ready(fmt::format("t{}", b));
    std::this_thread::sleep_for(c.compute);
    std::string error;
    try {
      backend->wait_pending_comm_ops();
    } catch (const TimeoutError& e) {
      error = e.what();
    }
    CAPTURE(error);
    CHECK(error.find("rank 4") != std::string::npos);
    CHECK(error.find("stuck_collective") != std::string::npos);
    CHECK(error.find("bucket 'b0'") != std::string::npos);
    CHECK_THROWS_AS(backend->mark_communication_ready("t0"), TimeoutError);  // stays failed
    const auto destroy = Clock::now();
    backend.reset();
    const double destroy_seconds = std::chrono::duration<double>(Clock::now() - destroy).count();
    CHECK(destroy_seconds < 0.25 * std::chrono::duration<double>(timeout).count());
    CHECK(started.load() == 1);
  }
}

TEST_CASE("the NCCL backend says why it cannot run, instead of crashing") {
  const std::string why = nccl_unavailable_reason();
  if (why.empty()) return;  // a GPU machine: NCCL is usable
  CHECK_THROWS_WITH_AS(make_nccl_communicator(make_hash_store(), 0, 1),
                       doctest::Contains(why.c_str()), InvalidArgument);
}

TEST_CASE("a CUDA bucket must be flat, and device divide needs CUDA memory") {
  std::vector<float> a(2), b(2);
  const Device gpu{DeviceType::kCUDA, 0};
  Bucket bucket("gpu", {{"a", TensorView{a.data(), 2, DType::kFloat32, gpu}},
                        {"b", TensorView{b.data() + 1, 1, DType::kFloat32, gpu}}});
  CHECK_FALSE(bucket.is_flat());
  CHECK_THROWS_WITH_AS(bucket.with_flat_view([](const TensorView&) {}),
                       doctest::Contains("must be flat"), InvalidArgument);
}

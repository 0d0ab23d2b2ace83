// The window service with ranks as threads: put / accumulate / get / update
// against closed forms on a ring, data split into many odd chunks, every
// rank calling every other at once, passive target (the target sleeps while
// the others complete), the distributed mutex's exclusion, and errors that
// name rank, op and window.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/runtime/window_service.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

TensorView view(std::vector<double>& v) {
  return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kFloat64, {}};
}

std::vector<double> as_doubles(const std::vector<std::byte>& bytes) {
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

TEST_CASE("window service: put, accumulate, get and update on a ring, in odd chunks") {
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      const int left = mod(r - 1, world), right = mod(r + 1, world);
      std::vector<int> ins{left};
      if (right != left) ins.push_back(right);
      // 3 doubles a chunk: 10 elements make 4 chunks, the last partial.
      WindowService service(comm, {.chunk_bytes = 24});
      std::vector<double> x(10, r);
      REQUIRE(service.create("w", view(x), ins, /*zero_init=*/false));
      CHECK_FALSE(service.create("w", view(x), ins, false));  // duplicate: False everywhere
      CHECK(as_doubles(service.buffer("w", left)) == std::vector<double>(10, r));
      comm.barrier();  // checked before any put lands

      // Put 2x to the right neighbour, then x *= 0.5.
      const WindowPeer to_right[] = {{right, 2.0}};
      service.put("w", view(x), to_right, 0.5, false, false, true);
      CHECK(x == std::vector<double>(10, 0.5 * r));
      CHECK(service.associated_p("w") == 0.5);
      comm.barrier();
      CHECK(as_doubles(service.buffer("w", left)) == std::vector<double>(10, 2.0 * left));
      CHECK(service.versions("w").at(left) == 1);
      comm.barrier();

      // Accumulate 1x twice more into the right neighbour.
      const WindowPeer one_right[] = {{right, 1.0}};
      service.put("w", view(x), one_right, 1.0, true, false, true);
      service.put("w", view(x), one_right, 1.0, true, false, true);
      comm.barrier();
      CHECK(as_doubles(service.buffer("w", left)) == std::vector<double>(10, 3.0 * left));
      CHECK(service.versions("w").at(left) == 1);  // accumulate leaves versions

      // Get 3x the left neighbour's live tensor (0.5 * left now).
      const WindowPeer from_left[] = {{left, 3.0}};
      service.get("w", from_left, false, true);
      CHECK(as_doubles(service.buffer("w", left)) == std::vector<double>(10, 1.5 * left));
      CHECK(service.versions("w").at(left) == 2);
      comm.barrier();  // every get read its source before the update below

      // x := (x + 2 * buffer_left) / 4, buffers reset, versions 0.
      const WindowPeer combine[] = {{left, 2.0}};
      service.update("w", 1.0, combine, 4.0, true, view(x), false, true);
      CHECK(x == std::vector<double>(10, (0.5 * r + 3.0 * left) / 4.0));
      CHECK(as_doubles(service.buffer("w", left)) == std::vector<double>(10, 0.0));
      CHECK(service.versions("w").at(left) == 0);
      // p: (1 * 0.5 + 2 * (3 * 0.5)) / 4, the same combination as x's.
      CHECK(service.associated_p("w") == doctest::Approx((0.5 + 3.0) / 4.0));

      comm.barrier();
      CHECK(service.free("w"));
      CHECK(service.names().empty());
      CHECK(service.free(""));  // nothing left: still True
    });
  }
}

TEST_CASE("window service: every rank puts to and gets from every other at once") {
  // A call reaches all its peers at once; with every rank doing that to
  // every other at the same time, no progress thread may wait for a rank
  // that waits in turn. Odd chunks, a weight per destination.
  for (int world : {3, 4, 5}) {
    CAPTURE(world);
    testing::run_ranks(world, [&](Communicator& comm) {
      const int r = comm.rank();
      WindowService service(comm, {.chunk_bytes = 24});
      std::vector<int> others;
      for (int j = 0; j < world; ++j) {
        if (j != r) others.push_back(j);
      }
      std::vector<double> x(10, r + 1.0);
      REQUIRE(service.create("all", view(x), others, /*zero_init=*/true));
      comm.barrier();
      for (int round = 0; round < 3; ++round) {
        CAPTURE(round);
        std::vector<WindowPeer> to, from;
        for (int j : others) {
          to.push_back({j, 1.0 + j + round});
          from.push_back({j, 0.5});
        }
        service.put("all", view(x), to, 1.0, false, false, false);
        comm.barrier();
        for (int j : others) {  // j put (1 + r + round) x_j here
          CHECK(as_doubles(service.buffer("all", j)) ==
                std::vector<double>(10, (1.0 + r + round) * (j + 1.0)));
        }
        comm.barrier();
        service.get("all", from, false, false);
        for (int j : others) {
          CHECK(as_doubles(service.buffer("all", j)) == std::vector<double>(10, 0.5 * (j + 1.0)));
        }
        comm.barrier();
      }
      CHECK(service.free("all"));
    });
  }
}

TEST_CASE("window service: passive target and a large tensor") {
  testing::run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank(), other = 1 - r;
    WindowService service(comm, {.chunk_bytes = 4096});
    std::vector<double> x(100'003, r + 1.0);
    const std::vector<int> ins{other};
    REQUIRE(service.create("big", view(x), ins, /*zero_init=*/true));
    CHECK(as_doubles(service.buffer("big", other)) == std::vector<double>(x.size(), 0.0));
    if (r == 0) {
      // Rank 1 computes (sleeps) through all of this without a call.
      const WindowPeer to[] = {{1, 1.0}};
      const WindowPeer from[] = {{1, 1.0}};
      const auto t0 = std::chrono::steady_clock::now();
      service.put("big", view(x), to, 1.0, false, false, false);
      service.get("big", from, false, false);
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500));
      CHECK(as_doubles(service.buffer("big", 1)) == std::vector<double>(x.size(), 2.0));
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      CHECK(as_doubles(service.buffer("big", 0)) == std::vector<double>(x.size(), 1.0));
    }
    comm.barrier();
  });
}

TEST_CASE("window service: the mutex excludes, and errors name rank, op and window") {
  testing::run_ranks(3, [&](Communicator& comm) {
    const int r = comm.rank();
    WindowService service(comm);
    std::vector<double> x(4, r);
    std::vector<int> ins;
    for (int s = 0; s < 3; ++s) {
      if (s != r) ins.push_back(s);
    }
    REQUIRE(service.create("m", view(x), ins, false));
    static std::atomic<int> inside{0};
    static std::atomic<int> most{0};
    for (int i = 0; i < 20; ++i) {
      service.lock("m", {0});
      const int now = ++inside;
      most = std::max(most.load(), now);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      --inside;
      service.unlock("m", {0});
    }
    comm.barrier();
    CHECK(most.load() == 1);

    const WindowPeer to_self[] = {{r, 1.0}};
    CHECK_THROWS_AS(service.put("m", view(x), to_self, 1.0, false, false, false), InvalidArgument);
    const WindowPeer any[] = {{(r + 1) % 3, 1.0}};
    try {
      service.put("nowhere", view(x), any, 1.0, false, false, false);
      FAIL("put to a missing window must throw");
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      CHECK(what.find("win_put on rank") != std::string::npos);
      CHECK(what.find("'nowhere'") != std::string::npos);
    }
    CHECK_THROWS_AS(service.unlock("m", {(r + 1) % 3}), InvalidArgument);  // not the holder
    comm.barrier();
    CHECK(service.free(""));
  });
}

TEST_CASE("window service: a peer that is gone fails the op within the timeout") {
  const auto errors = testing::run_ranks_collect_errors(
      2,
      [&](Communicator& comm) {
        auto service = std::make_unique<WindowService>(comm);
        std::vector<double> x(8, 1.0);
        const std::vector<int> ins{1 - comm.rank()};
        REQUIRE(service->create("gone", view(x), ins, false));
        if (comm.rank() == 1) {
          service.reset();  // rank 1 stops serving
          comm.barrier();
          return;
        }
        comm.barrier();
        const WindowPeer to[] = {{1, 1.0}};
        const auto t0 = std::chrono::steady_clock::now();
        try {
          service->put("gone", view(x), to, 1.0, false, false, false);
        } catch (...) {
          CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
          throw;
        }
      },
      std::chrono::seconds(2));
  CHECK(errors[1].empty());
  CHECK(errors[0].find("win_put on rank 0 (window 'gone')") != std::string::npos);
  CHECK(errors[0].find("rank 1") != std::string::npos);
}

TEST_CASE("window service: push-sum with mutexes conserves the mass on two windows at once") {
  constexpr int kWorld = 3, kSteps = 40;
  std::vector<double> totals(kWorld * 2);
  testing::run_ranks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    WindowService service(comm, {.chunk_bytes = 16});
    // Directed ring plus one chord: out-neighbours of r are r+1 and r+2.
    std::vector<int> ins{(r + 1) % kWorld, (r + 2) % kWorld};
    std::vector<double> a(5, r), b(7, 10.0 * r + 1);
    REQUIRE(service.create("a", view(a), ins, /*zero_init=*/true));
    REQUIRE(service.create("b", view(b), ins, /*zero_init=*/true));
    const WindowPeer outs[] = {{(r + 1) % kWorld, 1.0 / 3}, {(r + 2) % kWorld, 1.0 / 3}};
    const WindowPeer all_in[] = {{ins[0], 1.0}, {ins[1], 1.0}};
    for (int step = 0; step < kSteps; ++step) {
      for (auto* name : {"a", "b"}) {
        auto& x = std::string(name) == "a" ? a : b;
        service.put(name, view(x), outs, 1.0 / 3, /*accumulate=*/true, /*require_mutex=*/true,
                    /*with_p=*/true);
        service.update(name, 1.0, all_in, 1.0, /*reset=*/true, view(x), /*require_mutex=*/true,
                       /*with_p=*/true);
      }
    }
    comm.barrier();  // every accumulate acknowledged: a last collect takes the rest
    service.update("a", 1.0, all_in, 1.0, true, view(a), true, true);
    service.update("b", 1.0, all_in, 1.0, true, view(b), true, true);
    totals[static_cast<std::size_t>(r)] = a[0];
    totals[static_cast<std::size_t>(kWorld + r)] = b[6];
    // p went through the same ops as a tensor of ones: x / p is the average.
    CHECK(a[0] / service.associated_p("a") == doctest::Approx(1.0).epsilon(1e-9));
    CHECK(b[6] / service.associated_p("b") == doctest::Approx(11.0).epsilon(1e-9));
    comm.barrier();
    CHECK(service.free(""));
  });
  CHECK(totals[0] + totals[1] + totals[2] == doctest::Approx(0.0 + 1 + 2).epsilon(1e-12));
  CHECK(totals[3] + totals[4] + totals[5] == doctest::Approx(1.0 + 11 + 21).epsilon(1e-12));
}

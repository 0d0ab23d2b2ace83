// The P-Reduce's mailboxes in shared memory (SharedMemoryMessages, and
// Communicator::send_recv_on_host over them), ranks as threads: every
// message arrives whole to the rank it was meant for, over many reuses of
// each mailbox and in any order of the lists; a receive takes only the
// message of its tag, so two calls on two threads of a rank do not take
// each other's; and the failures: a tag nobody sends, a message longer than
// its receive, a message too large for a mailbox.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/comm/shared_memory_messages.h"
#include "bagua/core/errors.h"
#include "rank_threads.h"

using namespace bagua;

namespace {

GlooOptions network_only() {
  GlooOptions options;
  options.shared_memory = SharedMemoryOptions{.enabled = false};
  options.timeout = std::chrono::seconds(20);
  return options;
}

// The mailboxes of `comm`'s ranks (the communicator itself stays on the
// network, so these are the only ones).
std::unique_ptr<SharedMemoryMessages> mailboxes_of(Communicator& comm) {
  auto boxes = SharedMemoryMessages::attach(comm, "test-messages");
  REQUIRE(boxes != nullptr);  // ranks as threads share one host
  return boxes;
}

// Byte i of the message from `from` to `to` in round `round`.
std::uint8_t byte_of(int from, int to, int round, std::size_t i) {
  return static_cast<std::uint8_t>(from * 31 + to * 7 + round * 13 + static_cast<int>(i % 251));
}

TensorView bytes_view(std::vector<std::uint8_t>& v) {
  return TensorView{v.data(), static_cast<std::int64_t>(v.size()), DType::kUInt8, {}};
}

}  // namespace

TEST_CASE("shared-memory messages: every message whole, many rounds, any list order") {
  for (const int world : {2, 3, 5}) {
    CAPTURE(world);
    testing::run_ranks_with(world, network_only(), [&](Communicator& comm) {
      auto boxes = mailboxes_of(comm);
      const int me = comm.rank();
      std::mt19937 shuffle(static_cast<unsigned>(me));
      for (int round = 0; round < 200; ++round) {
        // Sizes vary by round and pair, the largest round fills the mailbox.
        const auto size_of = [&](int from, int to) {
          return round == 7 ? boxes->capacity()
                            : static_cast<std::size_t>(1 + (round * 97 + from * 13 + to) % 4000);
        };
        std::vector<std::vector<std::uint8_t>> out(static_cast<std::size_t>(world)),
            in(static_cast<std::size_t>(world));
        std::vector<PeerMessage> sends, receives;
        for (int peer = 0; peer < world; ++peer) {
          if (peer == me) continue;
          auto& o = out[static_cast<std::size_t>(peer)];
          o.resize(size_of(me, peer));
          for (std::size_t i = 0; i < o.size(); ++i) o[i] = byte_of(me, peer, round, i);
          auto& r = in[static_cast<std::size_t>(peer)];
          r.assign(size_of(peer, me), 0);
          sends.push_back({bytes_view(o), peer, 0x5a00u + static_cast<unsigned>(round)});
          receives.push_back({bytes_view(r), peer, 0x5a00u + static_cast<unsigned>(round)});
        }
        std::shuffle(sends.begin(), sends.end(), shuffle);
        std::shuffle(receives.begin(), receives.end(), shuffle);
        boxes->exchange(sends, receives, std::chrono::seconds(20), std::atomic<bool>{false});
        for (int peer = 0; peer < world; ++peer) {
          if (peer == me) continue;
          const auto& r = in[static_cast<std::size_t>(peer)];
          bool whole = true;
          for (std::size_t i = 0; i < r.size(); ++i)
            whole = whole && r[i] == byte_of(peer, me, round, i);
          if (!whole) FAIL("round ", round, ": rank ", me, " got a wrong message from ", peer);
        }
      }
    });
  }
}

TEST_CASE("shared-memory messages: a receive takes only its tag's message") {
  // Rank 1 sends tag B first, then tag A. Rank 0 waits for both at once on
  // two threads, A's thread started first: it must leave B's message to B's
  // thread, and each thread gets its own payload.
  testing::run_ranks_with(2, network_only(), [&](Communicator& comm) {
    auto boxes = mailboxes_of(comm);
    constexpr std::uint64_t kA = 0xa, kB = 0xb;
    if (comm.rank() == 1) {
      for (const std::uint64_t tag : {kB, kA}) {
        std::vector<std::uint8_t> payload(100, static_cast<std::uint8_t>(tag));
        const PeerMessage send[] = {{bytes_view(payload), 0, tag}};
        boxes->exchange(send, {}, std::chrono::seconds(20), std::atomic<bool>{false});
      }
      return;
    }
    std::vector<std::uint8_t> a(100, 0), b(100, 0);
    std::thread for_a([&] {
      const PeerMessage receive[] = {{bytes_view(a), 1, kA}};
      boxes->exchange({}, receive, std::chrono::seconds(20), std::atomic<bool>{false});
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const PeerMessage receive[] = {{bytes_view(b), 1, kB}};
    boxes->exchange({}, receive, std::chrono::seconds(20), std::atomic<bool>{false});
    for_a.join();
    CHECK(std::all_of(a.begin(), a.end(), [](auto x) { return x == kA; }));
    CHECK(std::all_of(b.begin(), b.end(), [](auto x) { return x == kB; }));
  });
}

TEST_CASE("shared-memory messages: failures name the rank, the peer and the sizes") {
  SUBCASE("a tag the peer never sends: a timeout naming the peer and the tag") {
    std::vector<std::string> errors(2);
    testing::run_ranks_with(2, network_only(), [&](Communicator& comm) {
      auto boxes = mailboxes_of(comm);
      std::vector<std::uint8_t> out(8, 1), in(8, 0);
      const int peer = 1 - comm.rank();
      const PeerMessage send[] = {{bytes_view(out), peer, 5u + static_cast<unsigned>(comm.rank())}};
      const PeerMessage receive[] = {
          {bytes_view(in), peer, 5u + static_cast<unsigned>(comm.rank())}};
      try {
        boxes->exchange(send, receive, std::chrono::milliseconds(300), std::atomic<bool>{false});
      } catch (const TimeoutError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    CHECK(errors[0].find("timed out after 300 ms waiting for rank 1's message tagged 0x5") !=
          std::string::npos);
    CHECK(errors[1].find("on rank 1 of 2") != std::string::npos);
    CHECK(errors[1].find("rank 0's message tagged 0x6") != std::string::npos);
  }
  SUBCASE("a message longer than its receive, a send larger than a mailbox") {
    testing::run_ranks_with(2, network_only(), [&](Communicator& comm) {
      auto boxes = mailboxes_of(comm);
      if (comm.rank() == 0) {
        std::vector<std::uint8_t> big(boxes->capacity() + 1, 0), out(64, 3);
        const PeerMessage too_large[] = {{bytes_view(big), 1, 9}};
        CHECK_THROWS_AS(
            boxes->exchange(too_large, {}, std::chrono::seconds(5), std::atomic<bool>{false}),
            InvalidArgument);
        const PeerMessage send[] = {{bytes_view(out), 1, 9}};
        boxes->exchange(send, {}, std::chrono::seconds(5), std::atomic<bool>{false});
      } else {
        std::vector<std::uint8_t> in(16, 0);
        const PeerMessage receive[] = {{bytes_view(in), 0, 9}};
        try {
          boxes->exchange({}, receive, std::chrono::seconds(5), std::atomic<bool>{false});
          FAIL("a 64-byte message went into a 16-byte receive");
        } catch (const BackendError& e) {
          CHECK(std::string(e.what()).find(
                    "rank 0 sent 64 bytes tagged 0x9, the receive holds 16") != std::string::npos);
        }
      }
    });
  }
}

TEST_CASE("send_recv_on_host: takes the mailboxes where they fit, else leaves it to send_recv") {
  for (const bool shared : {true, false}) {
    CAPTURE(shared);
    GlooOptions options = network_only();
    options.shared_memory = SharedMemoryOptions{.enabled = shared};
    testing::run_ranks_with(3, options, [&](Communicator& comm) {
      const int next = (comm.rank() + 1) % 3, prev = (comm.rank() + 2) % 3;
      std::vector<float> out(1000, static_cast<float>(comm.rank())), in(1000, -1.0f);
      const TensorView out_view{out.data(), 1000, DType::kFloat32, {}};
      const TensorView in_view{in.data(), 1000, DType::kFloat32, {}};
      const PeerMessage send[] = {{out_view, next, 77}};
      const PeerMessage receive[] = {{in_view, prev, 77}};
      const auto sent_before = comm.counters().bytes_sent.load();
      CHECK(comm.send_recv_on_host(send, receive) == shared);
      if (shared) {
        CHECK(in == std::vector<float>(1000, static_cast<float>(prev)));
        CHECK(comm.counters().bytes_sent.load() - sent_before == 4000);
      }
      // 1 MB does not fit a mailbox: nothing is sent, send_recv carries it.
      std::vector<float> big_out(1 << 18, 1.0f), big_in(1 << 18, 0.0f);
      const PeerMessage big_send[] = {
          {TensorView{big_out.data(), 1 << 18, DType::kFloat32, {}}, next, 78}};
      const PeerMessage big_receive[] = {
          {TensorView{big_in.data(), 1 << 18, DType::kFloat32, {}}, prev, 78}};
      CHECK_FALSE(comm.send_recv_on_host(big_send, big_receive));
      comm.send_recv(big_send, big_receive);
      CHECK(big_in[12345] == 1.0f);
    });
  }
}

// The timeline: its Chrome trace JSON, and that recording an event allocates
// nothing once its strings are known (events kept as many small heap blocks
// fragmented malloc's heap under the training loop: core/timeline.h).
#include <doctest/doctest.h>

#include <cstdlib>
#include <new>
#include <string>

#include <nlohmann/json.hpp>

#include "bagua/core/errors.h"
#include "bagua/core/timeline.h"

using namespace bagua;

namespace {

// operator new counts this thread's calls while counting_on is set.
thread_local bool counting_on = false;
thread_local std::size_t counted_news = 0;

// The allocations `fn` makes on this thread.
template <typename Fn>
std::size_t allocations_of(Fn&& fn) {
  counted_news = 0;
  counting_on = true;
  fn();
  counting_on = false;
  return counted_news;
}

}  // namespace

// Replaced for the whole test binary: malloc and free, as libstdc++'s own,
// with the count above.
void* operator new(std::size_t size) {
  if (counting_on) ++counted_news;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// GCC takes the free() in a replaced operator delete for a mismatch.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

TEST_CASE("timeline: instants, spans and their arguments in the trace") {
  Timeline timeline(3);
  timeline.instant("ready layer.weight", "tensor_ready", Timeline::kTrainingLane,
                   {{"bucket", std::string("bucket0")}});
  timeline.span("centralized_synchronous", "comm_op", Timeline::kCommunicationLane, 10, 25,
                {{"bucket", "bucket0"},
                 {"bytes_sent", std::int64_t{4096}},
                 {"bucket_bytes", std::size_t{8192}}});
  timeline.span("async_round", "async_model_average", Timeline::kBackgroundLane, 30, 30,
                {{"round", 7}, {"drift", 0.25}, {"bucket", "bucket1"}});
  CHECK(timeline.size() == 3);
  const auto trace = nlohmann::json::parse(timeline.to_json());
  CHECK(trace["otherData"]["rank"] == 3);
  CHECK(trace["otherData"]["dropped_events"] == 0);
  const auto& events = trace["traceEvents"];
  REQUIRE(events.size() == 4 + 3);  // the process and three lane names first
  CHECK(events[0]["args"]["name"] == "rank 3");
  const auto& ready = events[4];
  CHECK(ready["name"] == "ready layer.weight");
  CHECK(ready["cat"] == "tensor_ready");
  CHECK(ready["ph"] == "i");
  CHECK(ready["s"] == "t");
  CHECK(ready["tid"] == Timeline::kTrainingLane);
  CHECK(ready["pid"] == 3);
  CHECK(ready["args"] == nlohmann::json{{"bucket", "bucket0"}});
  CHECK_FALSE(ready.contains("dur"));
  const auto& op = events[5];
  CHECK(op["ph"] == "X");
  CHECK(op["ts"] == 10);
  CHECK(op["dur"] == 15);
  CHECK(op["tid"] == Timeline::kCommunicationLane);
  CHECK(op["args"] ==
        nlohmann::json{{"bucket", "bucket0"}, {"bytes_sent", 4096}, {"bucket_bytes", 8192}});
  const auto& round = events[6];
  CHECK(round["dur"] == 0);  // a span of no length stays a span
  CHECK(round["args"]["round"] == 7);
  CHECK(round["args"]["drift"].get<double>() == 0.25);
  CHECK(round["args"]["bucket"] == "bucket1");
}

TEST_CASE("timeline: an event allocates nothing once its strings are known") {
  Timeline timeline(0);
  const std::string bucket = "a bucket name longer than any short-string buffer";
  const std::string tensor = "ready model.layers.0.self_attention.in_proj_weight";
  const auto record = [&] {
    timeline.instant(tensor, "tensor_ready", Timeline::kTrainingLane, {{"bucket", bucket}});
    timeline.span("centralized_synchronous", "comm_op", Timeline::kCommunicationLane, 1, 2,
                  {{"bucket", bucket}, {"bytes_sent", 1}, {"bucket_bytes", 2}});
  };
  record();  // the first use of each string stores it
  const std::size_t events = std::size_t{6} * Timeline::kBlockEvents;
  const std::size_t news = allocations_of([&] {
    for (std::size_t i = 0; i < events / 2; ++i) record();
  });
  // A block per kBlockEvents events (and the list of blocks growing), where
  // JSON objects took about ten per event.
  CHECK(news <= 2 * (events / Timeline::kBlockEvents + 1));
  CHECK(timeline.event_blocks() == events / Timeline::kBlockEvents + 1);
  CHECK(timeline.size() == events + 2);
  const auto trace = nlohmann::json::parse(timeline.to_json());
  CHECK(trace["traceEvents"].back()["args"]["bucket"] == bucket);
  CHECK(trace["traceEvents"][4]["name"] == tensor);
}

TEST_CASE("timeline: more arguments than an event holds are refused") {
  Timeline timeline(0);
  CHECK_THROWS_AS(timeline.span("x", "y", 0, 0, 1,
                                {{"a", 1}, {"b", 2}, {"c", 3}, {"d", 4}, {"e", 5}, {"f", 6}}),
                  InvalidArgument);
  CHECK(timeline.size() == 0);
}

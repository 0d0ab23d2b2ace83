// A per-rank timeline of the runtime's events, written as Chrome trace JSON
// (chrome://tracing and Perfetto open it): tensor-ready instants, each
// bucket's ops with start, end and bytes, and the training phases recorded
// by the Python layer (forward, backward, optimizer step).
//
// Off unless BAGUA_TIMELINE names a directory; the backend then holds one and
// each event costs a lock and a push. With it off the backend holds a null
// pointer and records nothing. Events are capped (kMaxEvents) so a long run
// cannot exhaust memory; the file says how many were dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace bagua {

class Timeline {
 public:
  static constexpr std::size_t kMaxEvents = 1'000'000;
  // Thread lanes of the trace.
  static constexpr int kTrainingLane = 0;
  static constexpr int kCommunicationLane = 1;
  // Ops' own background threads (asynchronous model average rounds).
  static constexpr int kBackgroundLane = 2;

  explicit Timeline(int rank) : rank_(rank), origin_(std::chrono::steady_clock::now()) {}

  // The timeline of the op this thread runs (Backend::run_op sets it for the
  // op's duration, null without one), so an op can mark its phases
  // (TimelinePhase) without being handed a timeline.
  static Timeline*& of_this_thread() {
    thread_local Timeline* current = nullptr;
    return current;
  }

  std::int64_t now_us() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                                 origin_)
        .count();
  }

  void instant(const std::string& name, const std::string& category, int lane,
               nlohmann::json args = nlohmann::json::object()) {
    push({{"name", name},
          {"cat", category},
          {"ph", "i"},
          {"s", "t"},
          {"ts", now_us()},
          {"pid", rank_},
          {"tid", lane},
          {"args", std::move(args)}});
  }

  // A span [start_us, end_us) ("complete" event).
  void span(const std::string& name, const std::string& category, int lane, std::int64_t start_us,
            std::int64_t end_us, nlohmann::json args = nlohmann::json::object()) {
    push({{"name", name},
          {"cat", category},
          {"ph", "X"},
          {"ts", start_us},
          {"dur", end_us - start_us},
          {"pid", rank_},
          {"tid", lane},
          {"args", std::move(args)}});
  }

  std::string to_json() const {
    std::lock_guard lock(mutex_);
    nlohmann::json events = nlohmann::json::array();
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", rank_},
                      {"args", {{"name", "rank " + std::to_string(rank_)}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", rank_},
                      {"tid", kTrainingLane},
                      {"args", {{"name", "training"}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", rank_},
                      {"tid", kCommunicationLane},
                      {"args", {{"name", "communication"}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", rank_},
                      {"tid", kBackgroundLane},
                      {"args", {{"name", "background"}}}});
    for (const auto& event : events_) events.push_back(event);
    return nlohmann::json{{"traceEvents", std::move(events)},
                          {"displayTimeUnit", "ms"},
                          {"otherData", {{"rank", rank_}, {"dropped_events", dropped_}}}}
        .dump();
  }

  std::size_t size() const {
    std::lock_guard lock(mutex_);
    return events_.size();
  }

 private:
  void push(nlohmann::json event) {
    std::lock_guard lock(mutex_);
    if (events_.size() >= kMaxEvents) {
      ++dropped_;
      return;
    }
    events_.push_back(std::move(event));
  }

  int rank_;
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<nlohmann::json> events_;
  std::int64_t dropped_ = 0;
};

// Timeline::of_this_thread() is `timeline` for this object's lifetime.
class ThisThreadTimeline {
 public:
  explicit ThisThreadTimeline(Timeline* timeline)
      : outer_(std::exchange(Timeline::of_this_thread(), timeline)) {}
  ~ThisThreadTimeline() { Timeline::of_this_thread() = outer_; }
  ThisThreadTimeline(const ThisThreadTimeline&) = delete;
  ThisThreadTimeline& operator=(const ThisThreadTimeline&) = delete;

 private:
  Timeline* outer_;
};

// A phase of the op running on this thread: a span ("op_phase") on the
// communication lane of the op's timeline, or nothing without one. Host time:
// on a CUDA buffer it covers the launches, not the kernels.
class TimelinePhase {
 public:
  explicit TimelinePhase(const char* name)
      : timeline_(Timeline::of_this_thread()),
        name_(name),
        start_us_(timeline_ ? timeline_->now_us() : 0) {}
  ~TimelinePhase() {
    if (timeline_) {
      timeline_->span(name_, "op_phase", Timeline::kCommunicationLane, start_us_,
                      timeline_->now_us());
    }
  }
  TimelinePhase(const TimelinePhase&) = delete;
  TimelinePhase& operator=(const TimelinePhase&) = delete;

 private:
  Timeline* timeline_;
  const char* name_;
  std::int64_t start_us_;
};

}  // namespace bagua

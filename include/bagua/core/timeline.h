// A per-rank timeline of the runtime's events, written as Chrome trace JSON
// (chrome://tracing and Perfetto open it): tensor-ready instants, each
// bucket's ops with start, end and bytes, and the training phases recorded
// by the Python layer (forward, backward, optimizer step).
//
// Off unless BAGUA_TIMELINE names a directory; the backend then holds one and
// each event costs a lock and a copy into a block of events. With it off the
// backend holds a null pointer and records nothing. Events are capped
// (kMaxEvents) so a long run cannot exhaust memory; the file says how many
// were dropped.
//
// Why events are plain structs in blocks, their strings interned: an event
// kept as a JSON object was a dozen small heap blocks that live to the end of
// the run. Recorded during the backward, they landed inside the holes the
// last step's freed gradients left in malloc's heap, so the next step's
// gradients no longer fitted there: the heap grew by the model's size every
// step (9-21 MB a step for a 19 MB model) and every fresh gradient page
// faulted, making the backward 3-4x slower on whole runs
// (docs/benchmarks.md, "The timeline's own cost"). A block of kBlockEvents
// events is one allocation; a name is stored once.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bagua {

// One argument of an event ("args" in the trace): a key and an integer, a
// floating-point number or a string.
class TimelineArg {
 public:
  enum class Kind : std::uint8_t { kInteger, kReal, kText };

  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  TimelineArg(std::string_view key, T value)
      : key_(key), kind_(Kind::kInteger), integer_(static_cast<std::int64_t>(value)) {}
  TimelineArg(std::string_view key, double value) : key_(key), kind_(Kind::kReal), real_(value) {}
  TimelineArg(std::string_view key, std::string_view value)
      : key_(key), kind_(Kind::kText), text_(value) {}
  TimelineArg(std::string_view key, const char* value)
      : TimelineArg(key, std::string_view(value)) {}
  TimelineArg(std::string_view key, const std::string& value)
      : TimelineArg(key, std::string_view(value)) {}

  std::string_view key() const { return key_; }
  Kind kind() const { return kind_; }
  std::int64_t integer() const { return integer_; }
  double real() const { return real_; }
  std::string_view text() const { return text_; }

 private:
  std::string_view key_;
  Kind kind_;
  std::int64_t integer_ = 0;
  double real_ = 0.0;
  std::string_view text_;
};

class Timeline {
 public:
  static constexpr std::size_t kMaxEvents = 1'000'000;
  static constexpr std::size_t kBlockEvents = 4096;
  static constexpr std::size_t kMaxArgs = 5;
  // Thread lanes of the trace.
  static constexpr int kTrainingLane = 0;
  static constexpr int kCommunicationLane = 1;
  // Ops' own background threads (asynchronous model average rounds).
  static constexpr int kBackgroundLane = 2;

  using Args = std::initializer_list<TimelineArg>;

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

  // An instant at now. At most kMaxArgs arguments (InvalidArgument beyond).
  void instant(std::string_view name, std::string_view category, int lane, Args args = {}) {
    push(name, category, lane, now_us(), 0, /*instant=*/true, args);
  }

  // A span [start_us, end_us) ("complete" event).
  void span(std::string_view name, std::string_view category, int lane, std::int64_t start_us,
            std::int64_t end_us, Args args = {}) {
    push(name, category, lane, start_us, end_us - start_us, /*instant=*/false, args);
  }

  // The trace: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData":
  // {"rank", "dropped_events"}}.
  std::string to_json() const;

  std::size_t size() const {
    std::lock_guard lock(mutex_);
    return count_;
  }

  // Heap blocks the recorded events hold (their blocks; names not counted):
  // a check that recording does not allocate per event.
  std::size_t event_blocks() const {
    std::lock_guard lock(mutex_);
    return blocks_.size();
  }

 private:
  struct StoredArg {
    std::uint32_t key = 0;
    TimelineArg::Kind kind = TimelineArg::Kind::kInteger;
    union {
      std::int64_t integer;
      double real;
      std::uint32_t text;
    } value{};
  };
  struct Event {
    std::int64_t ts_us = 0;
    std::int64_t dur_us = 0;
    bool instant = false;
    std::uint32_t name = 0;
    std::uint32_t category = 0;
    std::int32_t lane = 0;
    std::uint32_t arg_count = 0;
    std::array<StoredArg, kMaxArgs> args{};
  };
  // Heterogeneous lookup: a string_view finds its name without a copy.
  struct NameHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  void push(std::string_view name, std::string_view category, int lane, std::int64_t ts_us,
            std::int64_t dur_us, bool instant, Args args);
  std::uint32_t intern_locked(std::string_view text);

  int rank_;
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Event[]>> blocks_;
  std::size_t count_ = 0;
  std::unordered_map<std::string, std::uint32_t, NameHash, std::equal_to<>> ids_;
  std::vector<std::string> names_;
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
    if (!timeline_) return;
    try {
      timeline_->span(name_, "op_phase", Timeline::kCommunicationLane, start_us_,
                      timeline_->now_us());
    } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory for a block; the op goes on
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

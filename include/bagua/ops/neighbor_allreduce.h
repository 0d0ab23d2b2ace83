// Neighbour allreduce (BlueFog's core op): each rank combines its tensor with
// what its sources send it.
//
// At rank i, with sources R_i (weight r(j) each) and self weight s:
//   out_i = s * x_i + sum_{j in R_i} r(j) * d_j(i) * x_j
// where d_j(i) is the weight rank j gave destination i (1 by default). The
// sender sends x unscaled with d in a small header; the receiver applies
// r * d once, so a rank sending to several destinations makes no scaled copy.
// Without a self weight the result is the uniform average, computed as a sum
// then one division, (x_i + sum_j d_j(i) x_j) / (|R_i| + 1), so averaging
// equal values is exact. 16-bit floats are accumulated in float32 and rounded
// once.
//
// Sources listed as `ignored_sources` are received (they send to us) but not
// combined: BlueFog's partial averaging over a subset of in-neighbours.
//
// Contract: collective over the communicator's ranks in the same order (one
// thread per instance); every message of a call carries the call's tag (name
// and per-name count) and is checked, so a call never combines another call's
// data. With `check_pattern` the ranks first agree on the pattern
// (neighbor_pattern.h). Every wait is bounded by the communicator's timeout.
#pragma once

#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/ops/neighbor_pattern.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct NeighborWeight {
  int rank = -1;
  double weight = 1.0;
};

struct NeighborAllreduceOptions {
  // Unset: the uniform average (sum, then divide by the number of sources + 1).
  std::optional<double> self_weight;
  std::vector<NeighborWeight> sources;       // combined, with their weight r
  std::vector<int> ignored_sources;          // received and dropped
  std::vector<NeighborWeight> destinations;  // sent to, with their weight d
  bool check_pattern = true;
  std::string name;  // the call's name for tags and messages ("" is a name too)
};

class NeighborAllreduce {
 public:
  explicit NeighborAllreduce(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
    BAGUA_CHECK_ARG(comm_ != nullptr, "neighbor_allreduce needs a communicator");
  }

  // output = the combination above; input and output have the same size,
  // dtype (floating) and device and do not overlap; input is left untouched.
  void run(const TensorView& input, const TensorView& output,
           const NeighborAllreduceOptions& options) {
    validate(input, output, options);
    const std::uint64_t tag = sequence_.next_tag(options.name);
    if (options.check_pattern && comm_->size() > 1) {
      check_neighbor_pattern(*comm_, pattern(input, options, tag));
    }
    Compute& c = compute(input.device);
    std::vector<CachingAllocator::Block> blocks;
    const auto received = exchange(c, input, options, tag, blocks);
    combine(c, input, output, options, received);
    c.finish("neighbor_allreduce", comm_->timeout());
  }

  Communicator& communicator() { return *comm_; }

 private:
  // The header sent before each message: checked by the receiver.
  struct Header {
    std::int64_t tag = 0;
    std::int64_t numel = 0;
    std::int64_t dtype = 0;
    std::int64_t weight_bits = 0;  // the double d, bit for bit
  };
  static constexpr std::int64_t kHeaderWords = sizeof(Header) / sizeof(std::int64_t);

  struct Received {
    TensorView data;
    double weight = 0;  // r * d
  };

  std::string where(const NeighborAllreduceOptions& o) const {
    return fmt::format("neighbor_allreduce '{}' (rank {} of {})", o.name, comm_->rank(),
                       comm_->size());
  }

  void validate(const TensorView& in, const TensorView& out,
                const NeighborAllreduceOptions& o) const {
    const std::string op = where(o);
    BAGUA_CHECK_ARG(is_floating_point(in.dtype), "{}: needs a floating point tensor, got {}", op,
                    in.describe());
    BAGUA_CHECK_ARG(in.numel == out.numel && in.dtype == out.dtype && in.device == out.device,
                    "{}: output {} does not match input {}", op, out.describe(), in.describe());
    BAGUA_CHECK_ARG(in.numel == 0 || in.data != out.data, "{}: output must not alias the input",
                    op);
    std::vector<int> received;
    for (const auto& s : o.sources) received.push_back(s.rank);
    received.insert(received.end(), o.ignored_sources.begin(), o.ignored_sources.end());
    check_neighbor_ranks(op, "the sources", received, comm_->rank(), comm_->size());
    std::vector<int> sent;
    for (const auto& d : o.destinations) sent.push_back(d.rank);
    check_neighbor_ranks(op, "the destinations", sent, comm_->rank(), comm_->size());
  }

  NeighborPattern pattern(const TensorView& in, const NeighborAllreduceOptions& o,
                          std::uint64_t tag) const {
    NeighborPattern p{.op = "neighbor_allreduce",
                      .tag = tag,
                      .dtype = in.dtype,
                      .numel = in.numel,
                      .sends = {},
                      .receives = {}};
    for (const auto& d : o.destinations) p.sends.push_back(d.rank);
    for (const auto& s : o.sources) p.receives.push_back(s.rank);
    p.receives.insert(p.receives.end(), o.ignored_sources.begin(), o.ignored_sources.end());
    return p;
  }

  // Sends x (and a header) to every destination, receives every source's into
  // scratch (kept alive by `blocks`); returns the sources to combine.
  std::vector<Received> exchange(Compute& c, const TensorView& in,
                                 const NeighborAllreduceOptions& o, std::uint64_t tag,
                                 std::vector<CachingAllocator::Block>& blocks) {
    std::vector<Header> out_headers;
    for (const auto& d : o.destinations) {
      out_headers.push_back({static_cast<std::int64_t>(tag), in.numel,
                             static_cast<std::int64_t>(in.dtype),
                             std::bit_cast<std::int64_t>(d.weight)});
    }
    std::vector<int> from;
    for (const auto& s : o.sources) from.push_back(s.rank);
    from.insert(from.end(), o.ignored_sources.begin(), o.ignored_sources.end());
    std::vector<Header> in_headers(from.size());
    std::vector<TensorView> data;
    std::vector<PeerMessage> sends, receives;
    for (std::size_t k = 0; k < o.destinations.size(); ++k) {
      sends.push_back({header_view(out_headers[k]), o.destinations[k].rank});
      sends.push_back({in, o.destinations[k].rank});
    }
    for (std::size_t k = 0; k < from.size(); ++k) {
      blocks.push_back(c.scratch(in.nbytes()));
      data.push_back(c.view(blocks.back(), in.numel, in.dtype));
      receives.push_back({header_view(in_headers[k]), from[k]});
      receives.push_back({data.back(), from[k]});
    }
    neighbor_send_recv(*comm_, where(o), o.check_pattern, sends, receives);
    std::vector<Received> combined;
    for (std::size_t k = 0; k < from.size(); ++k) {
      check_header(o, in, in_headers[k], from[k], tag);
      if (k < o.sources.size()) {
        const double d = std::bit_cast<double>(in_headers[k].weight_bits);
        combined.push_back({data[k], o.sources[k].weight * d});
      }
    }
    return combined;
  }

  static TensorView header_view(Header& h) { return TensorView{&h, kHeaderWords, DType::kInt64}; }

  void check_header(const NeighborAllreduceOptions& o, const TensorView& in, const Header& h,
                    int peer, std::uint64_t tag) const {
    if (h.tag == static_cast<std::int64_t>(tag) && h.numel == in.numel &&
        h.dtype == static_cast<std::int64_t>(in.dtype)) {
      return;
    }
    throw InvalidArgument(fmt::format(
        "{}: rank {} sent a message of another call ({} elements of dtype #{}, tag {:x}; this "
        "call: {} elements of {}, tag {:x}): the ranks' calls are out of order",
        where(o), peer, h.numel, h.dtype, static_cast<std::uint64_t>(h.tag), in.numel,
        to_string(in.dtype), tag));
  }

  // out = s x + sum r d x_j (or the uniform average), accumulated in `acc`:
  // the output itself, or float32 scratch for 16-bit floats.
  void combine(Compute& c, const TensorView& in, const TensorView& out,
               const NeighborAllreduceOptions& o, const std::vector<Received>& received) {
    const bool wide = in.dtype == DType::kFloat16 || in.dtype == DType::kBFloat16;
    CachingAllocator::Block acc_block, tmp_block;
    TensorView acc = out;
    TensorView tmp{};
    if (wide) {
      acc_block = c.scratch(static_cast<std::size_t>(in.numel) * sizeof(float));
      tmp_block = c.scratch(static_cast<std::size_t>(in.numel) * sizeof(float));
      acc = c.view(acc_block, in.numel, DType::kFloat32);
      tmp = c.view(tmp_block, in.numel, DType::kFloat32);
    }
    // acc += w * v, through tmp when v must be widened first.
    auto add = [&](double w, const TensorView& v) {
      if (wide) c.convert(v, tmp);
      c.axpby(w, wide ? tmp : v, 1.0, acc);
    };
    c.zero(acc.data, acc.nbytes());
    add(o.self_weight.value_or(1.0), in);
    for (const auto& r : received) add(r.weight, r.data);
    if (!o.self_weight) c.divide(acc, static_cast<std::int64_t>(received.size()) + 1);
    if (wide) c.convert(acc, out);
  }

  Compute& compute(Device device) {
    if (!compute_ || compute_->device() != device) compute_ = compute_for(device);
    return *compute_;
  }

  std::shared_ptr<Communicator> comm_;
  NeighborSequence sequence_;
  std::unique_ptr<Compute> compute_;
};

}  // namespace bagua

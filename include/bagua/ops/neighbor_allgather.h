// Neighbour allgather: each rank receives its sources' tensors, concatenated
// in the order the sources are listed; sizes may differ per rank.
//
// Two steps, because the caller allocates the output: `plan` (collective)
// checks the pattern and exchanges the element counts; `run` (collective)
// moves the data into the output, source after source. Every message carries
// the call's tag (neighbor_pattern.h), checked on receipt.
//
// Contract: as neighbor_allreduce.h (same call order on every rank, one thread
// per instance, every wait bounded by the communicator's timeout).
#pragma once

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bagua/comm/communicator.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/ops/neighbor_pattern.h"

namespace bagua {

struct NeighborAllgatherOptions {
  std::vector<int> sources;       // received from, in output order
  std::vector<int> destinations;  // sent to
  bool check_pattern = true;
  std::string name;
};

// What `plan` agreed: element counts per source, in the sources' order.
struct NeighborAllgatherPlan {
  NeighborAllgatherOptions options;
  std::uint64_t tag = 0;
  DType dtype = DType::kFloat32;
  std::int64_t numel = 0;  // this rank's input
  std::vector<std::int64_t> counts;

  std::int64_t total() const { return std::accumulate(counts.begin(), counts.end(), 0ll); }
};

class NeighborAllgather {
 public:
  explicit NeighborAllgather(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
    BAGUA_CHECK_ARG(comm_ != nullptr, "neighbor_allgather needs a communicator");
  }

  NeighborAllgatherPlan plan(DType dtype, std::int64_t numel, NeighborAllgatherOptions options) {
    const std::string op = where(options.name);
    BAGUA_CHECK_ARG(numel >= 0, "{}: negative element count {}", op, numel);
    check_neighbor_ranks(op, "src_ranks", options.sources, comm_->rank(), comm_->size());
    check_neighbor_ranks(op, "dst_ranks", options.destinations, comm_->rank(), comm_->size());
    NeighborAllgatherPlan p;
    p.tag = sequence_.next_tag(options.name);
    p.dtype = dtype;
    p.numel = numel;
    if (options.check_pattern && comm_->size() > 1) {
      check_neighbor_pattern(*comm_, {.op = "neighbor_allgather",
                                      .tag = p.tag,
                                      .dtype = dtype,
                                      .numel = -1,
                                      .sends = options.destinations,
                                      .receives = options.sources});
    }
    p.counts = exchange_counts(p, options);
    p.options = std::move(options);
    return p;
  }

  // output (plan.total() elements) = the sources' inputs, concatenated.
  void run(const NeighborAllgatherPlan& p, const TensorView& input, const TensorView& output) {
    const std::string op = where(p.options.name);
    BAGUA_CHECK_ARG(input.numel == p.numel && input.dtype == p.dtype,
                    "{}: input {} differs from the plan ({} elements of {})", op, input.describe(),
                    p.numel, to_string(p.dtype));
    BAGUA_CHECK_ARG(output.numel == p.total() && output.dtype == p.dtype,
                    "{}: output {} must hold {} elements of {}", op, output.describe(), p.total(),
                    to_string(p.dtype));
    std::vector<PeerMessage> sends, receives;
    for (int d : p.options.destinations) sends.push_back({input, d});
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < p.options.sources.size(); ++k) {
      receives.push_back({output.slice(offset, p.counts[k]), p.options.sources[k]});
      offset += p.counts[k];
    }
    neighbor_send_recv(*comm_, where(p.options.name), p.options.check_pattern, sends, receives);
  }

 private:
  std::string where(const std::string& name) const {
    return fmt::format("neighbor_allgather '{}' (rank {} of {})", name, comm_->rank(),
                       comm_->size());
  }

  // Every source's element count, each message {tag, dtype, numel}.
  std::vector<std::int64_t> exchange_counts(const NeighborAllgatherPlan& p,
                                            const NeighborAllgatherOptions& o) {
    std::int64_t mine[3] = {static_cast<std::int64_t>(p.tag), static_cast<std::int64_t>(p.dtype),
                            p.numel};
    std::vector<std::int64_t> theirs(3 * o.sources.size());
    std::vector<PeerMessage> sends, receives;
    for (int d : o.destinations) sends.push_back({TensorView{mine, 3, DType::kInt64}, d});
    for (std::size_t k = 0; k < o.sources.size(); ++k) {
      receives.push_back({TensorView{&theirs[3 * k], 3, DType::kInt64}, o.sources[k]});
    }
    neighbor_send_recv(*comm_, where(o.name), o.check_pattern, sends, receives);
    std::vector<std::int64_t> counts;
    for (std::size_t k = 0; k < o.sources.size(); ++k) {
      const std::int64_t* h = &theirs[3 * k];
      BAGUA_CHECK_ARG(h[0] == mine[0] && h[1] == mine[1],
                      "{}: rank {} sent a message of another call (tag {:x}, dtype #{}; this call: "
                      "tag {:x}, {}): the ranks' calls are out of order",
                      where(o.name), o.sources[k], static_cast<std::uint64_t>(h[0]), h[1], p.tag,
                      to_string(p.dtype));
      counts.push_back(h[2]);
    }
    return counts;
  }

  std::shared_ptr<Communicator> comm_;
  NeighborSequence sequence_;
};

}  // namespace bagua

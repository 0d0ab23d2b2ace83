// C_LP_S: centralized, low precision, synchronous (ByteGrad's primitive).
//
// Every rank ends with (approximately) the sum or average of the bucket over
// all ranks, moving about a quarter of C_FP_S's bytes for fp32. The paper's
// scatter-reduce, over the bucket cut into n chunks (the last ones may be
// shorter):
//   1. compress each of the n chunks (each with its own min and max), but
//      not chunk r: rank r reduces that one and adds its own copy exactly;
//   2. alltoall: rank r receives the n - 1 compressed copies of chunk r;
//   3. add them, decompressed, in rank order onto its own fp32 copy of chunk
//      r (in place in the bucket), divide by n when averaging;
//   4. compress the reduced chunk; allgather it;
//   5. decompress all n chunks into the bucket (chunk r too, so that every
//      rank ends with the same values).
// Skipping the own chunk's round trip saves 1/n of the first compression and
// of the decompressions in step 3, and removes one of the n quantization
// errors of each reduced chunk.
// Segments: a bucket longer than `segment_elements` (BAGUA_LOW_PRECISION_
// SEGMENT) is reduced as consecutive segments of that many elements, each
// with the steps above and its own n chunks, so a segment's result is the
// same as a bucket of that size would give. On the host the segments run as a
// pipeline: a TaskThread compresses segment k + 1 and decompresses segment
// k - 1 while this thread sends segment k, so on a slow link the passes over
// the bucket hide behind the bytes on the wire instead of adding to them.
// Error feedback keeps whole-bucket chunks: its residuals' layout is what a
// checkpoint holds.
// Hierarchical: a full-precision reduce to the node leader, the above among
// the leaders, a broadcast inside the node.
//
// Error feedback (optional): the worker keeps what compression lost from its
// input, e_w = v - Q^-1(Q(v)), and adds it to the next input; the server side
// does the same for the reduced chunk. Over T steps the errors telescope, so
// the sum of the outputs drifts from the exact sum by one step's error, not
// T steps'. (This is the paper's error feedback with the residuals' sign
// chosen so that they are added back; see docs/compression.md.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/compression/chunked_layout.h"
#include "bagua/compression/minmax_uint8_view.h"
#include "bagua/core/env.h"
#include "bagua/core/task_thread.h"
#include "bagua/ops/hierarchical_op.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/compute.h"

namespace bagua {

struct CentralizedLowPrecisionOptions {
  bool hierarchical = false;
  bool average = true;
  bool error_feedback = false;
  // Elements per segment (see above); 0: BAGUA_LOW_PRECISION_SEGMENT. Every
  // rank must use the same value: it fixes the layout of the messages.
  std::int64_t segment_elements = 0;
};

class CentralizedLowPrecisionOp final : public HierarchicalOp {
 public:
  CentralizedLowPrecisionOp(std::shared_ptr<Communicator> global,
                            std::shared_ptr<HierarchicalComms> hierarchy, DType dtype,
                            CentralizedLowPrecisionOptions options)
      : HierarchicalOp("C_LP_S", std::move(global), std::move(hierarchy), options.hierarchical),
        options_(options) {
    check_compressible(dtype, "C_LP_S (append_centralized_synchronous_op)");
    BAGUA_CHECK_ARG(options_.segment_elements >= 0,
                    "C_LP_S: segment_elements must be >= 0 (0: the environment's), got {}",
                    options_.segment_elements);
    if (options_.segment_elements == 0) options_.segment_elements = env().low_precision_segment;
  }

  // Segments of the host pipeline run so far (for tests and benchmarks).
  std::int64_t pipelined_segments() const { return pipelined_segments_; }

  std::string_view name() const override { return "centralized_low_precision"; }

  void execute(Bucket& bucket) override {
    for_flat_bucket(bucket, [&](const TensorView& data) {
      if (data.numel == 0) return;
      reduce_across(
          data, options_.average,
          [&](Communicator& comm, const TensorView& d, bool avg) {
            scatter_reduce(compute(), comm, d, avg);
          },
          /*shares=*/false);
    });
  }

  // Error feedback's residuals, for checkpoints: `server` picks the server
  // side (this rank's reduced chunk) over the worker side (the bucket's
  // padded fp32 copy). fp32 elements; 0 before the first execution, without
  // error feedback and on a hierarchical op's non-leaders. Call these only
  // while no execution is pending (the communication thread owns them then).
  std::int64_t residual_numel(bool server) const { return residual(server).numel; }

  // out = the residual (fp32, residual_numel elements, on the bucket's device).
  void copy_residual_to(bool server, const TensorView& out) {
    const Residual& r = residual(server);
    BAGUA_CHECK_ARG(out.dtype == DType::kFloat32 && out.numel == r.numel,
                    "C_LP_S: a residual is float32[{}], got {}", r.numel, out.describe());
    if (r.numel == 0) return;
    Compute& c = compute_on(out.device);
    c.copy(out.data, r.block.data(), out.nbytes());
    c.finish("C_LP_S residual copy", env().comm_timeout);
  }

  // The residual = values (fp32, on the bucket's device); 0 elements clear
  // it. The next execution adds it if the sizes match (the same bucket
  // layout and world size), else it restarts at zero.
  void set_residual(bool server, const TensorView& values) {
    BAGUA_CHECK_ARG(values.dtype == DType::kFloat32, "C_LP_S: a residual is float32, got {}",
                    values.describe());
    Residual& r = residual(server);
    r = Residual{};
    if (values.numel == 0) return;
    Compute& c = compute_on(values.device);
    r.block = c.scratch(values.nbytes());
    r.numel = values.numel;
    c.copy(r.block.data(), values.data, values.nbytes());
    c.finish("C_LP_S residual copy", env().comm_timeout);
  }

 private:
  // A residual kept across steps, on the bucket's device.
  struct Residual {
    CachingAllocator::Block block;
    std::int64_t numel = 0;
    TensorView view(const Compute& c) const { return c.view(block, numel, DType::kFloat32); }
  };

  Residual& residual(bool server) { return server ? server_error_ : worker_error_; }
  const Residual& residual(bool server) const { return server ? server_error_ : worker_error_; }

  // The bucket's segments (one without error feedback's residuals or when it
  // is short), pipelined where that can pay: on the host, fp32, 2+ segments.
  void scatter_reduce(Compute& c, Communicator& comm, const TensorView& data, bool average) {
    if (!segment_agreed_) {  // one rank's other segment would misalign every message after it
      comm.verify_same_call("C_LP_S: elements per segment (BAGUA_LOW_PRECISION_SEGMENT)",
                            TensorView{nullptr, options_.segment_elements, DType::kFloat32, {}});
      segment_agreed_ = true;
    }
    const std::int64_t segment =
        options_.error_feedback ? data.numel : std::min(options_.segment_elements, data.numel);
    if (segment == data.numel) {
      scatter_reduce_segment(c, comm, data, average);
    } else if (c.device().type == DeviceType::kCPU && data.dtype == DType::kFloat32) {
      pipelined_scatter_reduce(c, comm, data, average, segment);
    } else {
      for (std::int64_t begin = 0; begin < data.numel; begin += segment) {
        scatter_reduce_segment(c, comm, data.slice(begin, std::min(segment, data.numel - begin)),
                               average);
      }
    }
  }

  // Written once for host and device: every step is a Compute call (loops on
  // the host, kernels on the communication stream on a GPU), so on a GPU the
  // tensors are compressed before they reach the communicator and only the
  // compressed bytes are staged or sent.
  void scatter_reduce_segment(Compute& c, Communicator& comm, const TensorView& data,
                              bool average) {
    // Chunk j is elements [j * chunk, (j + 1) * chunk) of the bucket; the
    // last ones may be shorter or empty. Each has a slot of the full chunk's
    // compressed size in the exchanged buffers.
    const std::int64_t n = comm.size();
    const std::int64_t chunk = (data.numel + n - 1) / n;
    const std::int64_t my_count =
        std::clamp<std::int64_t>(data.numel - comm.rank() * chunk, 0, chunk);
    const std::size_t chunk_bytes = minmax_uint8::compressed_bytes(chunk);
    const std::size_t all_bytes = chunk_bytes * static_cast<std::size_t>(n);

    // fp32 buckets are compressed where they lie (the result overwrites them
    // anyway); 16-bit ones through an fp32 copy.
    const Float32Work work_copy = float32_work(c, data);
    const TensorView& work = work_copy.view;

    const auto outgoing = c.scratch(all_bytes);
    const auto incoming = c.scratch(all_bytes);
    compress_others_with_feedback(c, comm.rank(), work, chunk, bytes_of(outgoing));
    comm.alltoall(byte_view(c, outgoing, all_bytes), byte_view(c, incoming, all_bytes));

    // The own chunk, still exact in `work`, is the accumulator.
    const TensorView reduced = work.slice(std::min(comm.rank() * chunk, data.numel), my_count);
    add_others_copies(c, comm.rank(), n, bytes_of(incoming), chunk, reduced, average);

    const auto mine = c.scratch(chunk_bytes);
    compress_with_feedback(c, server_error_, reduced, chunk, bytes_of(mine));
    comm.allgather(byte_view(c, mine, chunk_bytes), byte_view(c, incoming, all_bytes));

    c.decompress(bytes_of(incoming), chunk, work, false);
    if (work_copy.is_copy()) c.convert(work, data);
  }

  // out = Q(values) in chunks of `chunk`, leaving chunk `own`'s slot
  // unwritten. With error feedback the worker residual is added to `values`
  // first, and afterwards keeps what compression lost: residual = values -
  // Q^-1(Q(values)), zero over the own chunk (it is not compressed).
  void compress_others_with_feedback(Compute& c, std::int64_t own, const TensorView& values,
                                     std::int64_t chunk, std::byte* out) {
    if (options_.error_feedback) add_residual(c, worker_error_, values);
    const std::int64_t own_begin = std::min(own * chunk, values.numel);
    const std::int64_t own_end = std::min(own_begin + chunk, values.numel);
    const std::size_t after_own =
        minmax_uint8::compressed_bytes(chunk) * static_cast<std::size_t>(own + 1);
    // The chunks before the own one, then those after it.
    const TensorView before = values.slice(0, own_begin);
    const TensorView after = values.slice(own_end, values.numel - own_end);
    if (before.numel > 0) c.compress(before, chunk, out);
    if (after.numel > 0) c.compress(after, chunk, out + after_own);
    if (!options_.error_feedback) return;
    const TensorView r = worker_error_.view(c);
    const TensorView r_own = r.slice(own_begin, own_end - own_begin);
    if (r_own.numel > 0) c.zero(r_own.data, r_own.nbytes());
    if (before.numel > 0) store_loss(c, out, chunk, before, r.slice(0, own_begin));
    if (after.numel > 0)
      store_loss(c, out + after_own, chunk, after, r.slice(own_end, after.numel));
  }

  // out = Q(values) in chunks of `chunk`. With error feedback the server
  // residual is added to `values` first and keeps what compression lost.
  void compress_with_feedback(Compute& c, Residual& residual, const TensorView& values,
                              std::int64_t chunk, std::byte* out) {
    if (options_.error_feedback) add_residual(c, residual, values);
    c.compress(values, chunk, out);
    if (options_.error_feedback) store_loss(c, out, chunk, values, residual.view(c));
  }

  // loss = values - Q^-1(compressed): what the compression of `values` lost.
  static void store_loss(Compute& c, const std::byte* compressed, std::int64_t chunk,
                         const TensorView& values, const TensorView& loss) {
    c.decompress(compressed, chunk, loss, false);
    c.axpby(1.0, values, -1.0, loss);
  }

  // values += residual (a residual of another size, e.g. after re-bucketing,
  // is dropped and restarts at zero).
  static void add_residual(Compute& c, Residual& residual, const TensorView& values) {
    if (residual.numel != values.numel || residual.block.data() == nullptr) {
      residual.block = c.scratch(values.nbytes());
      residual.numel = values.numel;
      c.zero(residual.block.data(), values.nbytes());
      return;
    }
    c.axpby(1.0, residual.view(c), 1.0, values);
  }

  // One segment of the host pipeline: its values (fp32, in the bucket) and
  // its slots in the exchanged buffers.
  struct Segment {
    TensorView values;
    std::int64_t chunk = 0;  // elements of each rank's chunk
    std::size_t chunk_bytes = 0;
    std::byte* outgoing = nullptr;  // n slots, the alltoall's
    std::byte* incoming = nullptr;  // n slots, the alltoall's, then the allgather's
    std::byte* mine = nullptr;      // 1 slot, the reduced own chunk
  };

  // scatter_reduce_segment over each segment of `data` (fp32 on the host,
  // no error feedback), the passes on a TaskThread, the messages here:
  //   communication: A0 A1 G0 A2 G1 ... A(K-1) G(K-2) G(K-1)
  //   task thread:   C0 C1 R0 C2 R1 D0 ... (C compress, R reduce, D decode)
  // Every rank sends in the same order; each pass waits only for the message
  // it needs, so segment k's passes run while k - 1 or k + 1 is on the wire.
  void pipelined_scatter_reduce(Compute& c, Communicator& comm, const TensorView& data,
                                bool average, std::int64_t segment) {
    const std::int64_t n = comm.size();
    const auto slots = static_cast<std::size_t>(n);
    const int rank = comm.rank();
    std::vector<Segment> segments;
    std::size_t slot_bytes = 0;
    for (std::int64_t begin = 0; begin < data.numel; begin += segment) {
      Segment s;
      s.values = data.slice(begin, std::min(segment, data.numel - begin));
      s.chunk = (s.values.numel + n - 1) / n;
      s.chunk_bytes = minmax_uint8::compressed_bytes(s.chunk);
      slot_bytes += s.chunk_bytes;
      segments.push_back(s);
    }
    // The blocks outlive the task thread (declared before it).
    const auto outgoing = c.scratch(slot_bytes * slots);
    const auto incoming = c.scratch(slot_bytes * slots);
    const auto mine = c.scratch(slot_bytes);
    std::size_t offset = 0;
    for (Segment& s : segments) {
      s.outgoing = bytes_of(outgoing) + offset * slots;
      s.incoming = bytes_of(incoming) + offset * slots;
      s.mine = bytes_of(mine) + offset;
      offset += s.chunk_bytes;
    }

    TaskThread passes;
    const auto timeout = env().comm_timeout;
    const auto segment_name = [&](std::size_t k) {
      return fmt::format("C_LP_S rank {} segment {} of {}", rank, k, segments.size());
    };
    const auto compress = [&](std::size_t k) {
      return passes.submit([&, k] {
        compress_others_with_feedback(c, rank, segments[k].values, segments[k].chunk,
                                      segments[k].outgoing);
      });
    };
    const auto alltoall = [&](std::size_t k, std::int64_t compressed) {
      passes.wait(compressed, timeout, segment_name(k));
      const Segment& s = segments[k];
      comm.alltoall(raw_bytes(c, s.outgoing, s.chunk_bytes * slots),
                    raw_bytes(c, s.incoming, s.chunk_bytes * slots));
      return passes.submit([&, k, average] { reduce_own_chunk(c, rank, n, segments[k], average); });
    };
    const auto allgather = [&](std::size_t k, std::int64_t reduced) {
      passes.wait(reduced, timeout, segment_name(k));
      const Segment& s = segments[k];
      comm.allgather(raw_bytes(c, s.mine, s.chunk_bytes),
                     raw_bytes(c, s.incoming, s.chunk_bytes * slots));
      return passes.submit([&, k] {
        c.decompress(segments[k].incoming, segments[k].chunk, segments[k].values, false);
      });
    };

    std::int64_t next_compressed = compress(0);
    std::int64_t previous_reduced = -1;
    std::int64_t last_decoded = -1;
    for (std::size_t k = 0; k < segments.size(); ++k) {
      const std::int64_t compressed = next_compressed;
      if (k + 1 < segments.size()) next_compressed = compress(k + 1);
      const std::int64_t reduced = alltoall(k, compressed);
      if (k > 0) last_decoded = allgather(k - 1, previous_reduced);
      previous_reduced = reduced;
    }
    last_decoded = allgather(segments.size() - 1, previous_reduced);
    passes.wait(last_decoded, timeout, segment_name(segments.size() - 1));
    pipelined_segments_ += static_cast<std::int64_t>(segments.size());
  }

  // Segment s's step 3 on this rank: the others' copies of its own chunk,
  // decompressed in rank order onto its exact copy, averaged, compressed.
  static void reduce_own_chunk(Compute& c, int rank, std::int64_t n, const Segment& s,
                               bool average) {
    const std::int64_t begin = std::min(rank * s.chunk, s.values.numel);
    const TensorView reduced = s.values.slice(begin, std::min(s.chunk, s.values.numel - begin));
    add_others_copies(c, rank, n, s.incoming, s.chunk, reduced, average);
    c.compress(reduced, s.chunk, s.mine);
  }

  // Step 3's sum: the other ranks' copies of this rank's chunk (n slots of
  // `chunk` elements compressed, in `incoming`), decompressed in rank order
  // onto `reduced`, the exact own copy; then divided by n when averaging.
  static void add_others_copies(Compute& c, int rank, std::int64_t n, const std::byte* incoming,
                                std::int64_t chunk, const TensorView& reduced, bool average) {
    const std::size_t chunk_bytes = minmax_uint8::compressed_bytes(chunk);
    for (std::int64_t j = 0; j < n; ++j) {
      if (j == rank) continue;
      c.decompress(incoming + static_cast<std::size_t>(j) * chunk_bytes, chunk, reduced, true);
    }
    if (average) c.divide(reduced, n);
  }

  static TensorView raw_bytes(const Compute& c, std::byte* data, std::size_t bytes) {
    return TensorView{data, static_cast<std::int64_t>(bytes), DType::kUInt8, c.device()};
  }

  CentralizedLowPrecisionOptions options_;
  Residual worker_error_;
  Residual server_error_;
  std::int64_t pipelined_segments_ = 0;
  bool segment_agreed_ = false;  // checked across the ranks on the first execution
};

}  // namespace bagua

// One executing GPU's share of an operation whose ranks are all on this
// node (LocalPath, engine/gpu/local_path.h): reduction kernels, copy kernels
// and copy engines over the peer mappings (engine/gpu/kernels.cu). Made,
// enqueued and dropped under the executor's lock; it holds references only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/gpu/executor.h"

namespace collectived::engine::gpu {

class KernelShare {
 public:
  /// GPU exec[i]'s share of `op` on `stream`, of step `step` (0 or 1) where
  /// the operation takes two (a broadcast over gpu.two_step_min_gpus GPUs or
  /// more), else -1. `sms`: that GPU's multiprocessors.
  KernelShare(const GpuCollective& op, const std::vector<int>& rank_dev,
              const std::vector<int>& exec, std::size_t i, cudaStream_t stream, int step, int sms,
              std::uint64_t copy_engine_min_bytes);
  void enqueue();

 private:
  /// A copy of `bytes` from `src` to `dst` (device addresses of the executing GPU).
  struct CopyPart {
    const std::byte* src;
    std::byte* dst;
    std::uint64_t bytes;
  };
  // Copies of rank `from`'s bytes into rank `to`'s buffer; `peer` when the
  // two lie on different GPUs (the bytes cross NVLink).
  struct Copy {
    const std::byte* src;
    std::byte* dst;
    bool peer;
  };

  // Element range [lo, hi) of `total` this GPU computes (split: equal shares
  // on 256-element boundaries, so that 16-byte vectors stay aligned).
  std::pair<std::uint64_t, std::uint64_t> share(std::uint64_t total) const;
  // Copies: split GPUs write their own ranks' outputs (reading peers over NVLink).
  bool mine(int r) const { return !split || rank_dev[r] == dev; }
  void reduce(std::vector<const std::byte*> srcs, std::vector<std::byte*> dsts, std::uint64_t count,
              bool whole = false) const;
  void copy(int from, int to, const std::byte* src, std::byte* dst);

  void all_reduce();
  void reduce_at_root();
  void reduce_scatter();
  void all_gather();
  void broadcast();
  void all_to_all();
  void p2p();
  /// One step of a broadcast split over k >= 3 GPUs. The root's bytes are cut
  /// into k chunks, chunk c for GPU exec[c]. Step 0: every other GPU pulls its
  /// chunk from the root into its first rank's output (a copy engine).
  /// Step 1, after every GPU's step 0: each GPU's ranks read every chunk from
  /// where it now lies (the root's input, or the first rank's output of that
  /// chunk's GPU), with one copy kernel reading several GPUs at once. The
  /// root GPU's links carry 2 (k - 1) / k of the bytes where every GPU pulling
  /// the whole buffer from the root made them carry k - 1 times the bytes
  /// (on 4 H200, a third of NCCL's broadcast bandwidth).
  void broadcast_step();
  /// The copies collected (pairs), on the copy engines or as kernels.
  void launch();
  /// The copy kernels for `parts` (destinations disjoint): one launch per
  /// length and kMaxKernelPointers pairs.
  static void launch_copies(std::vector<CopyPart> parts, int blocks, cudaStream_t stream,
                            const char* what);

  // The operation and where this share runs (names as the bodies use them).
  const GpuCollective& op;
  const std::vector<int>& rank_dev;
  const std::vector<int>& exec;
  const std::size_t i;
  const cudaStream_t stream;
  const int step;
  const std::uint64_t copy_engine_min_bytes_;
  const int n;
  const int dev;
  const int blocks;
  const std::uint64_t es;
  const bool split;
  const std::uint64_t one;
  // Every span as this GPU addresses it.
  std::vector<std::byte*> send, recv;
  std::vector<Copy> pairs;
  // Copies that go to this GPU's copy engines whatever else it does, each
  // with its own length (a broadcast's halves).
  std::vector<CopyPart> engine_parts;
};

}  // namespace collectived::engine::gpu

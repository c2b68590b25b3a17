// Host memory through which the client library stages a communicator's GPU
// collectives across nodes (GpuSync.clientStaged): the caller's stream copies
// the input into it and marks it ready, the daemon runs the exchange between
// nodes on it, and the stream copies the output back once the daemon's done
// word is written. No daemon stream and no hand-off between processes' streams
// stand between the rank's producer and the exchange.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/gpu/cuda_driver.h"

typedef struct collective_client collective_client_t;

namespace collectived::client {

// The CUDA driver loader (engine/gpu/cuda_driver.h), a leaf library the client links.
namespace gpu = engine::gpu;

/// One communicator's staging: two blocks of host memory shared with the
/// daemon (collective_host_alloc: a sealed memfd both map) and registered
/// with CUDA, taken in turns by consecutive operations. A block is replaced
/// by a larger one when an operation needs more (the old one is kept until
/// the communicator goes: the GPU may still copy out of it). Used under the
/// client's gpu_mutex.
///
/// Why two: the daemon may start an operation's exchange (and receive into
/// its output staging) before the caller's stream reached it, once the
/// communicator's previous operation ended there, that is once the previous
/// operation's input was all in. Every operation's stream work waits for the
/// copies out of the operation before it (both blocks' events), so the
/// previous operation's input being in means the stream copied out of the
/// block before it, which is the block this operation takes.
class ClientStaging {
 public:
  ClientStaging(collective_client_t* client, std::shared_ptr<const gpu::CudaDriver> cu);
  /// Waits for the GPU's last copies out of the blocks, then frees them.
  ~ClientStaging();
  ClientStaging(const ClientStaging&) = delete;
  ClientStaging& operator=(const ClientStaging&) = delete;

  /// Host buffers of one operation, in the daemon's registration `handle`.
  struct Lease {
    std::uint64_t handle = 0;
    std::uint64_t send_offset = 0, recv_offset = 0;
    std::byte* send = nullptr;
    std::byte* recv = nullptr;
    /// The same memory as the GPU addresses it (kernels).
    gpu::cu::DevicePtr send_dev = 0, recv_dev = 0;
  };
  /// Buffers for `send_bytes` of input and `recv_bytes` of output (one
  /// buffer for both where `one`, the input `send_at` bytes into the output:
  /// the host collective then runs in place). Makes `stream` wait until the
  /// previous operations have copied their outputs out (stream-ordered: the
  /// CPU never waits). The stream's context is current.
  Lease take(std::uint64_t send_bytes, std::uint64_t recv_bytes, bool one, gpu::cu::Stream stream,
             std::uint64_t send_at = 0);

  /// Inputs and outputs up to this many bytes are moved by the staging
  /// kernels (client/direct_kernels.cu) rather than by a copy engine and a
  /// flag operation each: one kernel launch in place of two stream
  /// operations per direction.
  static constexpr std::uint64_t kKernelMaxBytes = 64 << 10;
  /// The staging kernels, loaded in one context (client/gpu.cc,
  /// gpu_comm_created).
  struct Kernels {
    gpu::cu::Function in = nullptr, out = nullptr;
    /// collectived_stage_reduce; null: an older fatbin (not offered then).
    gpu::cu::Function reduce = nullptr;
  };
  /// On `stream`: copies `bytes` at `src` into the lease's input, then
  /// writes `value` to the ready word at `ready`.
  void kernel_in(const Kernels& k, gpu::cu::Stream stream, gpu::cu::DevicePtr src, const Lease& l,
                 std::uint64_t bytes, gpu::cu::DevicePtr ready, std::uint32_t value);
  /// On `stream`: copies `bytes` of the lease's output to `dst` (after the
  /// stream's wait for the done word).
  void kernel_out(const Kernels& k, gpu::cu::Stream stream, const Lease& l, gpu::cu::DevicePtr dst,
                  std::uint64_t bytes);

  /// On `stream`: `out`[i] = the two nodes' contributions combined as the
  /// host combines them (node 0's first; avg: the sum stored, then divided by
  /// `nranks`) for `count` elements, from this rank's own at `own` (GPU) and
  /// the other node's at `host` (the staging as the GPU addresses it). `out`
  /// may be `own`.
  void kernel_reduce(const Kernels& k, gpu::cu::Stream stream, gpu::cu::DevicePtr own,
                     gpu::cu::DevicePtr host, gpu::cu::DevicePtr out, std::uint64_t count,
                     int dtype, int redop, std::uint32_t nranks, bool own_first);

  /// The operation's copies out are enqueued on `stream`: the block may be
  /// reused after them.
  void release(gpu::cu::Stream stream);

 private:
  struct Block {
    std::byte* host = nullptr;
    std::uint64_t bytes = 0;
    std::uint64_t handle = 0, offset = 0;  // the daemon's registration of `host`
    gpu::cu::DevicePtr dev = 0;            // `host` as the GPU addresses it
    gpu::cu::Event used = nullptr;         // recorded after the last operation's copies out
    gpu::cu::Context ctx = nullptr;
    bool registered = false;  // with CUDA
    bool recorded = false;    // `used` was recorded
  };
  void allocate(std::uint64_t bytes, Block& b);
  void free_block(Block& b) noexcept;

  collective_client_t* client_;
  std::shared_ptr<const gpu::CudaDriver> cu_;
  Block blocks_[2];
  int turn_ = 0;  // the block the next operation takes
  std::vector<Block> retired_;
};

}  // namespace collectived::client

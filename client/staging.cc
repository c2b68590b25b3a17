#include "client/staging.h"

#include <algorithm>
#include <string>

#include "client/client_internal.h"

namespace collectived::client {

namespace cu = collectived::engine::gpu::cu;
using collectived::engine::gpu::ScopedContext;

namespace {
// Blocks grow in whole MiB, at least doubling: a few allocations (each a
// memfd, a daemon registration and a cuMemHostRegister, ~1 ms for 8 MiB) for
// a run of growing sizes.
constexpr std::uint64_t kUnit = std::uint64_t{1} << 20;
constexpr std::uint64_t kAlign = 64;

std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }
}  // namespace

ClientStaging::ClientStaging(collective_client_t* client, std::shared_ptr<const gpu::CudaDriver> cu)
    : client_(client), cu_(std::move(cu)) {}

ClientStaging::~ClientStaging() {
  for (Block& b : blocks_) free_block(b);
  for (Block& b : retired_) free_block(b);
}

void ClientStaging::allocate(std::uint64_t bytes, Block& b) {
  const gpu::CudaDriver& cu = *cu_;
  void* p = nullptr;
  if (collective_host_alloc(client_, bytes, &p) != COLLECTIVE_OK) {
    throw Error(Code::resource_exhausted, std::string("host staging of ") + std::to_string(bytes) +
                                              " bytes: " + collective_last_error());
  }
  b.host = static_cast<std::byte*>(p);
  b.bytes = bytes;
  try {
    auto [h, o] = client_->locate(p, bytes, "staging");
    b.handle = h;
    b.offset = o;
    // Pinned for the copy engines: the stream's copies then run
    // asynchronously at full speed (pageable memory would be copied through
    // the driver's own bounce buffers, synchronously). Mapped for the
    // staging kernels, which read and write it over PCIe.
    cu.check(cu.cuMemHostRegister(p, bytes,
                                  cu::kMemHostRegisterPortable | cu::kMemHostRegisterDeviceMap),
             "cuMemHostRegister of " + std::to_string(bytes) + " bytes of host staging");
    b.registered = true;
    cu.check(cu.cuMemHostGetDevicePointer(&b.dev, p, 0),
             "cuMemHostGetDevicePointer (host staging)");
    cu.check(cu.cuCtxGetCurrent(&b.ctx), "cuCtxGetCurrent");
    cu.check(cu.cuEventCreate(&b.used, cu::kEventDisableTiming), "cuEventCreate (staging)");
  } catch (...) {
    free_block(b);
    throw;
  }
}

void ClientStaging::free_block(Block& b) noexcept {
  if (b.host == nullptr) return;
  const gpu::CudaDriver& cu = *cu_;
  try {
    ScopedContext scope(cu, b.ctx);
    if (b.used != nullptr) {
      // The stream's last copies out of the block must be done before the
      // memory goes (a communicator is destroyed once its operations are
      // answered, which their streams may not have reached yet).
      cu.cuEventSynchronize(b.used);
      cu.cuEventDestroy(b.used);
    }
    if (b.registered) cu.cuMemHostUnregister(b.host);
  } catch (const Error&) {
    // The context is gone (the process is tearing CUDA down): so is the GPU's use of the block.
  }
  collective_host_free(client_, b.host);
  b = Block{};
}

ClientStaging::Lease ClientStaging::take(std::uint64_t send_bytes, std::uint64_t recv_bytes,
                                         bool one, cu::Stream stream, std::uint64_t send_at) {
  const gpu::CudaDriver& cu = *cu_;
  if (!one) send_at = 0;
  const std::uint64_t recv_at = one ? 0 : round_up(send_bytes, kAlign);
  const std::uint64_t need = std::max<std::uint64_t>(
      1, one ? std::max(send_at + send_bytes, recv_bytes) : recv_at + recv_bytes);
  // The copies out of the previous operations come first: of this block's
  // (its memory is reused) and of the other's (see the class comment).
  // Nothing to wait for on one stream, where they are before anyway.
  for (Block& b : blocks_) {
    if (b.host != nullptr && b.recorded) {
      cu.check(cu.cuStreamWaitEvent(stream, b.used, 0), "cuStreamWaitEvent (host staging)");
    }
  }
  Block& cur = blocks_[turn_];
  if (cur.bytes < need) {
    Block b;
    allocate(std::max(round_up(need, kUnit), 2 * cur.bytes), b);
    // The old block's last copies may still be queued: it goes with the
    // communicator.
    if (cur.host != nullptr) retired_.push_back(cur);
    cur = b;
  }
  Lease l;
  l.handle = cur.handle;
  l.send_offset = cur.offset + send_at;
  l.recv_offset = cur.offset + recv_at;
  l.send = cur.host + send_at;
  l.recv = cur.host + recv_at;
  l.send_dev = cur.dev + send_at;
  l.recv_dev = cur.dev + recv_at;
  return l;
}

void ClientStaging::release(cu::Stream stream) {
  const gpu::CudaDriver& cu = *cu_;
  Block& cur = blocks_[turn_];
  cu.check(cu.cuEventRecord(cur.used, stream), "cuEventRecord (host staging)");
  cur.recorded = true;
  turn_ ^= 1;
}

void ClientStaging::kernel_in(const Kernels& k, cu::Stream stream, cu::DevicePtr src,
                              const Lease& l, std::uint64_t bytes, cu::DevicePtr ready,
                              std::uint32_t value) {
  unsigned long long n = bytes;
  cu::DevicePtr dst = l.send_dev;
  void* params[] = {&src, &dst, &n, &ready, &value};
  // One block (the ready word follows every thread's stores).
  cu_->check(cu_->cuLaunchKernel(k.in, 1, 1, 1, 512, 1, 1, 0, stream, params, nullptr),
             "cuLaunchKernel (staging the input)");
}

void ClientStaging::kernel_out(const Kernels& k, cu::Stream stream, const Lease& l,
                               cu::DevicePtr dst, std::uint64_t bytes) {
  unsigned long long n = bytes;
  cu::DevicePtr src = l.recv_dev;
  void* params[] = {&src, &dst, &n};
  // Reads from host memory wait a PCIe round trip each: several blocks keep
  // more of them in flight (8 KiB each, at most 8).
  const auto grid = static_cast<unsigned>(std::clamp<std::uint64_t>((bytes + 8191) / 8192, 1, 8));
  cu_->check(cu_->cuLaunchKernel(k.out, grid, 1, 1, 512, 1, 1, 0, stream, params, nullptr),
             "cuLaunchKernel (staging the output)");
}

void ClientStaging::kernel_reduce(const Kernels& k, cu::Stream stream, cu::DevicePtr own,
                                  cu::DevicePtr host, cu::DevicePtr out, std::uint64_t count,
                                  int dtype, int redop, std::uint32_t nranks, bool own_first) {
  unsigned long long n = count;
  int own_first_i = own_first ? 1 : 0;
  void* params[] = {&own, &host, &out, &n, &dtype, &redop, &nranks, &own_first_i};
  // Reads from host memory wait a PCIe round trip each: many blocks keep
  // many in flight (16 bytes per thread and pass).
  const std::uint64_t bytes = count * collective_dtype_size(static_cast<collective_dtype_t>(dtype));
  const auto grid =
      static_cast<unsigned>(std::clamp<std::uint64_t>((bytes + 4095) / 4096, 1, 1024));
  cu_->check(cu_->cuLaunchKernel(k.reduce, grid, 1, 1, 256, 1, 1, 0, stream, params, nullptr),
             "cuLaunchKernel (combining the reduce-scatter's own segment)");
}

}  // namespace collectived::client

#include "engine/gpu/kernel_share.h"

#include <algorithm>
#include <array>
#include <string>

#include "engine/gpu/cuda_check.h"
#include "engine/gpu/kernels.h"

namespace collectived::engine::gpu {

using kernels::CopyLaunch;
using kernels::kMaxKernelPointers;
using kernels::ReduceLaunch;

KernelShare::KernelShare(const GpuCollective& op_, const std::vector<int>& rank_dev_,
                         const std::vector<int>& exec_, std::size_t i_, cudaStream_t stream_,
                         int step_, int sms, std::uint64_t copy_engine_min_bytes)
    : op(op_),
      rank_dev(rank_dev_),
      exec(exec_),
      i(i_),
      stream(stream_),
      step(step_),
      copy_engine_min_bytes_(copy_engine_min_bytes),
      n(static_cast<int>(op_.send.size())),
      dev(exec_[i_]),
      blocks(sms * 4),
      es(dtype_size(op_.dtype)),
      split(exec_.size() > 1),
      one(op_.count * dtype_size(op_.dtype)),
      send(n, nullptr),
      recv(n, nullptr) {
  for (int r = 0; r < n; ++r) {
    send[r] = on_device(op.send[r], dev);
    recv[r] = on_device(op.recv[r], dev);
  }
}

void KernelShare::enqueue() {
  switch (op.kind) {
    case OpKind::all_reduce:
      all_reduce();
      break;
    case OpKind::reduce:
      reduce_at_root();
      break;
    case OpKind::reduce_scatter:
      reduce_scatter();
      break;
    case OpKind::all_gather:
      all_gather();
      break;
    case OpKind::broadcast:
      if (step >= 0) {
        broadcast_step();
        return;
      }
      broadcast();
      break;
    case OpKind::all_to_all:
      all_to_all();
      break;
    case OpKind::p2p:
      p2p();
      break;
    default:
      throw Error(Code::invalid_argument,
                  std::string(to_string(op.kind)) + " does not run on GPU buffers");
  }
  launch();
}

std::pair<std::uint64_t, std::uint64_t> KernelShare::share(std::uint64_t total) const {
  if (!split) return std::pair<std::uint64_t, std::uint64_t>{0, total};
  const std::uint64_t unit = 256;
  const std::uint64_t units = (total + unit - 1) / unit;
  const std::uint64_t per = (units + exec.size() - 1) / exec.size();
  const std::uint64_t lo = std::min(total, per * unit * i);
  const std::uint64_t hi = std::min(total, per * unit * (i + 1));
  return std::pair{lo, hi};
}

void KernelShare::reduce(std::vector<const std::byte*> srcs, std::vector<std::byte*> dsts,
                         std::uint64_t count, bool whole) const {
  auto [lo, hi] = whole ? std::pair<std::uint64_t, std::uint64_t>{0, count} : share(count);
  if (hi <= lo) return;
  ReduceLaunch a{};
  a.nsrc = static_cast<int>(srcs.size());
  a.ndst = static_cast<int>(dsts.size());
  if (a.nsrc > kMaxKernelPointers || a.ndst > kMaxKernelPointers) {
    throw Error(Code::invalid_argument, "more than 64 ranks in a GPU collective");
  }
  for (int s = 0; s < a.nsrc; ++s) a.src[s] = srcs[s] + lo * es;
  for (int d = 0; d < a.ndst; ++d) a.dst[d] = dsts[d] + lo * es;
  a.count = hi - lo;
  a.avg_divisor = static_cast<std::uint32_t>(n);
  check_rt(kernels::launch_reduce(static_cast<kernels::DType>(op.dtype),
                                  static_cast<kernels::RedOp>(op.redop), a, blocks, stream),
           "reduction kernel");
}

void KernelShare::copy(int from, int to, const std::byte* src, std::byte* dst) {
  pairs.push_back({src, dst, rank_dev[from] != rank_dev[to]});
}

void KernelShare::all_reduce() {
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  for (int r = 0; r < n; ++r) {
    srcs.push_back(send[r]);
    dsts.push_back(recv[r]);
  }
  reduce(srcs, dsts, op.count);
}

void KernelShare::reduce_at_root() {
  // The root's GPU pulls every input and writes locally.
  if (!mine(op.root)) return;
  std::vector<const std::byte*> srcs;
  for (int r = 0; r < n; ++r) srcs.push_back(send[r]);
  reduce(srcs, {recv[op.root]}, op.count, /*whole=*/true);
}

void KernelShare::reduce_scatter() {
  // Rank j's chunk is computed by rank j's GPU (pulling the inputs over
  // NVLink, writing locally); in place (recv == send + j*count) each
  // element is read from every source before it is written.
  for (int j = 0; j < n; ++j) {
    if (!mine(j)) continue;
    std::vector<const std::byte*> srcs;
    for (int r = 0; r < n; ++r) srcs.push_back(send[r] + j * one);
    reduce(srcs, {recv[j]}, op.count, /*whole=*/true);
  }
}

void KernelShare::all_gather() {
  for (int r = 0; r < n; ++r) {
    if (!mine(r)) continue;
    for (int j = 0; j < n; ++j) {
      std::byte* dst = recv[r] + j * one;
      if (dst != send[j]) copy(j, r, send[j], dst);
    }
  }
}

void KernelShare::broadcast() {
  // Two GPUs, split, large, and nothing to copy inside the root's GPU
  // (in place at the root, as PyTorch's broadcast is): the other GPU
  // pulls the first half of the root's bytes and the root's GPU pushes
  // the second half, each on its own copy engine: two DMA engines on the
  // one NVLink direction, faster than the pull alone (most at 16-64
  // MiB). With a copy inside the root's GPU the push would queue behind
  // it on the same stream, so then the other GPU pulls it all
  // (docs/gpu.md, "Measurements").
  bool root_gpu_idle = true;
  for (int r = 0; r < n; ++r) {
    if (rank_dev[r] == rank_dev[op.root] && recv[r] != send[op.root]) root_gpu_idle = false;
  }
  const bool halves = split && exec.size() == 2 && root_gpu_idle && copy_engine_min_bytes_ != 0 &&
                      one >= copy_engine_min_bytes_;
  const std::uint64_t half = (one / 2) & ~std::uint64_t{4095};
  for (int r = 0; r < n; ++r) {
    const bool other_gpu = rank_dev[r] != rank_dev[op.root];
    if (halves && other_gpu) {
      if (mine(r)) engine_parts.push_back({send[op.root], recv[r], half});
      if (dev == rank_dev[op.root])
        engine_parts.push_back({send[op.root] + half, recv[r] + half, one - half});
      continue;
    }
    if (!mine(r)) continue;
    if (recv[r] != send[op.root]) copy(op.root, r, send[op.root], recv[r]);
  }
}

void KernelShare::all_to_all() {
  bool in_place = false;
  for (int r = 0; r < n; ++r) in_place = in_place || (send[r] != nullptr && send[r] == recv[r]);
  if (!in_place) {
    for (int r = 0; r < n; ++r) {
      if (!mine(r)) continue;
      for (int j = 0; j < n; ++j) {
        copy(j, r, send[j] + r * one, recv[r] + j * one);
      }
    }
    return;
  }
  // In place (on some ranks at least): the block a sends to b and the
  // block b sends to a are moved together (each element of both read
  // before either is written), by rank a's GPU for a <= b: a block's
  // destination is the other block's source where a rank is in place.
  std::vector<std::array<std::byte*, 4>> swaps;  // src_a, dst_a, src_b, dst_b
  for (int a = 0; a < n; ++a) {
    if (!mine(a)) continue;
    for (int b = a; b < n; ++b) {
      swaps.push_back({send[a] + b * one, recv[b] + a * one, send[b] + a * one, recv[a] + b * one});
    }
  }
  constexpr int kMax = kernels::ExchangeLaunch::kMax;
  for (std::size_t k = 0; k < swaps.size(); k += kMax) {
    kernels::ExchangeLaunch x{};
    x.n = static_cast<int>(std::min<std::size_t>(kMax, swaps.size() - k));
    for (int y = 0; y < x.n; ++y) {
      x.src_a[y] = swaps[k + y][0];
      x.dst_a[y] = swaps[k + y][1];
      x.src_b[y] = swaps[k + y][2];
      x.dst_b[y] = swaps[k + y][3];
    }
    x.bytes = one;
    check_rt(kernels::launch_exchange(x, blocks, stream), "exchange kernel (in-place all_to_all)");
  }
}

void KernelShare::p2p() {
  // A matched send (rank 0's send) and receive (rank 1's recv).
  if (n == 2 && one != 0 && send[0] != nullptr && recv[1] != nullptr && send[0] != recv[1]) {
    copy(0, 1, send[0], recv[1]);
  }
}

void KernelShare::broadcast_step() {
  const int root_dev = rank_dev[op.root];
  const std::uint64_t k = exec.size();
  // Page multiples: every chunk starts 16-byte aligned for the copy kernel.
  const std::uint64_t per = ((one + k - 1) / k + 4095) & ~std::uint64_t{4095};
  auto len = [&](std::size_t c) -> std::uint64_t {
    const std::uint64_t at = c * per;
    return at >= one ? 0 : std::min(per, one - at);
  };
  // Where chunk c lies after step 0: the root's input, or the output of
  // the first rank on GPU exec[c].
  std::vector<int> first(k, -1);
  for (int r = n - 1; r >= 0; --r) {
    const auto at = std::find(exec.begin(), exec.end(), rank_dev[r]);
    if (at != exec.end()) first[static_cast<std::size_t>(at - exec.begin())] = r;
  }
  if (step == 0) {
    if (dev != root_dev && len(i) != 0) {
      check_rt(cudaMemcpyAsync(recv[first[i]] + i * per, send[op.root] + i * per, len(i),
                               cudaMemcpyDefault, stream),
               "cudaMemcpyAsync (broadcast, chunk " + std::to_string(i) + " from the root's GPU)");
    }
    return;
  }
  std::vector<CopyPart> parts;
  for (int r = 0; r < n; ++r) {
    if (rank_dev[r] != dev) continue;
    if (dev == root_dev) {
      if (recv[r] != send[op.root]) parts.push_back({send[op.root], recv[r], one});
      continue;
    }
    for (std::size_t c = 0; c < k; ++c) {
      if (len(c) == 0 || (c == i && r == first[i])) continue;
      const std::byte* from = exec[c] == root_dev ? send[op.root] : recv[first[c]];
      parts.push_back({from + c * per, recv[r] + c * per, len(c)});
    }
  }
  launch_copies(std::move(parts), blocks, stream, "copy kernel (broadcast, second step)");
}

void KernelShare::launch() {
  // Large copies between GPUs go to the copy engines when this GPU's share
  // is only such copies: a DMA over NVLink needs no SMs and moves more per
  // second than the copy kernel over the peer mapping from 16 MiB. A share
  // that also copies inside the GPU keeps the one kernel: on the same stream
  // the copy engine and the kernel run one after the other, where the kernel
  // overlaps both (docs/gpu.md, "Measurements").
  const bool engines =
      copy_engine_min_bytes_ != 0 && one >= copy_engine_min_bytes_ &&
      std::all_of(pairs.begin(), pairs.end(), [](const Copy& c) { return c.peer; });
  std::vector<CopyPart> kernel_parts;
  for (const Copy& c : pairs)
    (engines ? engine_parts : kernel_parts).push_back({c.src, c.dst, one});
  for (const CopyPart& c : engine_parts) {
    check_rt(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
             "cudaMemcpyAsync between GPUs (copy engine)");
  }
  launch_copies(std::move(kernel_parts), blocks, stream, "copy kernel");
}

void KernelShare::launch_copies(std::vector<CopyPart> parts, int blocks, cudaStream_t stream,
                                const char* what) {
  std::stable_sort(parts.begin(), parts.end(),
                   [](const CopyPart& a, const CopyPart& b) { return a.bytes < b.bytes; });
  for (std::size_t k = 0; k < parts.size();) {
    CopyLaunch c{};
    c.bytes = parts[k].bytes;
    while (k < parts.size() && parts[k].bytes == c.bytes && c.n < kMaxKernelPointers) {
      c.src[c.n] = parts[k].src;
      c.dst[c.n] = parts[k].dst;
      ++c.n;
      ++k;
    }
    check_rt(kernels::launch_copy(c, blocks, stream), what);
  }
}

}  // namespace collectived::engine::gpu

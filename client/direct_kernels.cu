// The kernels libcollective launches on the caller's stream (client/direct.cc)
// for a communicator whose ranks each own one GPU of one node: all-reduce,
// reduce-scatter, all-gather and broadcast through the ranks' scratch
// allocations, mapped in every rank's process over NVLink (protocol in
// client/direct_abi.h). Built into a fatbin that libcollective carries and
// loads with cuModuleLoadData: the library links no CUDA runtime.
//
// Data moves by stores to the peers' memory (posted writes over NVLink, no
// round trip per load) and is then read locally; the reductions keep
// engine/reduce.h's order and rounding (engine/gpu/reduce_ops.cuh), so the
// results equal the daemon's and the host's bit for bit.
#include "client/direct_abi.h"
#include "engine/gpu/reduce_ops.cuh"

namespace collectived::client::direct {
namespace {

using engine::gpu::kernels::combine;
using engine::gpu::kernels::DType;
using engine::gpu::kernels::finish;
using engine::gpu::kernels::Pack;
using engine::gpu::kernels::RedOp;
using engine::gpu::kernels::Traits;
using u64 = unsigned long long;

// Blocks split the data at multiples of this many bytes, so that no two
// blocks share a cache line of the scratch: a block reads its lines only
// after its own peers' flags said they are written.
constexpr u64 kPartBytes = 256;

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void store_release(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0;
}

struct Range {
  u64 lo, hi;
};

/// This block's part of [0, n) units, cut at multiples of `unit`.
__device__ __forceinline__ Range part(u64 n, u64 unit) {
  const u64 g = gridDim.x;
  u64 per = (n + g - 1) / g;
  per = (per + unit - 1) / unit * unit;
  const u64 lo = min(n, static_cast<u64>(blockIdx.x) * per);
  return Range{lo, min(n, lo + per)};
}

/// Copies bytes [lo, hi) of src to each of dst[0..ndst) (lo a multiple of 16).
__device__ void copy_part(const char* src, char* const* dst, int ndst, u64 lo, u64 hi) {
  if (ndst == 0 || hi <= lo) return;
  bool vec = aligned16(src);
  for (int d = 0; d < ndst; ++d) vec = vec && aligned16(dst[d]);
  u64 done = lo;
  if (vec) {
    const u64 n16 = (hi - lo) / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src + lo);
    for (u64 k = threadIdx.x; k < n16; k += blockDim.x) {
      const uint4 v = s[k];
      for (int d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dst[d] + lo)[k] = v;
    }
    done = lo + n16 * 16;
  }
  for (u64 k = done + threadIdx.x; k < hi; k += blockDim.x) {
    const char v = src[k];
    for (int d = 0; d < ndst; ++d) dst[d][k] = v;
  }
}

/// dst[d][i] = op(src[0][i], ..., src[n-1][i]) for i in [lo, hi) and every
/// d < ndst (lo a multiple of 16 bytes' worth of elements). Every source
/// element is read before its destinations are written (in place is fine).
template <typename T, RedOp O>
__device__ void reduce_part(const T* const* src, int n, T* const* dst, int ndst, u64 lo, u64 hi,
                            unsigned divisor) {
  using Acc = typename Traits<T>::Acc;
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  if (hi <= lo) return;
  bool vec = true;
  for (int d = 0; d < ndst; ++d) vec = vec && aligned16(dst[d]);
  for (int s = 0; s < n; ++s) vec = vec && aligned16(src[s]);
  u64 done = lo;
  if (vec) {
    const u64 packs = (hi - lo) / V;
    for (u64 k = threadIdx.x; k < packs; k += blockDim.x) {
      const u64 i = lo / V + k;
      Acc acc[V];
      {
        const P p = reinterpret_cast<const P*>(src[0])[i];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = Traits<T>::load(p.v[j]);
      }
      for (int s = 1; s < n; ++s) {
        const P p = reinterpret_cast<const P*>(src[s])[i];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = combine<T, O>(acc[j], Traits<T>::load(p.v[j]));
      }
      P out;
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = finish<T, O>(acc[j], divisor);
      for (int d = 0; d < ndst; ++d) reinterpret_cast<P*>(dst[d])[i] = out;
    }
    done = lo + packs * V;
  }
  for (u64 i = done + threadIdx.x; i < hi; i += blockDim.x) {
    Acc acc = Traits<T>::load(src[0][i]);
    for (int s = 1; s < n; ++s) acc = combine<T, O>(acc, Traits<T>::load(src[s][i]));
    const T out = finish<T, O>(acc, divisor);
    for (int d = 0; d < ndst; ++d) dst[d][i] = out;
  }
}

/// Tells every peer this block's pushes are in its memory (stores `value`
/// into the peer's flag), and waits until every peer stored at least `value`
/// into ours. False when a peer did not arrive in time (the first such wait
/// records which one in *a.error). Values: phase_value(seq, phase).
__device__ bool exchange_flags(const Args& a, int slot, u64 value) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();  // every store of this block's pushes is issued
  const int p = static_cast<int>(threadIdx.x);
  if (p < a.nranks && p != a.rank) {
    // Orders the block's stores to p's memory before the flag (the barrier
    // above made them this thread's to order, cumulatively).
    __threadfence_system();
    store_release(a.flags[p] + flag_index(slot, a.rank, static_cast<int>(blockIdx.x)), value);
    const u64* mine = a.flags[a.rank] + flag_index(slot, p, static_cast<int>(blockIdx.x));
    const u64 start = now_ns();
    unsigned spins = 0;
    while (load_acquire(mine) < value) {
      if ((++spins & 1023) == 0 && now_ns() - start > a.timeout_ns) {
        volatile u64* err = a.error;
        if (*err == 0) *err = (a.seq << 8) | static_cast<u64>(p + 1);
        failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return failed == 0;
}

__device__ char* region(const Args& a, int owner, int slot, int source) {
  return a.data[owner] + region_offset(slot, source, a.nranks, a.slot_bytes);
}

template <typename T, RedOp O>
__device__ void reducing(const Args& a, int slot) {
  constexpr u64 es = sizeof(T);
  const Range r = part(a.count, kPartBytes / es);
  const char* send = static_cast<const char*>(a.send);
  if (a.kind == kAllReduce) {
    char* dst[kMaxRanks];
    int nd = 0;
    for (int p = 0; p < a.nranks; ++p) {
      if (p != a.rank) dst[nd++] = region(a, p, slot, a.rank);
    }
    copy_part(send, dst, nd, r.lo * es, r.hi * es);
  } else {  // reduce-scatter: rank p's block of the input goes to p
    for (int p = 0; p < a.nranks; ++p) {
      if (p == a.rank) continue;
      char* dst = region(a, p, slot, a.rank);
      copy_part(send + static_cast<u64>(p) * a.count * es, &dst, 1, r.lo * es, r.hi * es);
    }
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 0))) return;
  const T* src[kMaxRanks];
  for (int q = 0; q < a.nranks; ++q) {
    src[q] = q == a.rank
                 ? reinterpret_cast<const T*>(send + (a.kind == kAllReduce ? 0 : static_cast<u64>(q) * a.count * es))
                 : reinterpret_cast<const T*>(region(a, a.rank, slot, q));
  }
  T* dst = static_cast<T*>(a.recv);
  reduce_part<T, O>(src, a.nranks, &dst, 1, r.lo, r.hi, static_cast<unsigned>(a.nranks));
}

/// Bytes [lo, hi) of a chunk that holds `len` bytes, clamped.
__device__ __forceinline__ Range clamp(Range r, u64 len) { return Range{min(r.lo, len), min(r.hi, len)}; }

/// Length of chunk q (chunk_units each) of `total` units.
__device__ __forceinline__ u64 chunk_len(u64 total, u64 per, int q) {
  const u64 at = static_cast<u64>(q) * per;
  return at >= total ? 0 : min(per, total - at);
}

/// Two-step all-reduce (direct_abi.h): chunk p of every input goes to rank p,
/// which reduces it (sources in rank order, as everywhere) into its own
/// output and every peer's region; each rank then copies the other chunks
/// from its scratch into its output. Block b takes the same part of every
/// chunk in both steps, so in place its reads of a chunk precede its writes.
template <typename T, RedOp O>
__device__ void all_reduce_two_step(const Args& a, int slot) {
  constexpr u64 es = sizeof(T);
  const u64 per = chunk_units(a.count, a.nranks, kPartBytes / es);
  const Range r = part(per, kPartBytes / es);
  const char* send = static_cast<const char*>(a.send);
  char* recv = static_cast<char*>(a.recv);
  for (int p = 0; p < a.nranks; ++p) {
    if (p == a.rank) continue;
    const u64 at = static_cast<u64>(p) * per * es;
    const Range c = clamp(r, chunk_len(a.count, per, p));
    char* dst = region(a, p, slot, a.rank) + at;
    copy_part(send + at, &dst, 1, c.lo * es, c.hi * es);
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 0))) return;
  {
    const u64 at = static_cast<u64>(a.rank) * per * es;
    const Range c = clamp(r, chunk_len(a.count, per, a.rank));
    const T* src[kMaxRanks];
    for (int q = 0; q < a.nranks; ++q) {
      src[q] = reinterpret_cast<const T*>(q == a.rank ? send + at : region(a, a.rank, slot, q) + at);
    }
    T* dst[kMaxRanks];
    int nd = 0;
    dst[nd++] = reinterpret_cast<T*>(recv + at);
    for (int p = 0; p < a.nranks; ++p) {
      if (p != a.rank) dst[nd++] = reinterpret_cast<T*>(region(a, p, slot, a.rank) + at);
    }
    reduce_part<T, O>(src, a.nranks, dst, nd, c.lo, c.hi, static_cast<unsigned>(a.nranks));
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 1))) return;
  for (int q = 0; q < a.nranks; ++q) {
    if (q == a.rank) continue;
    const u64 at = static_cast<u64>(q) * per * es;
    const Range c = clamp(r, chunk_len(a.count, per, q));
    char* dst = recv + at;
    copy_part(region(a, a.rank, slot, q) + at, &dst, 1, c.lo * es, c.hi * es);
  }
}

/// Two-step broadcast (direct_abi.h): the root pushes chunk p to rank p; then
/// every rank pushes its chunk (the root its own, from its input) to every
/// other non-root rank, and each non-root rank copies the chunks into its
/// output. The root's links carry 2 (n - 1) / n of the bytes, not n - 1
/// times them.
__device__ void broadcast_two_step(const Args& a, int slot, u64 es) {
  const u64 bytes = a.count * es;
  const u64 per = chunk_units(bytes, a.nranks, kPartBytes);
  const Range r = part(per, kPartBytes);
  const char* send = static_cast<const char*>(a.send);
  char* recv = static_cast<char*>(a.recv);
  const bool root = a.rank == a.root;
  if (root) {
    for (int p = 0; p < a.nranks; ++p) {
      const u64 at = static_cast<u64>(p) * per;
      const Range c = clamp(r, chunk_len(bytes, per, p));
      char* dst[2];
      int nd = 0;
      if (p != a.rank) dst[nd++] = region(a, p, slot, a.rank) + at;
      if (recv != send) dst[nd++] = recv + at;  // out of place: the root's own output
      copy_part(send + at, dst, nd, c.lo, c.hi);
    }
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 0))) return;
  {
    const u64 at = static_cast<u64>(a.rank) * per;
    const Range c = clamp(r, chunk_len(bytes, per, a.rank));
    const char* src = root ? send + at : region(a, a.rank, slot, a.root) + at;
    char* dst[kMaxRanks];
    int nd = 0;
    if (!root) dst[nd++] = recv + at;
    for (int p = 0; p < a.nranks; ++p) {
      if (p != a.rank && p != a.root) dst[nd++] = region(a, p, slot, a.rank) + at;
    }
    copy_part(src, dst, nd, c.lo, c.hi);
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 1))) return;
  if (root) return;
  for (int q = 0; q < a.nranks; ++q) {
    if (q == a.rank) continue;
    const u64 at = static_cast<u64>(q) * per;
    const Range c = clamp(r, chunk_len(bytes, per, q));
    char* dst = recv + at;
    copy_part(region(a, a.rank, slot, q) + at, &dst, 1, c.lo, c.hi);
  }
}

template <typename T, RedOp O>
__device__ void reducing_or_two_step(const Args& a, int slot) {
  if (two_step(a.kind, a.count * sizeof(T), a.two_step_bytes)) {
    all_reduce_two_step<T, O>(a, slot);
  } else {
    reducing<T, O>(a, slot);
  }
}

template <typename T>
__device__ void reducing_op(const Args& a, int slot) {
  switch (static_cast<RedOp>(a.redop)) {
    case RedOp::sum: return reducing_or_two_step<T, RedOp::sum>(a, slot);
    case RedOp::prod: return reducing_or_two_step<T, RedOp::prod>(a, slot);
    case RedOp::min: return reducing_or_two_step<T, RedOp::min>(a, slot);
    case RedOp::max: return reducing_or_two_step<T, RedOp::max>(a, slot);
    case RedOp::avg: return reducing_or_two_step<T, RedOp::avg>(a, slot);
  }
}

/// All-gather and broadcast: bytes only.
__device__ void copying(const Args& a, int slot, u64 es) {
  const u64 bytes = a.count * es;
  const Range r = part(bytes, kPartBytes);
  const char* send = static_cast<const char*>(a.send);
  char* recv = static_cast<char*>(a.recv);
  const int from = a.kind == kAllGather ? a.rank : a.root;
  if (a.rank == from) {
    char* dst[kMaxRanks + 1];
    int nd = 0;
    for (int p = 0; p < a.nranks; ++p) {
      if (p != a.rank) dst[nd++] = region(a, p, slot, a.rank);
    }
    char* own = recv + (a.kind == kAllGather ? static_cast<u64>(a.rank) * bytes : 0);
    if (own != send) dst[nd++] = own;  // in place: already there
    copy_part(send, dst, nd, r.lo, r.hi);
  }
  if (!exchange_flags(a, slot, phase_value(a.seq, 0))) return;
  for (int q = 0; q < a.nranks; ++q) {
    if (q == a.rank || (a.kind == kBroadcast && q != a.root)) continue;
    char* dst = recv + (a.kind == kAllGather ? static_cast<u64>(q) * bytes : 0);
    copy_part(region(a, a.rank, slot, q), &dst, 1, r.lo, r.hi);
  }
}

__device__ u64 dtype_size(int d) {
  switch (static_cast<DType>(d)) {
    case DType::int8:
    case DType::uint8: return 1;
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::int32:
    case DType::uint32:
    case DType::float32: return 4;
    default: return 8;
  }
}

}  // namespace
}  // namespace collectived::client::direct

using namespace collectived::client::direct;

/// One operation; every rank launches it with the same grid (derived from the
/// count and dtype alone), so block b meets block b of every peer.
extern "C" __global__ void __launch_bounds__(kThreads) collectived_direct(Args a) {
  const int slot = static_cast<int>(a.seq % kSlots);
  if (a.kind == kAllGather || a.kind == kBroadcast) {
    const u64 es = dtype_size(a.dtype);
    if (two_step(a.kind, a.count * es, a.two_step_bytes)) {
      broadcast_two_step(a, slot, es);
    } else {
      copying(a, slot, es);
    }
    return;
  }
  switch (static_cast<DType>(a.dtype)) {
    case DType::int8: return reducing_op<std::int8_t>(a, slot);
    case DType::uint8: return reducing_op<std::uint8_t>(a, slot);
    case DType::int32: return reducing_op<std::int32_t>(a, slot);
    case DType::uint32: return reducing_op<std::uint32_t>(a, slot);
    case DType::int64: return reducing_op<long long>(a, slot);
    case DType::uint64: return reducing_op<unsigned long long>(a, slot);
    case DType::float16: return reducing_op<__half>(a, slot);
    case DType::bfloat16: return reducing_op<__nv_bfloat16>(a, slot);
    case DType::float32: return reducing_op<float>(a, slot);
    case DType::float64: return reducing_op<double>(a, slot);
  }
}

// ---- Staging across nodes (client/staging.h, StageKernels) -----------------
//
// A small GPU collective across nodes is staged by the client through host
// memory shared with the daemon. With copy engines the caller's stream runs
// a copy, a flag write, a flag wait and a copy per operation, each a stream
// operation of its own, and that hand-off is a large part of a small
// operation's time (19 us of a 48 us cycle for an 8-byte all-reduce). One
// kernel copies the input and then writes the ready word; one copies the
// output after the stream's wait for the done word.

namespace {
using u32 = unsigned;
using u64s = unsigned long long;

__device__ __forceinline__ void store_release_u32(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/// This block's bytes [lo, hi) of `bytes`, in whole 16-byte units but the last.
__device__ __forceinline__ void block_range(u64s bytes, u64s& lo, u64s& hi) {
  const u64s units = (bytes + 15) / 16, g = gridDim.x;
  const u64s per = (units + g - 1) / g;
  lo = min(bytes, blockIdx.x * per * 16);
  hi = min(bytes, lo + per * 16);
}

/// 16 bytes of host memory another process may have written since this
/// kernel started: not from a cache line an earlier kernel read.
__device__ __forceinline__ uint4 load_volatile16(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/// Copies [lo, hi) of src to dst; loads are volatile where `from_host`: host
/// memory the daemon wrote after this kernel started must not come from a
/// cache line an earlier kernel read.
__device__ __forceinline__ void stage_copy(const unsigned char* src, unsigned char* dst, u64s lo,
                                           u64s hi, bool from_host) {
  u64s at = lo;
  if (((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst)) & 15) == 0) {
    const u64s n16 = (hi - lo) / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src + lo);
    uint4* d = reinterpret_cast<uint4*>(dst + lo);
    for (u64s k = threadIdx.x; k < n16; k += blockDim.x) {
      d[k] = from_host ? load_volatile16(s + k) : s[k];
    }
    at = lo + n16 * 16;
  }
  for (u64s k = at + threadIdx.x; k < hi; k += blockDim.x) {
    dst[k] = from_host ? *reinterpret_cast<const volatile unsigned char*>(src + k) : src[k];
  }
}
}  // namespace

/// One block: copies the input (GPU) to host staging, then writes `value` to
/// the operation's ready word (host memory the daemon polls). One block, so
/// that no block has to learn that the others are done.
extern "C" __global__ void __launch_bounds__(512)
    collectived_stage_in(const unsigned char* src, unsigned char* dst, u64s bytes, u32* ready,
                         u32 value) {
  stage_copy(src, dst, 0, bytes, false);
  // Every thread's stores reach host memory before the word says so.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) store_release_u32(ready, value);
}

/// Copies the output from host staging to the GPU, after the stream's wait
/// for the done word (cuStreamWaitValue32, not a spin here: a spinning kernel
/// would hold its SMs, and where processes time-slice one GPU without MPS,
/// its whole time slice, while the daemon is still exchanging).
extern "C" __global__ void __launch_bounds__(512)
    collectived_stage_out(const unsigned char* src, unsigned char* dst, u64s bytes) {
  u64s lo, hi;
  block_range(bytes, lo, hi);
  stage_copy(src, dst, lo, hi, true);
}

namespace {
/// A volatile load of one element, through an unsigned type of its size
/// (__half and __nv_bfloat16 have no volatile copy).
template <typename T>
__device__ __forceinline__ T load_volatile(const T* p) {
  using Bits = std::conditional_t<sizeof(T) == 1, unsigned char,
               std::conditional_t<sizeof(T) == 2, unsigned short,
               std::conditional_t<sizeof(T) == 4, unsigned int, unsigned long long>>>;
  const Bits b = *reinterpret_cast<const volatile Bits*>(p);
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}

/// The host reduction of the two nodes' contributions, in node order
/// (`own_first`: this rank's node is node 0), with avg as the host finishes
/// it: the sum stored as T, then divided (engine/node_algorithms.cc, a
/// one-rank pairwise reduce-scatter, then finish_avg).
template <typename T, RedOp O>
__device__ __forceinline__ T stage_combine(T o, T h, u32 nranks, bool own_first) {
  using Tr = Traits<T>;
  constexpr RedOp C = O == RedOp::avg ? RedOp::sum : O;
  auto acc = own_first ? combine<T, C>(Tr::load(o), Tr::load(h)) : combine<T, C>(Tr::load(h), Tr::load(o));
  T v = Tr::store(acc);
  if constexpr (O == RedOp::avg) v = finish<T, RedOp::avg>(Tr::load(v), nranks);
  return v;
}

/// out[i] = stage_combine(own[i], host[i]); `host` is the staging the
/// daemon wrote (volatile loads).
template <typename T, RedOp O>
__device__ void stage_reduce_typed(const T* own, const T* host, T* out, u64s count, u32 nranks,
                                   bool own_first) {
  const u64s stride = static_cast<u64s>(gridDim.x) * blockDim.x;
  const u64s tid = static_cast<u64s>(blockIdx.x) * blockDim.x + threadIdx.x;
  u64s done = 0;
  // 16 bytes a load where the three are aligned: a PCIe read of a few bytes
  // costs a round trip as a whole line does.
  constexpr int V = 16 / sizeof(T);
  if (((reinterpret_cast<std::uintptr_t>(own) | reinterpret_cast<std::uintptr_t>(host) |
        reinterpret_cast<std::uintptr_t>(out)) & 15) == 0) {
    const u64s packs = count / V;
    for (u64s k = tid; k < packs; k += stride) {
      const uint4 hb = load_volatile16(reinterpret_cast<const uint4*>(host) + k);
      const uint4 ob = reinterpret_cast<const uint4*>(own)[k];
      T hv[V], ov[V], r[V];
      memcpy(hv, &hb, 16);
      memcpy(ov, &ob, 16);
#pragma unroll
      for (int e = 0; e < V; ++e) r[e] = stage_combine<T, O>(ov[e], hv[e], nranks, own_first);
      uint4 rb;
      memcpy(&rb, r, 16);
      reinterpret_cast<uint4*>(out)[k] = rb;
    }
    done = packs * V;
  }
  for (u64s i = done + tid; i < count; i += stride) {
    out[i] = stage_combine<T, O>(own[i], load_volatile(host + i), nranks, own_first);
  }
}

template <typename T>
__device__ void stage_reduce_op(const void* own, const void* host, void* out, u64s count, int op,
                                u32 nranks, bool own_first) {
  const T* o = static_cast<const T*>(own);
  const T* h = static_cast<const T*>(host);
  T* d = static_cast<T*>(out);
  switch (static_cast<RedOp>(op)) {
    case RedOp::sum: return stage_reduce_typed<T, RedOp::sum>(o, h, d, count, nranks, own_first);
    case RedOp::prod: return stage_reduce_typed<T, RedOp::prod>(o, h, d, count, nranks, own_first);
    case RedOp::min: return stage_reduce_typed<T, RedOp::min>(o, h, d, count, nranks, own_first);
    case RedOp::max: return stage_reduce_typed<T, RedOp::max>(o, h, d, count, nranks, own_first);
    case RedOp::avg: return stage_reduce_typed<T, RedOp::avg>(o, h, d, count, nranks, own_first);
  }
}
}  // namespace

/// A reduce-scatter over two nodes staged by the client, its own segment on
/// the GPU: the daemon wrote the other node's contribution to this rank's
/// segment into host staging (`host`), and this combines it with the rank's
/// own contribution (`own`, its input's segment) into `out` (which may be
/// `own`: in place). After the stream's wait for the done word.
extern "C" __global__ void __launch_bounds__(256)
    collectived_stage_reduce(const void* own, const void* host, void* out, u64s count, int dtype,
                             int op, u32 nranks, int own_first) {
  const bool f = own_first != 0;
  switch (static_cast<DType>(dtype)) {
    case DType::int8: return stage_reduce_op<std::int8_t>(own, host, out, count, op, nranks, f);
    case DType::uint8: return stage_reduce_op<std::uint8_t>(own, host, out, count, op, nranks, f);
    case DType::int32: return stage_reduce_op<std::int32_t>(own, host, out, count, op, nranks, f);
    case DType::uint32: return stage_reduce_op<std::uint32_t>(own, host, out, count, op, nranks, f);
    case DType::int64: return stage_reduce_op<long long>(own, host, out, count, op, nranks, f);
    case DType::uint64: return stage_reduce_op<unsigned long long>(own, host, out, count, op, nranks, f);
    case DType::float16: return stage_reduce_op<__half>(own, host, out, count, op, nranks, f);
    case DType::bfloat16: return stage_reduce_op<__nv_bfloat16>(own, host, out, count, op, nranks, f);
    case DType::float32: return stage_reduce_op<float>(own, host, out, count, op, nranks, f);
    case DType::float64: return stage_reduce_op<double>(own, host, out, count, op, nranks, f);
  }
}

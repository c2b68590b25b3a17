// ncclRedOpCreatePreMulSum: a sum of inputs each multiplied by a scalar
// (PyTorch's PREMUL_SUM, gradient averaging by a factor). collectived has no
// such reduction, so the input is scaled on the caller's stream into a
// scratch buffer of the communicator (premul_kernels.cu), and the sum runs
// from there. The scratch is cuMemAlloc memory (shareable with the daemon by
// a legacy IPC handle), grown as needed and freed with the communicator; its
// uses are ordered by an event, since operations on other streams may share it.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/nccl/shim.h"

#ifdef COLLECTIVED_NCCL_PREMUL_FATBIN
// cuModuleLoadData wants the fatbin aligned; the symbols stay inside the library.
asm(".section .rodata\n"
    ".balign 64\n"
    ".globl collectived_nccl_premul_begin\n"
    ".hidden collectived_nccl_premul_begin\n"
    "collectived_nccl_premul_begin:\n"
    ".incbin \"" COLLECTIVED_NCCL_PREMUL_FATBIN
    "\"\n"
    ".globl collectived_nccl_premul_end\n"
    ".hidden collectived_nccl_premul_end\n"
    "collectived_nccl_premul_end:\n"
    ".previous\n");
extern "C" const unsigned char collectived_nccl_premul_begin[];
#endif

namespace collectived::client::nccl {

namespace {

constexpr const char* kKernels[] = {
    "collectived_nccl_premul_int8",    "collectived_nccl_premul_uint8",
    "collectived_nccl_premul_int32",   "collectived_nccl_premul_uint32",
    "collectived_nccl_premul_int64",   "collectived_nccl_premul_uint64",
    "collectived_nccl_premul_float16", "collectived_nccl_premul_bfloat16",
    "collectived_nccl_premul_float32", "collectived_nccl_premul_float64"};
constexpr std::size_t kKinds = sizeof kKernels / sizeof kKernels[0];
constexpr std::size_t kMinScratch = std::size_t{1} << 20;

struct Op {
  bool live = false;
  collective_dtype_t dtype = COLLECTIVE_FLOAT32;
  const void* device = nullptr;  // ncclScalarDevice
  unsigned long long bits = 0;   // ncclScalarHostImmediate: the value's bytes
};

}  // namespace

struct Premul {
  std::mutex mu;
  std::vector<Op> ops;
  cu::Module module = nullptr;
  cu::Function kernels[kKinds] = {};
  cu::DevicePtr scratch = 0;
  std::size_t scratch_bytes = 0;
  cu::Event last_use = nullptr;
  bool used = false;
};

namespace {

/// The communicator's state, made at its first PreMulSum op (the module
/// load may wait for work queued on the GPU: done here, not in a collective).
Premul& state(ncclComm* comm) {
  std::lock_guard lock(comm->mu);
  if (comm->premul != nullptr) return *comm->premul;
#ifndef COLLECTIVED_NCCL_PREMUL_FATBIN
  throw Failure(ncclInvalidUsage,
                "this libnccl was built without CUDA (no nvcc): it has no "
                "kernel to scale PreMulSum's inputs");
#else
  const gpu::CudaDriver& d = driver();
  ContextScope scope(comm->ctx);
  auto p = std::make_unique<Premul>();
  cuda_check(d.cuModuleLoadData(&p->module, collectived_nccl_premul_begin),
             "cuModuleLoadData of libnccl's PreMulSum kernels");
  for (std::size_t k = 0; k < kKinds; ++k) {
    if (d.cuModuleGetFunction(&p->kernels[k], p->module, kKernels[k]) != cu::kSuccess) {
      d.cuModuleUnload(p->module);
      throw Failure(ncclInternalError, std::string("kernel ") + kKernels[k] + " is missing");
    }
  }
  const cu::Result r = d.cuEventCreate(&p->last_use, cu::kEventDisableTiming);
  if (r != cu::kSuccess) d.cuModuleUnload(p->module);
  cuda_check(r, "cuEventCreate");
  comm->premul = p.release();
  return *comm->premul;
#endif
}

/// Scratch of at least `bytes` (mutex held, context current).
void reserve(ncclComm* comm, Premul& p, std::size_t bytes) {
  if (bytes <= p.scratch_bytes) return;
  const gpu::CudaDriver& d = driver();
  if (p.scratch != 0) {
    if (p.used) cuda_check(d.cuEventSynchronize(p.last_use), "cuEventSynchronize");
    collective_gpu_deregister(comm->client.get(), reinterpret_cast<void*>(p.scratch));
    d.cuMemFree(p.scratch);
    p.scratch = 0;
    p.scratch_bytes = 0;
  }
  const std::size_t size = std::max({bytes, kMinScratch, 2 * p.scratch_bytes});
  cuda_check(d.cuMemAlloc(&p.scratch, size), "cuMemAlloc of PreMulSum's scratch");
  p.scratch_bytes = size;
}

}  // namespace

bool is_premul(ncclRedOp_t op) { return static_cast<int>(op) >= static_cast<int>(ncclNumOps); }

void submit_premul(ncclComm* comm, ncclRedOp_t op, Coll c) {
  Premul* p = nullptr;
  {
    std::lock_guard lock(comm->mu);
    p = comm->premul;
  }
  const std::size_t index = static_cast<std::size_t>(op) - ncclNumOps;
  if (p == nullptr)
    throw Failure(ncclInvalidArgument, "the PreMulSum op is not this communicator's");
  std::lock_guard lock(p->mu);
  if (index >= p->ops.size() || !p->ops[index].live) {
    throw Failure(ncclInvalidArgument,
                  "the PreMulSum op is not this communicator's (or destroyed)");
  }
  const Op& o = p->ops[index];
  if (o.dtype != c.dtype) {
    throw Failure(ncclInvalidArgument, std::string("the PreMulSum op was made for ") +
                                           collective_dtype_name(o.dtype) + ", the data is " +
                                           collective_dtype_name(c.dtype));
  }
  const unsigned long long n =
      c.count * (c.kind == Kind::reduce_scatter ? static_cast<std::size_t>(comm->nranks) : 1);
  const gpu::CudaDriver& d = driver();
  ContextScope scope(comm->ctx);
  check_stream(comm, c.stream);
  reserve(comm, *p, n * collective_dtype_size(c.dtype));
  auto stream = reinterpret_cast<cu::Stream>(c.stream);
  if (p->used) cuda_check(d.cuStreamWaitEvent(stream, p->last_use, 0), "cuStreamWaitEvent");
  const void* in = c.send;
  void* out = reinterpret_cast<void*>(p->scratch);
  const void* device = o.device;
  unsigned long long bits = o.bits;
  void* args[] = {&in, &out, const_cast<unsigned long long*>(&n), &device, &bits};
  const unsigned blocks =
      static_cast<unsigned>(std::min<unsigned long long>((n + 255) / 256, 1024));
  cuda_check(
      d.cuLaunchKernel(p->kernels[c.dtype], blocks, 1, 1, 256, 1, 1, 0, stream, args, nullptr),
      "cuLaunchKernel of PreMulSum's scaling");
  c.send = out;
  c.redop = COLLECTIVE_SUM;
  submit(comm, c);
  cuda_check(d.cuEventRecord(p->last_use, stream), "cuEventRecord");
  p->used = true;
}

void release_premul(ncclComm* comm) noexcept {
  Premul* p = comm->premul;
  comm->premul = nullptr;
  if (p == nullptr) return;
  try {
    const gpu::CudaDriver& d = driver();
    ContextScope scope(comm->ctx);
    if (p->scratch != 0) {
      if (p->used) d.cuEventSynchronize(p->last_use);
      collective_gpu_deregister(comm->client.get(), reinterpret_cast<void*>(p->scratch));
      d.cuMemFree(p->scratch);
    }
    d.cuEventDestroy(p->last_use);
    d.cuModuleUnload(p->module);
  } catch (const std::exception&) {
    // The context is gone (process exit): so are its allocations.
  }
  delete p;
}

}  // namespace collectived::client::nccl

using namespace collectived::client::nccl;

extern "C" {

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  return guarded("ncclRedOpCreatePreMulSum", [&] {
    if (op == nullptr || scalar == nullptr) {
      throw Failure(ncclInvalidArgument, "op and scalar must be set");
    }
    require_ready(comm);
    Op o;
    o.live = true;
    o.dtype = map_dtype(datatype);
    if (residence == ncclScalarHostImmediate) {
      std::memcpy(&o.bits, scalar, collective_dtype_size(o.dtype));
    } else if (residence == ncclScalarDevice) {
      o.device = scalar;
    } else {
      throw Failure(ncclInvalidArgument,
                    "residence " + std::to_string(static_cast<int>(residence)) +
                        " is neither ncclScalarDevice nor ncclScalarHostImmediate");
    }
    if (comm->ctx == nullptr)
      throw Failure(ncclInvalidUsage, "the communicator has no CUDA device");
    Premul& p = state(comm);
    std::lock_guard lock(p.mu);
    auto free_slot = std::find_if(p.ops.begin(), p.ops.end(), [](const Op& x) { return !x.live; });
    if (free_slot == p.ops.end()) free_slot = p.ops.insert(p.ops.end(), Op{});
    *free_slot = o;
    *op = static_cast<ncclRedOp_t>(ncclNumOps + (free_slot - p.ops.begin()));
    return ncclSuccess;
  });
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  return guarded("ncclRedOpDestroy", [&] {
    if (comm == nullptr) throw Failure(ncclInvalidArgument, "comm is NULL");
    if (!is_premul(op)) throw Failure(ncclInvalidArgument, "built-in reductions are not destroyed");
    Premul* p = nullptr;
    {
      std::lock_guard lock(comm->mu);
      p = comm->premul;
    }
    const std::size_t index = static_cast<std::size_t>(op) - ncclNumOps;
    if (p != nullptr) {
      std::lock_guard lock(p->mu);
      if (index < p->ops.size() && p->ops[index].live) {
        p->ops[index].live = false;
        return ncclSuccess;
      }
    }
    throw Failure(ncclInvalidArgument, "the op is not one of this communicator's PreMulSum ops");
  });
}

}  // extern "C"

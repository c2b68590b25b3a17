// Device memory and buffer registration: ncclMemAlloc/ncclMemFree and
// ncclCommRegister/ncclCommDeregister.
#include <string>

#include "client/nccl/shim.h"

using namespace collectived::client::nccl;

namespace {

/// ncclCommRegister's handle: the buffer whose allocation was registered.
struct Registration {
  ClientRef client;
  void* buffer;
};

}  // namespace

extern "C" {

// cuMemAlloc memory: the daemon maps it by a legacy IPC handle, the cheapest
// kind to share (PyTorch asks for it only with its NCCL memory pool).
ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  return guarded("ncclMemAlloc", [&] {
    if (ptr == nullptr || size == 0)
      throw Failure(ncclInvalidArgument, "ptr must be set and size positive");
    *ptr = nullptr;
    int device = -1;
    ContextScope scope(bind_context(-1, device));
    cu::DevicePtr p = 0;
    cuda_check(driver().cuMemAlloc(&p, size),
               ("cuMemAlloc of " + std::to_string(size) + " bytes").c_str());
    *ptr = reinterpret_cast<void*>(p);
    return ncclSuccess;
  });
}

// The daemon's mapping goes first (else it would keep the memory alive).
ncclResult_t ncclMemFree(void* ptr) {
  if (ptr == nullptr) return ncclSuccess;
  return guarded("ncclMemFree", [&] {
    const collectived::engine::gpu::CudaDriver& d = driver();
    if (const ClientRef c = existing_process_client()) collective_gpu_deregister(c.get(), ptr);
    cu::Context ctx = nullptr;
    d.cuPointerGetAttribute(&ctx, cu::kPointerAttributeContext,
                            reinterpret_cast<cu::DevicePtr>(ptr));
    ContextScope scope(ctx);
    cuda_check(d.cuMemFree(reinterpret_cast<cu::DevicePtr>(ptr)), "cuMemFree");
    return ncclSuccess;
  });
}

// The whole allocation holding `buff` is registered with the daemon now
// instead of at its first operation.
ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle) {
  return guarded("ncclCommRegister", [&] {
    if (handle == nullptr || buff == nullptr)
      throw Failure(ncclInvalidArgument, "buff and handle must be set");
    *handle = nullptr;
    require_ready(comm);
    (void)size;  // the registration covers the whole allocation
    ContextScope scope(comm->ctx);
    check(collective_gpu_register(comm->client.get(), buff, nullptr));
    *handle = new Registration{comm->client, buff};
    return ncclSuccess;
  });
}

// Registrations of one allocation are one in the daemon: the first
// deregistration ends it (a later operation registers it again).
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle) {
  return guarded("ncclCommDeregister", [&] {
    if (comm == nullptr || handle == nullptr)
      throw Failure(ncclInvalidArgument, "comm and handle must be set");
    auto* reg = static_cast<Registration*>(handle);
    const collective_result_t r = collective_gpu_deregister(reg->client.get(), reg->buffer);
    delete reg;
    if (r != COLLECTIVE_NOT_FOUND) check(r);
    return ncclSuccess;
  });
}

}  // extern "C"

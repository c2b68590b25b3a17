// NCCL calls this library does not implement. They exist so that programs
// linked against NCCL (torch 2.11's libtorch_cuda.so imports every one of
// these) load; each returns ncclInvalidUsage and ncclGetLastError names it.
#include <string>

#include "client/nccl/shim.h"

using namespace collectived::client::nccl;

namespace {

ncclResult_t unimplemented(const char* call, const char* why) {
  return fail(ncclInvalidUsage,
              std::string("collectived's libnccl does not implement ") + call + " (" + why + ")");
}

}  // namespace

extern "C" {

ncclResult_t ncclCommWindowRegister(ncclComm_t, void*, size_t, ncclWindow_t* win, int) {
  if (win != nullptr) *win = nullptr;
  return unimplemented("ncclCommWindowRegister",
                       "symmetric windows are NCCL's kernels' memory; use ncclCommRegister");
}

ncclResult_t ncclCommWindowDeregister(ncclComm_t, ncclWindow_t) {
  return unimplemented("ncclCommWindowDeregister", "no window is ever registered");
}

// Declared by NCCL's nccl_device/core.h (device-initiated communication):
// pointers to its structs, which are never read here.
ncclResult_t ncclDevCommCreate(ncclComm_t, const void*, void*) {
  return unimplemented("ncclDevCommCreate", "device-initiated communication runs NCCL's kernels");
}

ncclResult_t ncclDevCommDestroy(ncclComm_t, const void*) {
  return unimplemented("ncclDevCommDestroy", "no device communicator is ever made");
}

ncclResult_t ncclCommShrink(ncclComm_t, int*, int, ncclComm_t* newcomm, ncclConfig_t*, int) {
  if (newcomm != nullptr) *newcomm = nullptr;
  return unimplemented("ncclCommShrink", "use ncclCommSplit, or a new communicator");
}

ncclResult_t ncclCommRevoke(ncclComm_t, int) {
  return unimplemented("ncclCommRevoke", "use ncclCommAbort");
}

ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t*) {
  return unimplemented("ncclGroupSimulateEnd", "there is no NCCL performance model here");
}

}  // extern "C"

// Results and messages: libcollective's codes as NCCL's, the last error, and
// ncclGetErrorString / ncclGetLastError.
#include <mutex>
#include <string>

#include "client/nccl/shim.h"

namespace collectived::client::nccl {

namespace {

// NCCL keeps one last error per process, not per thread: PyTorch's watchdog
// thread asks for it after another thread's call failed. The copy handed out
// is per thread, so that a later failure elsewhere cannot change the text
// under a reader.
std::mutex g_last_mutex;
std::string& last_error() {
  static auto* s = new std::string;  // never destroyed: callers may run at exit
  return *s;
}
thread_local std::string t_last_copy;

const char* copy_out(const std::string& text) {
  t_last_copy = text;
  return t_last_copy.c_str();
}

}  // namespace

ncclResult_t to_nccl(collective_result_t r) {
  switch (r) {
    case COLLECTIVE_OK:
      return ncclSuccess;
    case COLLECTIVE_INVALID_ARGUMENT:
    case COLLECTIVE_NOT_FOUND:
      return ncclInvalidArgument;
    case COLLECTIVE_INVALID_USAGE:
    case COLLECTIVE_MISMATCH:
      return ncclInvalidUsage;
    case COLLECTIVE_REMOTE_ERROR:
    case COLLECTIVE_TIMEOUT:
    case COLLECTIVE_ABORTED:
      return ncclRemoteError;
    case COLLECTIVE_SYSTEM_ERROR:
    case COLLECTIVE_PERMISSION_DENIED:
    case COLLECTIVE_UNAVAILABLE:
    case COLLECTIVE_RESOURCE_EXHAUSTED:
      return ncclSystemError;
    case COLLECTIVE_PROTOCOL_ERROR:
    case COLLECTIVE_INTERNAL_ERROR:
      return ncclInternalError;
  }
  return ncclInternalError;
}

ncclResult_t fail(ncclResult_t code, const std::string& message) {
  {
    std::lock_guard lock(g_last_mutex);
    last_error() = message;
  }
  if (debug_level() >= Debug::warn) log_line("WARN", -1, message);
  return code;
}

void check(collective_result_t r) {
  if (r == COLLECTIVE_OK) return;
  throw Failure(to_nccl(r), collective_last_error());  // names the libcollective call
}

}  // namespace collectived::client::nccl

using namespace collectived::client::nccl;

extern "C" {

// NCCL's phrase for each code; where NCCL sends the reader to NCCL_DEBUG,
// ours says where collectived's message is (NCCL_DEBUG shows nothing more).
const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (ncclGetLastError() names the CUDA call)";
    case ncclSystemError:
      return "unhandled system error (ncclGetLastError() has collectived's message)";
    case ncclInternalError:
      return "internal error (ncclGetLastError() has collectived's message)";
    case ncclInvalidArgument:
      return "invalid argument (ncclGetLastError() says which)";
    case ncclInvalidUsage:
      return "invalid usage (ncclGetLastError() says which)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (ncclGetLastError() names "
             "the rank and node)";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

// `comm` given and failed: its own failure (the operation's message names the
// rank, node and pid); otherwise the process's last one, as NCCL does.
const char* ncclGetLastError(ncclComm_t comm) {
  if (comm != nullptr) {
    std::lock_guard lock(comm->mu);
    if (comm->error != ncclSuccess && !comm->message.empty()) return copy_out(comm->message);
  }
  std::lock_guard lock(g_last_mutex);
  return copy_out(last_error());
}

// NCCL's deprecated hook to re-read NCCL_DEBUG: the environment is read once here.
void ncclResetDebugInit(void) {}

}  // extern "C"

// Process-wide state: the connection to the node's daemon and the CUDA driver.
//
// NCCL's API has no handle for a library instance: ncclGetUniqueId and
// ncclCommInitRank take none, yet both need the daemon. So the process keeps
// one client, made at first need under a lock. The process's own reference
// is never dropped: at exit nothing is torn down under threads that may still
// use it. A client replaced after its daemon went away is disconnected when
// the communicators and registrations made on it are gone. All other state
// lives in ncclComm.
#include <pthread.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "client/nccl/shim.h"

namespace collectived::client::nccl {

namespace {

std::mutex g_client_mutex;
// Heap-held so that no exit-time destructor disconnects them.
ClientRef& g_client = *new ClientRef;
// Clients a forked child inherited: never used, never disconnected (their
// socket is the parent's).
std::vector<ClientRef>& g_inherited = *new std::vector<ClientRef>;

std::string socket_path() {
  const char* env = std::getenv("COLLECTIVED_SOCKET");
  return env != nullptr && env[0] != '\0' ? env : COLLECTIVE_DEFAULT_SOCKET;
}

// A forked child shares its parent's socket: it must never talk on it, so
// it connects anew at its first need (the parent's client is left alone).
void forget_after_fork() {
  if (g_client) g_inherited.push_back(std::move(g_client));
  g_client = nullptr;
}

ClientRef connect_locked() {
  static std::once_flag atfork;
  std::call_once(atfork, [] { ::pthread_atfork(nullptr, nullptr, forget_after_fork); });
  const std::string path = socket_path();
  note_environment(path);
  const std::string name = "libnccl pid " + std::to_string(::getpid());
  collective_client_t* c = nullptr;
  // NULL: libcollective's own choice, which socket_path() mirrors for the messages.
  const collective_result_t r = collective_connect(nullptr, name.c_str(), &c);
  // Its message names the socket and where the path came from.
  if (r != COLLECTIVE_OK) throw Failure(to_nccl(r), collective_last_error());
  return ClientRef(c, collective_disconnect);
}

}  // namespace

ClientRef process_client() {
  std::lock_guard lock(g_client_mutex);
  if (g_client == nullptr) g_client = connect_locked();
  return g_client;
}

ClientRef reconnect_process_client(const ClientRef& broken) {
  std::lock_guard lock(g_client_mutex);
  // Communicators made on the old client keep it (their calls then fail
  // naming the closed connection).
  if (g_client == broken) g_client = connect_locked();
  return g_client;
}

ClientRef existing_process_client() {
  std::lock_guard lock(g_client_mutex);
  return g_client;
}

const gpu::CudaDriver& driver() {
  static std::mutex mu;
  static gpu::CudaDriver* loaded = nullptr;  // never unloaded (cuda_driver.cc says why)
  static std::string why;
  std::lock_guard lock(mu);
  if (loaded != nullptr) return *loaded;
  if (why.empty()) {
    try {
      loaded = gpu::CudaDriver::load().release();
      return *loaded;
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  throw Failure(ncclUnhandledCudaError, "collectived's libnccl needs the CUDA driver: " + why);
}

void cuda_check(cu::Result r, const char* what) {
  if (r == cu::kSuccess) return;
  throw Failure(ncclUnhandledCudaError, std::string(what) + ": " + driver().error_text(r));
}

cu::Context bind_context(int device, int& ordinal) {
  const gpu::CudaDriver& d = driver();
  cu::Context ctx = nullptr;
  if (device < 0) {
    cuda_check(d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
    if (ctx != nullptr) {
      cu::Device dev = 0;
      cuda_check(d.cuCtxGetDevice(&dev), "cuCtxGetDevice");
      ordinal = dev;  // CUdevice values are the ordinals
      return ctx;
    }
    device = 0;
  }
  int count = 0;
  cuda_check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (device >= count) {
    throw Failure(ncclInvalidArgument, "CUDA device " + std::to_string(device) +
                                           " does not exist (the process sees " +
                                           std::to_string(count) + ")");
  }
  cu::Device dev = 0;
  cuda_check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
  cuda_check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  cu::Context current = nullptr;
  d.cuCtxGetCurrent(&current);
  if (current == nullptr) cuda_check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  ordinal = device;
  return ctx;
}

void check_stream(const ncclComm* comm, cudaStream_t stream) {
  if (comm->ctx == nullptr || stream == nullptr) return;
  cu::Context ctx = nullptr;
  cuda_check(driver().cuStreamGetCtx(reinterpret_cast<cu::Stream>(stream), &ctx),
             "cuStreamGetCtx of the stream");
  if (ctx != comm->ctx) {
    throw Failure(ncclInvalidArgument, "the stream belongs to another CUDA context than the " +
                                           comm->where() + "'s (another device?)");
  }
}

ContextScope::ContextScope(cu::Context ctx) {
  if (ctx == nullptr) return;
  const gpu::CudaDriver& d = driver();
  cu::Context current = nullptr;
  d.cuCtxGetCurrent(&current);
  if (current == ctx) return;
  cuda_check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent of the communicator's context");
  pushed_ = true;
}

ContextScope::~ContextScope() {
  if (!pushed_) return;
  cu::Context ignored = nullptr;
  driver().cuCtxPopCurrent(&ignored);
}

}  // namespace collectived::client::nccl

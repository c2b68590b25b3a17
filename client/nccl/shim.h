// Private to collectived's libnccl.so.2: the communicator behind ncclComm_t
// and the helpers the NCCL calls share. The library is libcollective's C API
// (client/collective.h) underneath; only the nccl* symbols leave it
// (exports.map).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "client/collective.h"
#include "client/nccl/nccl.h"
#include "engine/gpu/cuda_driver.h"
#include "ipc/error.h"

namespace collectived::client::nccl {

// The CUDA driver loader (engine/gpu/cuda_driver.h), a leaf library the client links.
namespace gpu = engine::gpu;

namespace cu = gpu::cu;

/// A failure inside the library, with the NCCL code the caller gets.
class Failure : public std::runtime_error {
 public:
  Failure(ncclResult_t code, std::string message)
      : std::runtime_error(std::move(message)), code_(code) {}
  ncclResult_t code() const { return code_; }

 private:
  ncclResult_t code_;
};

// --- errors.cc ---
/// libcollective's result as NCCL's (invalid arguments stay invalid
/// arguments; another rank's death, a deadline or an abort is a remote error).
ncclResult_t to_nccl(collective_result_t r);
/// Records `message` as the process's last error (ncclGetLastError), logs it
/// at NCCL_DEBUG=WARN and returns `code`.
ncclResult_t fail(ncclResult_t code, const std::string& message);
/// Throws Failure for a libcollective result other than OK, with
/// collective_last_error() (which names the call, communicator, rank and node).
void check(collective_result_t r);

/// Runs `fn` (returning ncclResult_t); exceptions become failures of `call`.
template <typename Fn>
ncclResult_t guarded(const char* call, Fn&& fn) {
  try {
    return fn();
  } catch (const Failure& f) {
    return fail(f.code(), std::string(call) + ": " + f.what());
  } catch (const Error& e) {
    return fail(to_nccl(static_cast<collective_result_t>(e.code())),
                std::string(call) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(ncclSystemError, std::string(call) + ": out of host memory");
  } catch (const std::exception& e) {
    return fail(ncclInternalError, std::string(call) + ": " + e.what());
  }
}

// --- env.cc ---
enum class Debug { none, version, warn, info, trace };
Debug debug_level();
/// One line on stderr in NCCL's "host:pid:tid [dev] NCCL INFO text" form.
void log_line(const char* level, int device, const std::string& text);
/// Once per process: NCCL_DEBUG's line, and each NCCL_* variable we do not
/// read logged as ignored (with the profile key that replaces it).
void note_environment(const std::string& socket);
/// NCCL_COMM_BLOCKING, where set to 0 or 1; else -1.
int env_blocking();
/// COLLECTIVED_NCCL_HOST_ONLY=1: communicators without a CUDA device (CI:
/// the set-up calls on machines without a GPU; collectives then fail).
bool host_only();

// --- process.cc ---
/// A connection to the daemon, owned by the process and by the communicators
/// and registrations made on it: one replaced after its daemon went away is
/// disconnected when the last of them lets go.
using ClientRef = std::shared_ptr<collective_client_t>;
/// The process's connection to its node's daemon, made at first need.
ClientRef process_client();
/// The same, but made anew (the old one's daemon went away).
ClientRef reconnect_process_client(const ClientRef& broken);
/// The client if one was made (never connects).
ClientRef existing_process_client();
/// The CUDA driver, loaded once. Throws Failure(ncclUnhandledCudaError) naming why not.
const gpu::CudaDriver& driver();
/// Throws Failure(ncclUnhandledCudaError) unless r is success.
void cuda_check(cu::Result r, const char* what);
/// The context a new communicator binds: device's primary context (device
/// >= 0), else the calling thread's current one, else device 0's primary
/// context made current, as the CUDA runtime does for a first call.
cu::Context bind_context(int device, int& ordinal);

/// Throws Failure(ncclInvalidArgument) where `stream` is not of the
/// communicator's context (NULL: the legacy stream of whichever is current).
void check_stream(const ncclComm* comm, cudaStream_t stream);

/// Makes `ctx` current for a scope where it is not already.
class ContextScope {
 public:
  explicit ContextScope(cu::Context ctx);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  bool pushed_ = false;
};

struct Premul;  // premul.cc

}  // namespace collectived::client::nccl

/// ncclComm_t. Rank, size and device are set when it is made; the daemon's
/// communicator (`coll`) once its init finished (at once where blocking).
struct ncclComm {
  collectived::client::nccl::ClientRef client;
  collective_comm_t* coll = nullptr;
  int rank = -1;
  int nranks = 0;
  int device = -1;  // CUDA ordinal; -1: none (COLLECTIVED_NCCL_HOST_ONLY)
  collectived::engine::gpu::cu::Context ctx = nullptr;
  bool blocking = true;

  std::mutex mu;  // everything below
  /// A non-blocking init, split or finalize is running (ncclInProgress).
  bool busy = false;
  /// Aborted while a job ran: the job frees the communicator when it ends.
  bool orphaned = false;
  std::thread job;
  /// The first failure seen (init, or an operation's answer); sticky, as NCCL's.
  ncclResult_t error = ncclSuccess;
  std::string message;
  /// Operations whose answer has not been looked at yet, oldest first.
  std::deque<collective_request_t*> requests;
  collectived::client::nccl::Premul* premul = nullptr;

  std::string where() const;
};

namespace collectived::client::nccl {

// --- init.cc ---
/// Throws Failure unless `comm` can take operations: its init is done and no
/// failure was seen (NCCL's communicator error state).
void require_ready(ncclComm* comm);

// --- collectives.cc ---
enum class Kind { all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all };
struct Coll {
  Kind kind;
  const void* send;
  void* recv;
  std::size_t count;
  collective_dtype_t dtype;
  collective_redop_t redop;
  int root;
  cudaStream_t stream;
};
/// NCCL's element type as ours; fp8 and unknown values throw Failure.
collective_dtype_t map_dtype(ncclDataType_t t);
/// Submits `c` through libcollective's stream-ordered call and keeps its request.
void submit(ncclComm* comm, const Coll& c);
/// Keeps an operation's request until its answer is seen (bounded: the
/// oldest is waited for beyond kMaxRequests).
void track(ncclComm* comm, collective_request_t* request);
/// Looks at every kept request's answer (all: waits for each); the first
/// failure becomes the communicator's error.
void reap(ncclComm* comm, bool all);
/// Frees every kept request unseen (destroy, abort).
void drop_requests(ncclComm* comm);

// --- group.cc ---
/// True inside ncclGroupStart/End on this thread.
bool in_group();
/// A failure inside a group: ncclGroupEnd returns the first one.
void group_failed(ncclResult_t code);
/// A blocking init inside a group: the outermost ncclGroupEnd waits for it.
void init_in_group(ncclComm* comm);

// --- premul.cc ---
/// `op` is one of ncclRedOpCreatePreMulSum's.
bool is_premul(ncclRedOp_t op);
/// Scales the input into the communicator's scratch buffer on the stream,
/// then submits `c` as a sum from there.
void submit_premul(ncclComm* comm, ncclRedOp_t op, Coll c);
/// Frees the communicator's PreMulSum state (scratch, module).
void release_premul(ncclComm* comm) noexcept;

}  // namespace collectived::client::nccl

// Private to libcollective: state shared by the C API's translation units.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "client/collective.h"
#include "client/connection.h"
#include "ipc/error.h"

namespace collectived::client {

// Control requests (registration, status) answer in microseconds; this bounds
// a daemon that stopped answering.
inline constexpr std::chrono::seconds kControlTimeout{30};
// Waited beyond the daemon's own deadline, which always answers first.
inline constexpr std::chrono::seconds kDeadlineMargin{10};

struct HostBuffer {
  std::uint64_t handle;
  std::size_t bytes;  // mapped length (page-rounded)
};

/// Sets this thread's last error and returns the code as a C result.
collective_result_t fail(Code code, std::string message);

template <typename Fn>
collective_result_t guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return COLLECTIVE_OK;
  } catch (const Error& e) {
    return fail(e.code(), std::string(what) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(Code::resource_exhausted, std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return fail(Code::internal, std::string(what) + ": " + e.what());
  }
}

inline void copy_text(char* dst, std::size_t cap, const char* src) {
  std::strncpy(dst, src, cap - 1);
  dst[cap - 1] = '\0';
}

/// The GPU side of one stream-ordered collective (client/gpu.cc): fills the
/// buffer references and the stream hand-off, then makes the stream wait.
class GpuSubmit {
 public:
  virtual ~GpuSubmit() = default;
  /// Registers (or finds) the buffers and records the event. Throws Error.
  virtual void fill(wire::Collective::Builder c, const void* send, std::uint64_t send_bytes,
                    const void* recv, std::uint64_t recv_bytes) = 0;
  /// The request went out: enqueue the caller's stream's wait for the daemon.
  virtual void sent() = 0;
  /// What releases the caller's stream if the daemon refuses the operation.
  virtual std::function<void()> on_failure() = 0;
  /// A send/recv group: registers (or finds) `bufs[i]` (pointer, bytes; 0
  /// bytes: none) and sets item i's buffer, then the group's stream hand-off.
  virtual void fill_group(wire::P2PGroup::Builder g,
                          const std::vector<std::pair<const void*, std::uint64_t>>& bufs) = 0;
};

/// client/comm.cc: ends the open group of `comm` as a stream-ordered group
/// on GPU buffers. `request` may be null; `gpu` null: only closes the group.
collective_result_t submit_gpu_group(collective_comm_t* comm, collective_request_t** request,
                                     GpuSubmit* gpu);
/// client/gpu.cc: `ptr` is device memory the CUDA driver knows (false when
/// there is no driver).
bool is_gpu_pointer(collective_client_t* client, const void* ptr);

/// client/comm.cc's submission path, for the stream-ordered calls. `request`
/// may be null (fire and forget).
collective_result_t submit_gpu_collective(collective_comm_t* comm, wire::OpKind kind,
                                          const void* send, std::uint64_t send_bytes, void* recv,
                                          std::uint64_t recv_bytes, std::size_t count,
                                          collective_dtype_t dtype, collective_redop_t redop,
                                          int root, const char* name,
                                          collective_request_t** request, GpuSubmit& gpu);
collective_client_t* comm_client(collective_comm_t* comm);
std::string comm_where(const collective_comm_t* comm);

struct GpuState;  // client/gpu.cc
class DirectComm;   // client/direct.h
class ClientStaging;  // client/staging.h
class LocalCompletion;

/// A communicator's GPU side (client/gpu.cc): decided at its first
/// stream-ordered collective.
struct CommGpu {
  std::mutex mu;
  /// 0: not yet; 1: being decided; 2: decided (at the communicator's first
  /// stream-ordered collective, through the daemon's broker).
  std::atomic<int> state{0};
  std::string path = "undecided: no stream-ordered collective yet";
  std::unique_ptr<DirectComm> direct;  ///< set: the client's own kernels run what they take
  /// Across nodes: host memory this client stages operations through (made
  /// at the first; used under the client's gpu_mutex).
  std::unique_ptr<ClientStaging> staging;
  CommGpu();
  ~CommGpu();
};
CommGpu& comm_gpu(collective_comm_t* comm);
/// A communicator was made (init or split): where it spans nodes and the
/// calling thread has a CUDA context, loads the staging kernels there
/// (client/gpu.cc). Best effort: without them the copy engines stage.
void gpu_comm_created(collective_comm_t* comm) noexcept;
/// The daemon's handle of the communicator (this rank's).
std::uint64_t comm_handle(const collective_comm_t* comm);
/// Nodes the communicator's ranks live on (0: the daemon did not say).
int comm_nodes(const collective_comm_t* comm);
/// This rank's node among them, and the lowest rank of the next node.
int comm_node(const collective_comm_t* comm);
int comm_next_node_first_rank(const collective_comm_t* comm);

/// A request for an operation the client runs itself: collective_wait and
/// collective_test poll `done` instead of waiting for a daemon's reply.
collective_request_t* new_local_request(collective_comm_t* comm, std::string what,
                                        std::unique_ptr<LocalCompletion> done);

}  // namespace collectived::client

struct collective_client {
  std::unique_ptr<collectived::client::Connection> conn;
  std::mutex buffers_mutex;
  std::map<std::uintptr_t, collectived::client::HostBuffer> buffers;  // by base address
  // GPU registrations, flag page and event pools (client/gpu.cc), made at first use.
  std::mutex gpu_mutex;
  std::shared_ptr<collectived::client::GpuState> gpu;

  /// Handle and offset of `ptr` inside a buffer from collective_host_alloc
  /// holding at least `bytes` from it. Throws Error(invalid_argument).
  std::pair<std::uint64_t, std::uint64_t> locate(const void* ptr, std::uint64_t bytes,
                                                 const char* which);
};

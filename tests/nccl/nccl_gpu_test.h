// tests/nccl/nccl_gpu_test: what the parent and the rank processes share.
#pragma once

#include "tests/nccl/test_daemon.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <string>

#include "client/nccl/nccl.h"
#include "tests/nccl/gpu_reference.h"

namespace ncclt {

constexpr int kMaxRanks = 8;
constexpr int kIdSlots = 8;

/// Anonymous shared memory, mapped before the ranks fork: the unique ids
/// (rank 0 makes them, as a launcher would hand them out), a barrier, and
/// the failure case's hand-offs.
struct Shared {
  ncclUniqueId ids[kIdSlots];
  std::atomic<int> id_ready[kIdSlots];
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  pid_t pids[kMaxRanks] = {};
  int victim = -1;
  std::atomic<int> victim_ready{0};
  std::atomic<int> submitted{0};
  std::atomic<int> victim_dead{0};
  double killed_at = 0;
};

inline double now_s() { return test_now_s(); }

/// One rank's state and its checks' bookkeeping.
struct Rank {
  Rank(Shared* shared, int r, int nranks) : sh(shared), rank(r), n(nranks) {}
  Shared* sh;
  int rank, n;
  long checks = 0, failures = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t comm = nullptr;
  void* dsend = nullptr;  // ncclMemAlloc'ed, `cap` bytes each
  void* drecv = nullptr;
  std::size_t cap = 0;
  void* dscalars = nullptr;                  // the device scalar (x3) in each type, 8 bytes apart
  ncclRedOp_t premul[2][ncclNumTypes] = {};  // [host, device][type]

  void check(bool ok, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
  /// ncclSuccess, or a failure naming `what` with ncclGetLastError.
  bool ok(ncclResult_t r, const char* what);
  /// A CUDA error ends the rank (exit 3).
  void cuda(cudaError_t e, const char* what) const;
  /// The id in `slot`: rank 0 makes it, the others wait for it.
  ncclUniqueId id(int slot);
  void barrier();
  /// The communicator's async state once every stream is idle: must be ncclSuccess.
  void settled(const char* what);
};

/// One collective call (kind, type, reduction, count, in place) against the
/// reference: client/nccl's forwarding of every collective (nccl_gpu_matrix.cc).
void check_collectives(Rank& r);
/// Groups, split, non-blocking init, InitAll, registration, refusals (nccl_gpu_calls.cc).
int rank_main(Shared* sh, int rank, int n);
/// The failure case: rank sh->victim is killed while the others wait for it.
int failure_rank(Shared* sh, int rank, int n);

}  // namespace ncclt

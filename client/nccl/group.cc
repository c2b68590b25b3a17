// Groups and point-to-point: ncclGroupStart/End (nested, per thread),
// ncclSend and ncclRecv.
//
// Collectives inside a group are submitted at once (they never block the
// caller, so nothing is gained by holding them). Sends and receives are
// collected per communicator and, at the outermost ncclGroupEnd, submitted as
// one libcollective group each (collective_group_end_stream), so that a
// rank's sends and receives of one group pair with its peers' in any order.
// A send or receive outside a group is a group of one.
#include <algorithm>
#include <string>
#include <vector>

#include "client/nccl/shim.h"

namespace collectived::client::nccl {

namespace {

struct P2P {
  bool is_send;
  void* buf;
  std::size_t count;
  collective_dtype_t dtype;
  int peer;
  cudaStream_t stream;
};

struct Pending {
  ncclComm* comm;
  std::vector<P2P> items;
};

thread_local int t_depth = 0;
thread_local ncclResult_t t_error = ncclSuccess;
thread_local std::vector<Pending> t_pending;
thread_local std::vector<ncclComm*> t_inits;  // blocking inits made in the group

/// Where one communicator's items name several streams, the group runs on
/// the first: it waits for the others' work before, and they for it after.
void join_streams(const std::vector<cudaStream_t>& streams, bool before) {
  if (streams.size() < 2) return;
  const gpu::CudaDriver& d = driver();
  auto order = [&](cudaStream_t from, cudaStream_t to) {
    cu::Event ev = nullptr;
    cuda_check(d.cuEventCreate(&ev, cu::kEventDisableTiming), "cuEventCreate");
    const cu::Result a = d.cuEventRecord(ev, reinterpret_cast<cu::Stream>(from));
    const cu::Result b =
        a == cu::kSuccess ? d.cuStreamWaitEvent(reinterpret_cast<cu::Stream>(to), ev, 0) : a;
    d.cuEventDestroy(ev);  // released once recorded work completes
    cuda_check(b, "ordering the group's streams (cuEventRecord, cuStreamWaitEvent)");
  };
  for (std::size_t i = 1; i < streams.size(); ++i) {
    if (before) {
      order(streams[i], streams[0]);
    } else {
      order(streams[0], streams[i]);
    }
  }
}

void submit_group(const Pending& p) {
  ncclComm* comm = p.comm;
  require_ready(comm);
  ContextScope scope(comm->ctx);
  std::vector<cudaStream_t> streams;
  for (const P2P& it : p.items) {
    if (std::find(streams.begin(), streams.end(), it.stream) == streams.end()) {
      streams.push_back(it.stream);
    }
  }
  for (cudaStream_t s : streams) check_stream(comm, s);
  join_streams(streams, true);
  check(collective_group_start(comm->coll));
  collective_result_t rc = COLLECTIVE_OK;
  std::string why;
  for (const P2P& it : p.items) {
    rc = it.is_send ? collective_send(comm->coll, it.buf, it.count, it.dtype, it.peer)
                    : collective_recv(comm->coll, it.buf, it.count, it.dtype, it.peer);
    if (rc != COLLECTIVE_OK) {
      why = collective_last_error();
      break;
    }
  }
  // Ended either way: libcollective has no call that drops an open group
  // (the items were checked when queued, so this is not expected).
  collective_request_t* r = nullptr;
  const collective_result_t end = collective_group_end_stream(comm->coll, streams[0], &r);
  if (rc != COLLECTIVE_OK) {
    if (r != nullptr) track(comm, r);
    throw Failure(to_nccl(rc), "on the " + comm->where() + ": " + why);
  }
  if (end != COLLECTIVE_OK) {
    throw Failure(to_nccl(end), "on the " + comm->where() + ": " + collective_last_error());
  }
  track(comm, r);
  join_streams(streams, false);
}

/// The outermost ncclGroupEnd: every communicator's sends and receives.
/// The group's communicator inits, done (each on its job thread); the first failure.
ncclResult_t finish_inits() {
  std::vector<ncclComm*> inits;
  inits.swap(t_inits);
  ncclResult_t first = ncclSuccess;
  for (ncclComm* c : inits) {
    if (c->job.joinable()) c->job.join();
    std::lock_guard lock(c->mu);
    if (first == ncclSuccess) first = c->error;
  }
  return first;
}

ncclResult_t flush() {
  std::vector<Pending> pending;
  pending.swap(t_pending);
  const ncclResult_t inits = finish_inits();
  const ncclResult_t earlier = t_error != ncclSuccess ? t_error : inits;
  t_error = ncclSuccess;
  // As NCCL: a call that failed inside the group fails the whole group,
  // and nothing of it is submitted.
  if (earlier != ncclSuccess) return earlier;
  ncclResult_t first = ncclSuccess;
  for (const Pending& p : pending) {
    const ncclResult_t rc = guarded("ncclGroupEnd", [&] {
      submit_group(p);
      return ncclSuccess;
    });
    if (first == ncclSuccess) first = rc;
  }
  return first;
}

/// Checks a send or receive when it is made (so that the group, once
/// started in libcollective, is submitted whole) and queues it.
void queue(bool is_send, void* buf, std::size_t count, ncclDataType_t dt, int peer, ncclComm* comm,
           cudaStream_t stream) {
  require_ready(comm);
  const collective_dtype_t dtype = map_dtype(dt);
  if (peer < 0 || peer >= comm->nranks) {
    throw Failure(ncclInvalidArgument,
                  "peer " + std::to_string(peer) + " is not a rank of the " + comm->where());
  }
  if (count == 0) return;  // nothing to move: both sides skip it
  if (comm->ctx != nullptr) {
    unsigned type = 0;
    const cu::Result r = driver().cuPointerGetAttribute(&type, cu::kPointerAttributeMemoryType,
                                                        reinterpret_cast<cu::DevicePtr>(buf));
    if (r != cu::kSuccess || type != cu::kMemoryTypeDevice) {
      throw Failure(ncclInvalidArgument,
                    std::string(is_send ? "sendbuff" : "recvbuff") + " is not device memory");
    }
  }
  auto it = std::find_if(t_pending.begin(), t_pending.end(),
                         [&](const Pending& p) { return p.comm == comm; });
  if (it == t_pending.end()) it = t_pending.insert(t_pending.end(), Pending{comm, {}});
  it->items.push_back({is_send, buf, count, dtype, peer, stream});
}

ncclResult_t p2p(const char* call, bool is_send, void* buf, std::size_t count, ncclDataType_t dt,
                 int peer, ncclComm* comm, cudaStream_t stream) {
  const bool alone = t_depth == 0;
  if (alone) ++t_depth;
  ncclResult_t rc = guarded(call, [&] {
    queue(is_send, buf, count, dt, peer, comm, stream);
    return ncclSuccess;
  });
  if (rc != ncclSuccess) group_failed(rc);
  if (alone) {
    --t_depth;
    const ncclResult_t end = flush();
    if (rc == ncclSuccess) rc = end;
  }
  return rc;
}

}  // namespace

bool in_group() { return t_depth > 0; }

void group_failed(ncclResult_t code) {
  if (t_depth > 0 && t_error == ncclSuccess) t_error = code;
}

void init_in_group(ncclComm* comm) { t_inits.push_back(comm); }

}  // namespace collectived::client::nccl

using namespace collectived::client::nccl;

extern "C" {

ncclResult_t ncclGroupStart(void) {
  ++t_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (t_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: no ncclGroupStart is open");
  if (--t_depth > 0) return ncclSuccess;
  return flush();
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p("ncclSend", true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p("ncclRecv", false, recvbuff, count, datatype, peer, comm, stream);
}

}  // extern "C"

namespace {

/// Gather and scatter as groups of sends and receives (the root's own
/// block is a send to itself, which libcollective's groups take).
ncclResult_t rooted(const char* call, bool gather, const void* sendbuff, void* recvbuff,
                    size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                    cudaStream_t stream) {
  const bool alone = t_depth == 0;
  ++t_depth;
  ncclResult_t rc = guarded(call, [&] {
    require_ready(comm);
    if (root < 0 || root >= comm->nranks) {
      throw Failure(ncclInvalidArgument, "root " + std::to_string(root) + " is not a rank");
    }
    const std::size_t block = count * collective_dtype_size(map_dtype(datatype));
    auto* in = static_cast<char*>(const_cast<void*>(sendbuff));
    auto* out = static_cast<char*>(recvbuff);
    if (gather) queue(true, in, count, datatype, root, comm, stream);
    for (int r = 0; comm->rank == root && r < comm->nranks; ++r) {
      char* b = (gather ? out : in) + static_cast<std::size_t>(r) * block;
      queue(!gather, b, count, datatype, r, comm, stream);
    }
    if (!gather) queue(false, out, count, datatype, root, comm, stream);
    return ncclSuccess;
  });
  if (rc != ncclSuccess) group_failed(rc);
  --t_depth;
  if (!alone) return rc;
  const ncclResult_t end = flush();
  return rc != ncclSuccess ? rc : end;
}

}  // namespace

extern "C" {

ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return rooted("ncclGather", true, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  return rooted("ncclScatter", false, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

}  // extern "C"

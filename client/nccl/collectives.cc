// The collectives: NCCL's calls onto libcollective's stream-ordered ones, and
// the requests they leave, whose answers ncclCommGetAsyncError reports.
#include <string>
#include <vector>

#include "client/nccl/shim.h"

namespace collectived::client::nccl {

namespace {

// Requests kept per communicator before a new operation waits for the
// oldest (NCCL's queue of launched work is bounded too).
constexpr std::size_t kMaxRequests = 4096;

const char* dtype_name(ncclDataType_t t) {
  switch (t) {
    case ncclFloat8e4m3:
      return "ncclFloat8e4m3";
    case ncclFloat8e5m2:
      return "ncclFloat8e5m2";
    default:
      return nullptr;
  }
}

/// The request's answer, if there is one yet; a failure becomes the
/// communicator's error (the first one stays). Frees it when answered.
bool settle(ncclComm* comm, collective_request_t* r, bool wait) {
  collective_result_t rc = COLLECTIVE_OK;
  if (wait) {
    rc = collective_wait(r, -1);
  } else {
    int done = 0;
    rc = collective_test(r, &done);
    if (rc == COLLECTIVE_OK && done == 0) return false;
  }
  if (rc != COLLECTIVE_OK) {
    const std::string message = collective_last_error();
    bool first = false;
    {
      std::lock_guard lock(comm->mu);
      if (comm->error == ncclSuccess) {
        comm->error = to_nccl(rc);
        comm->message = message;
        first = true;
      }
    }
    if (first) fail(to_nccl(rc), message);
  }
  collective_request_free(r);
  return true;
}

}  // namespace

collective_dtype_t map_dtype(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return COLLECTIVE_INT8;
    case ncclUint8:
      return COLLECTIVE_UINT8;
    case ncclInt32:
      return COLLECTIVE_INT32;
    case ncclUint32:
      return COLLECTIVE_UINT32;
    case ncclInt64:
      return COLLECTIVE_INT64;
    case ncclUint64:
      return COLLECTIVE_UINT64;
    case ncclFloat16:
      return COLLECTIVE_FLOAT16;
    case ncclBfloat16:
      return COLLECTIVE_BFLOAT16;
    case ncclFloat32:
      return COLLECTIVE_FLOAT32;
    case ncclFloat64:
      return COLLECTIVE_FLOAT64;
    default:
      break;
  }
  if (const char* name = dtype_name(t)) {
    throw Failure(ncclInvalidArgument,
                  std::string("collectived does not reduce or move ") + name +
                      " (fp8) data; supported: int8, uint8, int32, uint32, int64, uint64, "
                      "float16, bfloat16, float32, float64");
  }
  throw Failure(ncclInvalidArgument,
                "unknown ncclDataType_t " + std::to_string(static_cast<int>(t)));
}

void track(ncclComm* comm, collective_request_t* request) {
  collective_request_t* oldest = nullptr;
  {
    std::lock_guard lock(comm->mu);
    comm->requests.push_back(request);
    if (comm->requests.size() > kMaxRequests) {
      oldest = comm->requests.front();
      comm->requests.pop_front();
    }
  }
  if (oldest != nullptr) settle(comm, oldest, true);
  // Answers arrive in order on one stream: look at the oldest few only.
  for (int i = 0; i < 2; ++i) {
    collective_request_t* front = nullptr;
    {
      std::lock_guard lock(comm->mu);
      if (comm->requests.size() < 2) return;
      front = comm->requests.front();
      comm->requests.pop_front();
    }
    if (!settle(comm, front, false)) {
      std::lock_guard lock(comm->mu);
      comm->requests.push_front(front);
      return;
    }
  }
}

void reap(ncclComm* comm, bool all) {
  std::vector<collective_request_t*> pending;
  {
    std::lock_guard lock(comm->mu);
    pending.assign(comm->requests.begin(), comm->requests.end());
    comm->requests.clear();
  }
  std::vector<collective_request_t*> open;
  for (collective_request_t* r : pending) {
    if (!settle(comm, r, all)) open.push_back(r);
  }
  std::lock_guard lock(comm->mu);
  comm->requests.insert(comm->requests.begin(), open.begin(), open.end());
}

void drop_requests(ncclComm* comm) {
  std::deque<collective_request_t*> pending;
  {
    std::lock_guard lock(comm->mu);
    pending.swap(comm->requests);
  }
  for (collective_request_t* r : pending) collective_request_free(r);
}

void submit(ncclComm* comm, const Coll& c) {
  ContextScope scope(comm->ctx);
  check_stream(comm, c.stream);
  collective_comm_t* k = comm->coll;
  collective_request_t* r = nullptr;
  collective_result_t rc = COLLECTIVE_OK;
  switch (c.kind) {
    case Kind::all_reduce:
      rc = collective_all_reduce_stream(k, c.send, c.recv, c.count, c.dtype, c.redop, c.stream, &r);
      break;
    case Kind::broadcast:
      rc = collective_broadcast_stream(k, c.send, c.recv, c.count, c.dtype, c.root, c.stream, &r);
      break;
    case Kind::reduce:
      rc = collective_reduce_stream(k, c.send, c.recv, c.count, c.dtype, c.redop, c.root, c.stream,
                                    &r);
      break;
    case Kind::all_gather:
      rc = collective_all_gather_stream(k, c.send, c.recv, c.count, c.dtype, c.stream, &r);
      break;
    case Kind::reduce_scatter:
      rc = collective_reduce_scatter_stream(k, c.send, c.recv, c.count, c.dtype, c.redop, c.stream,
                                            &r);
      break;
    case Kind::all_to_all:
      rc = collective_all_to_all_stream(k, c.send, c.recv, c.count, c.dtype, c.stream, &r);
      break;
  }
  if (rc != COLLECTIVE_OK) {
    throw Failure(to_nccl(rc),
                  std::string("on the ") + comm->where() + ": " + collective_last_error());
  }
  track(comm, r);
}

namespace {

collective_redop_t map_op(ncclRedOp_t op) {
  switch (op) {
    case ncclSum:
      return COLLECTIVE_SUM;
    case ncclProd:
      return COLLECTIVE_PROD;
    case ncclMax:
      return COLLECTIVE_MAX;
    case ncclMin:
      return COLLECTIVE_MIN;
    case ncclAvg:
      return COLLECTIVE_AVG;
    default:
      break;
  }
  throw Failure(ncclInvalidArgument,
                "reduction " + std::to_string(static_cast<int>(op)) +
                    " is neither a built-in one nor one of this communicator's "
                    "ncclRedOpCreatePreMulSum");
}

/// One collective call: checks, then the plain or the PreMulSum path. A
/// group needs nothing more: collectives are submitted at once and never
/// block the caller.
ncclResult_t run(const char* call, ncclComm* comm, Coll c, ncclDataType_t dt, ncclRedOp_t op,
                 bool reducing) {
  ncclResult_t rc = guarded(call, [&] {
    require_ready(comm);
    c.dtype = map_dtype(dt);
    if (c.root < 0 || c.root >= comm->nranks) {
      throw Failure(ncclInvalidArgument,
                    "root " + std::to_string(c.root) + " is not a rank of the " + comm->where());
    }
    if (c.count == 0) return ncclSuccess;  // as NCCL: nothing to move, nothing submitted
    if (reducing && is_premul(op)) {
      submit_premul(comm, op, c);
    } else {
      c.redop = reducing ? map_op(op) : COLLECTIVE_SUM;
      submit(comm, c);
    }
    return ncclSuccess;
  });
  if (rc != ncclSuccess) group_failed(rc);
  return rc;
}

}  // namespace

}  // namespace collectived::client::nccl

using namespace collectived::client::nccl;

extern "C" {

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return run("ncclAllReduce", comm,
             {Kind::all_reduce, sendbuff, recvbuff, count, {}, {}, 0, stream}, datatype, op, true);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return run("ncclBroadcast", comm,
             {Kind::broadcast, sendbuff, recvbuff, count, {}, {}, root, stream}, datatype, ncclSum,
             false);
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return run("ncclBcast", comm, {Kind::broadcast, buff, buff, count, {}, {}, root, stream},
             datatype, ncclSum, false);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return run("ncclReduce", comm, {Kind::reduce, sendbuff, recvbuff, count, {}, {}, root, stream},
             datatype, op, true);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return run("ncclAllGather", comm,
             {Kind::all_gather, sendbuff, recvbuff, sendcount, {}, {}, 0, stream}, datatype,
             ncclSum, false);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return run("ncclReduceScatter", comm,
             {Kind::reduce_scatter, sendbuff, recvbuff, recvcount, {}, {}, 0, stream}, datatype, op,
             true);
}

// `count` elements to each peer, as libcollective's all-to-all counts them.
ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return run("ncclAlltoAll", comm, {Kind::all_to_all, sendbuff, recvbuff, count, {}, {}, 0, stream},
             datatype, ncclSum, false);
}

}  // extern "C"

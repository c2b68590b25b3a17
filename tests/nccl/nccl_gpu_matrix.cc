// Every collective of NCCL's API x every type x every reduction x counts 0,
// 1, 1001 and 1<<20, out of place (on the rank's stream) and in place (on
// the legacy default stream), each checked element by element against the
// reference. Large counts run the sum and the device-scalar PreMulSum in
// every type, and every reduction in float32.
#include <algorithm>
#include <vector>

#include "tests/nccl/nccl_gpu_test.h"

namespace ncclt {

namespace {

enum class Kind { all_reduce, broadcast, bcast, reduce, all_gather, reduce_scatter, all_to_all };
constexpr Kind kKinds[] = {Kind::all_reduce, Kind::broadcast,      Kind::bcast,     Kind::reduce,
                           Kind::all_gather, Kind::reduce_scatter, Kind::all_to_all};
constexpr std::size_t kCounts[] = {0, 1, 1001, std::size_t{1} << 20};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::all_reduce:
      return "ncclAllReduce";
    case Kind::broadcast:
      return "ncclBroadcast";
    case Kind::bcast:
      return "ncclBcast";
    case Kind::reduce:
      return "ncclReduce";
    case Kind::all_gather:
      return "ncclAllGather";
    case Kind::reduce_scatter:
      return "ncclReduceScatter";
    case Kind::all_to_all:
      return "ncclAlltoAll";
  }
  return "?";
}

bool reducing(Kind k) {
  return k == Kind::all_reduce || k == Kind::reduce || k == Kind::reduce_scatter;
}

struct Case {
  Kind kind;
  ncclDataType_t type;
  Op op;
  std::size_t count;
  bool in_place;
  int root;
};

/// Elements each rank sends and receives.
std::size_t in_elems(const Case& c, int n) {
  return c.kind == Kind::reduce_scatter || c.kind == Kind::all_to_all ? c.count * n : c.count;
}
std::size_t out_elems(const Case& c, int n) {
  return c.kind == Kind::all_gather || c.kind == Kind::all_to_all ? c.count * n : c.count;
}

/// What rank r puts at input index i, and the result expected at output index i.
double input(const Case& c, int r, std::size_t i) { return value(c.op, r, i); }
double output(const Case& c, int rank, int n, std::size_t i) {
  switch (c.kind) {
    case Kind::all_reduce:
    case Kind::reduce:
      return expected(c.type, c.op, n, i);
    case Kind::reduce_scatter:
      return expected(c.type, c.op, n, rank * c.count + i);
    case Kind::broadcast:
    case Kind::bcast:
      return value(c.op, c.root, i);
    case Kind::all_gather:
      return value(c.op, static_cast<int>(i / c.count), i % c.count);
    case Kind::all_to_all:
      return value(c.op, static_cast<int>(i / c.count), rank * c.count + i % c.count);
  }
  return 0;
}

ncclRedOp_t nccl_op(const Rank& r, ncclDataType_t t, Op op) {
  switch (op) {
    case Op::sum:
      return ncclSum;
    case Op::prod:
      return ncclProd;
    case Op::min:
      return ncclMin;
    case Op::max:
      return ncclMax;
    case Op::avg:
      return ncclAvg;
    case Op::premul_host:
      return r.premul[0][t];
    case Op::premul_device:
      return r.premul[1][t];
  }
  return ncclSum;
}

ncclResult_t call(Rank& r, const Case& c, char* send, char* recv) {
  const ncclRedOp_t op = nccl_op(r, c.type, c.op);
  cudaStream_t s = c.in_place ? nullptr : r.stream;
  switch (c.kind) {
    case Kind::all_reduce:
      return ncclAllReduce(send, recv, c.count, c.type, op, r.comm, s);
    case Kind::broadcast:
      return ncclBroadcast(send, recv, c.count, c.type, c.root, r.comm, s);
    case Kind::bcast:
      return ncclBcast(recv, c.count, c.type, c.root, r.comm, s);
    case Kind::reduce:
      return ncclReduce(send, recv, c.count, c.type, op, c.root, r.comm, s);
    case Kind::all_gather:
      return ncclAllGather(send, recv, c.count, c.type, r.comm, s);
    case Kind::reduce_scatter:
      return ncclReduceScatter(send, recv, c.count, c.type, op, r.comm, s);
    case Kind::all_to_all:
      return ncclAlltoAll(send, recv, c.count, c.type, r.comm, s);
  }
  return ncclInternalError;
}

void run_case(Rank& r, const Case& c, std::vector<char>& host) {
  const std::size_t es = host_type_size(c.type);
  const std::size_t in_n = in_elems(c, r.n), out_n = out_elems(c, r.n);
  // In place: the input where NCCL wants it inside the output buffer.
  char* recv = static_cast<char*>(r.drecv);
  char* send = c.in_place ? recv : static_cast<char*>(r.dsend);
  if (c.in_place && c.kind == Kind::all_gather) send = recv + r.rank * c.count * es;
  if (c.in_place && c.kind == Kind::reduce_scatter) recv = send + r.rank * c.count * es;
  for (std::size_t i = 0; i < in_n; ++i) host_store(c.type, host.data(), i, input(c, r.rank, i));
  // Stale results must not pass: the output is poisoned first.
  const std::size_t poison = (c.in_place ? std::max(in_n, out_n) : out_n) * es;
  r.cuda(cudaMemset(r.drecv, 0x5a, poison), "cudaMemset");
  r.cuda(cudaMemcpy(send, host.data(), in_n * es, cudaMemcpyHostToDevice), "cudaMemcpy in");
  r.cuda(cudaDeviceSynchronize(), "the upload");  // pageable copies return before landing
  char label[160];
  std::snprintf(label, sizeof label, "%s %s %s count %zu %s root %d", kind_name(c.kind),
                type_name(c.type), reducing(c.kind) ? op_name(c.op) : "-", c.count,
                c.in_place ? "in place (legacy stream)" : "out of place", c.root);
  if (!r.ok(call(r, c, send, recv), label)) return;
  r.cuda(cudaStreamSynchronize(r.stream), label);
  r.cuda(cudaDeviceSynchronize(), label);
  r.settled(label);
  if (c.count == 0) return;
  if (c.kind == Kind::reduce && r.rank != c.root) return;  // no output off the root
  r.cuda(cudaMemcpy(host.data(), recv, out_n * es, cudaMemcpyDeviceToHost), "cudaMemcpy out");
  std::size_t bad = out_n;
  for (std::size_t i = 0; i < out_n && bad == out_n; ++i) {
    if (!close_enough(c.type, host_load(c.type, host.data(), i), output(c, r.rank, r.n, i))) bad = i;
  }
  r.check(bad == out_n, "%s: element %zu is %g, want %g", label, bad,
          bad < out_n ? host_load(c.type, host.data(), bad) : 0.0,
          bad < out_n ? output(c, r.rank, r.n, bad) : 0.0);
}

bool wanted(const Case& c) {
  if (c.count < (std::size_t{1} << 20)) return true;
  // Large: sum and device PreMulSum in every type, every reduction in float32.
  if (c.type == ncclFloat32) return true;
  return !c.in_place && (c.op == Op::sum || c.op == Op::premul_device);
}

}  // namespace

void check_collectives(Rank& r) {
  std::vector<char> host(r.cap);
  long cases = 0;
  const double t0 = now_s();
  for (Kind k : kKinds) {
    for (ncclDataType_t t : kTypes) {
      for (Op op : kOps) {
        if (!reducing(k) && op != Op::sum) continue;
        for (std::size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            if (k == Kind::bcast && !in_place) continue;  // ncclBcast is in place
            const Case c{k, t, op, count, in_place, in_place ? 0 : r.n - 1};
            if (!wanted(c)) continue;
            run_case(r, c, host);
            ++cases;
          }
        }
      }
    }
    if (r.rank == 0) {
      std::printf("rank 0: %s done (%ld cases so far, %.1f s)\n", kind_name(k), cases,
                  now_s() - t0);
      std::fflush(stdout);
    }
  }
}

}  // namespace ncclt

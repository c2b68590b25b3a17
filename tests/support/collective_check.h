// Collectives checked against a reference computed here, from client
// processes: the data, the reference semantics (client/collective.h,
// engine/reduce.h) and the rank-side helpers of the integration tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "client/collective.h"
#include "tests/support/reference.h"

namespace collectived::test {

extern const collective_dtype_t kDTypes[10];
extern const collective_redop_t kRedOps[5];
extern const std::size_t kCounts[5];

enum class Op { all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all };
extern const Op kOps[6];
const char* name(Op op);
bool reducing(Op op);

/// A rank in a child process.
struct RankCtx {
  collective_client_t* client = nullptr;
  collective_comm_t* comm = nullptr;
  int rank = 0, n = 0;
  char* send = nullptr;
  char* recv = nullptr;
  std::size_t bytes = 0;
  int failures = 0;
  /// Floating-point sums, products and averages are compared within a bound
  /// instead of bit for bit: across nodes the reduction order is the
  /// hierarchical one (engine/node_algorithms.h), not rank order.
  bool tolerant = false;

  void report(const std::string& what);
};

/// Runs one case on this rank and checks its output (failures are reported).
void run_case(RankCtx& c, Op op, collective_dtype_t d, collective_redop_t redop, std::size_t count,
              bool in_place, int root, std::uint64_t salt);
/// Every operation x dtype x reduction x count x in-place, then a barrier.
void run_matrix(RankCtx& c);
/// Connects, joins `id` as `rank` of `n`, allocates buffers. Exits the child on failure.
RankCtx join(const std::string& socket, const collective_unique_id_t& id, int n, int rank,
             std::size_t bytes);
/// A fresh unique id from the daemon at `socket` (it runs the rendezvous).
collective_unique_id_t new_id(const std::string& socket);
class RawClient;
/// A communicator of one rank made by `raw` (CommInit, request `id`) on the
/// daemon at `socket`; returns its handle.
std::uint64_t raw_comm_of_one(RawClient& raw, const std::string& socket, std::uint64_t id);
/// raw_comm_of_one (request `id`), then a sealed memfd of `bytes` registered
/// by `raw` (request `id` + 1; the daemon keeps its own descriptor).
struct RawCommMemory {
  std::uint64_t comm = 0;
  std::uint64_t handle = 0;  // of the registration
};
RawCommMemory raw_comm_with_memory(RawClient& raw, const std::string& socket, std::uint64_t id,
                                   std::size_t bytes);
/// Runs `body(rank)` in `n` child processes; checks every one exits 0.
void run_ranks(int n, const std::function<int(int)>& body,
               std::chrono::milliseconds timeout = std::chrono::seconds(120));
/// Message check helper inside children.
bool contains(const char* text, const std::string& part);

}  // namespace collectived::test

// A communicator as this daemon holds it: its members, their queues of work
// in submission order, and one Slot per sequence number that collects the
// ranks' submissions of a collective (matching). State only: the engine
// (engine_core.h) changes it with its mutex held.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/node_algorithms.h"
#include "engine/node_run.h"
#include "engine/op.h"

namespace collectived::engine {

namespace gpu {
class GpuStage;  // engine/gpu/executor.h
}

namespace detail {

struct Inbox;     // engine/node_inbox.h
struct Executor;  // engine/node_executor.h

/// What every rank of a collective must agree on.
struct Desc {
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  RedOp redop = RedOp::sum;
  std::uint64_t count = 0;
  int root = -1;

  bool gpu = false;  // on GPU buffers, stream-ordered (engine/gpu/)

  /// Across nodes a GPU rank and a host rank agree (the GPU side is staged
  /// through host memory, and other nodes' messages do not carry the flag);
  /// local ranks must also agree on `gpu` (submit_slot checks it).
  bool operator==(const Desc& o) const {
    return kind == o.kind && dtype == o.dtype && redop == o.redop && count == o.count &&
           root == o.root;
  }

  /// "all_reduce(count=..., dtype=..., op=...)" (errors, status).
  std::string str() const;
};

struct Delivery {
  std::shared_ptr<CompletionSink> sink;
  std::uint64_t request;
  Result result;
};

/// One rank's share of a collective.
struct Part {
  bool present = false;  // submitted and still waiting for the result
  std::uint64_t request = 0;
  std::shared_ptr<CompletionSink> sink;
  std::uint64_t session = 0;
  pid_t pid = 0;
  Span send, recv;
  int color = 0, key = 0;  // comm_split
  std::shared_ptr<gpu::RankSync> gpu_sync;  // GPU collectives
};

/// One sequence number of a communicator.
struct Slot {
  std::uint64_t seq = 0;
  Desc desc;
  bool has_desc = false;
  int desc_rank = -1;
  std::vector<Part> parts;
  int arrived = 0;  // ranks that submitted this seq (including failed submissions)
  /// The earliest of its submissions' deadlines (Impl::note_deadline).
  Clock::time_point deadline;
  /// The client timeout that gave `deadline`, and whose it is (errors name
  /// them); 0: the node's deadlines.operation_ms.
  std::chrono::milliseconds timeout{0};
  int timeout_rank = -1;
  Clock::time_point created;  // first submission (status, metrics)
  bool failed = false;
  Result failure;
  bool started = false;
  /// GPU buffers on a communicator spanning nodes: the pinned host staging
  /// the host collective runs on (engine/gpu/executor.h).
  std::shared_ptr<gpu::GpuStage> gpu_stage;
  /// When its copies to the host were queued, when they were done, and when
  /// the host collective began on the node thread (the debug log's
  /// gpu_staged event).
  Clock::time_point stage_queued, staged_in, across_started;
  /// Across nodes: the algorithm options when its description was set (the
  /// first local rank's submission), and the plan they give it (run.plan),
  /// which every other node's messages for it must carry too
  /// (check_remote_desc).
  std::shared_ptr<const NodeAlgorithmOptions> algorithms;
  NodeRun run;
};

struct P2PItem {
  bool is_send = false;
  int peer = 0;
  Span span;
  std::uint64_t count = 0;
  DType dtype = DType::uint8;
  std::uint64_t index = 0;  // k-th send/recv between this pair of ranks
  bool started = false;
  // GPU groups, peer on another node: the item runs on pinned host staging
  // (the executor's copies); `span` is the staging once `staged`.
  std::shared_ptr<gpu::GpuStage> gpu_stage;
  bool staging = false;
  bool staged = false;
  bool ready = false;  // the executor reached the rank's ready word (stage_in done)
};

struct Group {
  int rank = 0;
  std::uint64_t seq = 0;
  std::uint64_t request = 0;
  std::shared_ptr<CompletionSink> sink;
  std::vector<P2PItem> items;
  std::size_t done = 0;
  bool failed = false;
  bool answered = false;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};  // the rank's own, which gave `deadline` (0: the node's)
  Clock::time_point created;  // submission (status, metrics)
  /// A stream-ordered group on GPU buffers: the client's stream is released
  /// (from the CPU) when the last holder drops it, after every item's GPU work.
  std::shared_ptr<gpu::RankSync> gpu_sync;
};

struct Work {
  enum class Type { slot, group, leave } type;
  std::uint64_t seq = 0;              // slot
  std::shared_ptr<Group> group;       // group
  std::uint64_t request = 0;          // leave
  std::shared_ptr<CompletionSink> sink;  // leave
};

struct Member {
  int rank = 0;
  std::uint64_t session = 0;
  pid_t pid = 0;
  std::uint64_t handle = 0;
  bool active = true;  // false once left, aborted or dead
  bool remote = false;  // lives on another node (no session, no queue here)
  std::uint64_t next_seq = 0;
  std::deque<Work> queue;  // this rank's operations in submission order
};

struct Comm {
  std::string name;
  /// This daemon's number for it, never reused (Engine::comm_shape's id).
  std::uint64_t serial = 0;
  int nranks = 0;
  // Communicators that span nodes ("" and one node otherwise).
  std::string uid;                        // the same on every node
  std::vector<int> node_of_rank;          // rank -> node index
  std::vector<std::string> node_address;  // node index -> rendezvous address
  std::vector<std::string> node_name;
  int my_node = 0;
  int local_count = 0;
  std::shared_ptr<Inbox> inbox;
  std::shared_ptr<Executor> exec;
  std::uint64_t broken_floor = 0;  // once broken: operations from this seq on fail
  std::set<std::uint64_t> ended;  // seqs done here: late messages for them are dropped
  std::uint64_t ended_floor = 0;  // every seq below it is done

  bool spans_nodes() const { return node_address.size() > 1; }
  bool is_ended(std::uint64_t seq) const { return seq < ended_floor || ended.count(seq) != 0; }
  void end(std::uint64_t seq) {
    ended.insert(seq);
    while (ended.count(ended_floor) != 0) ended.erase(ended_floor++);
  }
  std::string node_text(int node) const {
    return node_name[node] + " (" + node_address[node] + ")";
  }
  std::vector<Member> members;
  std::map<std::uint64_t, Slot> slots;
  std::map<std::pair<int, int>, std::uint64_t> sends, recvs;  // (from, to) -> next index
  std::uint64_t next_group_seq = 0;
  std::optional<Result> broken;

  std::string where(int rank) const {
    return "communicator " + name + " (rank " + std::to_string(rank) + " of " +
           std::to_string(nranks) + ")";
  }
  std::string who(int rank) const {
    std::string s = "rank " + std::to_string(rank) + " (pid " + std::to_string(members[rank].pid);
    if (spans_nodes()) s += " on node " + node_name[node_of_rank[rank]];
    return s + ")";
  }
  int active_members() const {
    int n = 0;
    for (const auto& m : members) n += m.active ? 1 : 0;
    return n;
  }
};

/// Two ranks' descriptions of sequence number `seq` differ: the mismatch
/// error, naming both (whoever reads either rank's error sees the pair).
std::string desc_mismatch(const Comm& comm, std::uint64_t seq, int rank_a, const Desc& a,
                          int rank_b, const Desc& b);
/// A send and its matching receive disagree on the bytes: the mismatch error.
std::string p2p_mismatch(int from, std::uint64_t send_count, DType send_dtype, int to,
                         std::uint64_t recv_count, DType recv_dtype);
/// A node's plan for an operation against another node's (NodePlan): the
/// mismatch error.
std::string plan_mismatch(const Comm& comm, std::uint64_t seq, const Desc& desc,
                          const NodePlan& mine, int node, const NodePlan& theirs);
/// "rank 3" or "ranks 2, 3": the ranks of `comm` on node `node`.
std::string ranks_text(const Comm& comm, int node);
/// "0123..." of the first `n` bytes.
std::string hex_prefix(const std::string& bytes, std::size_t n);
/// "0, 2, 5".
std::string rank_list(const std::vector<int>& ranks);

}  // namespace detail

using namespace detail;

}  // namespace collectived::engine

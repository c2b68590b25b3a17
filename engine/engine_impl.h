// The engine's private state (engine/engine.h's Impl), shared by engine.cc
// (requests, matching, local execution) and engine_nodes.cc (communicators
// that span nodes). Not a public header.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "engine/engine.h"
#include "engine/fiber.h"
#include "engine/gpu/executor.h"
#include "engine/node_algorithms.h"
#include "engine/plan.h"
#include "engine/transport/transport.h"
#include "engine/worker_pool.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine {

namespace detail {

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

  std::string str() const {
    std::string s(to_string(kind));
    if (kind == OpKind::barrier || kind == OpKind::split) return s;
    s += "(count=" + std::to_string(count) + ", dtype=" + std::string(to_string(dtype));
    if (kind == OpKind::all_reduce || kind == OpKind::reduce || kind == OpKind::reduce_scatter) {
      s += ", op=" + std::string(to_string(redop));
    }
    if (kind == OpKind::broadcast || kind == OpKind::reduce) s += ", root=" + std::to_string(root);
    if (gpu) s += ", on GPU buffers";
    return s + ")";
  }
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
  /// first local rank's submission), and the plan they give it, which every
  /// other node's messages for it must carry too (check_remote_desc).
  std::shared_ptr<const NodeAlgorithmOptions> algorithms;
  NodePlan plan;
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

/// What other nodes sent for a communicator, before this node's operation
/// takes it. All under Impl::mu.
struct NodeIn {
  NodePayload payload;
  Desc desc;
  int desc_rank = 0;
  std::uint64_t count = 0;  // p2p
  DType dtype = DType::uint8;
  NodePlan plan;              // collectives: the sender's (not known: none sent)
  Clock::time_point arrived;  // status: how long other nodes have waited on this node
};

struct Executor;
struct Inbox {
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, NodeIn> msgs;  // (seq, tag, from node)
  /// Receive buffers operations posted for messages not here yet (same key).
  struct Posted {
    std::byte* dest = nullptr;
    std::size_t bytes = 0;
    /// Handed to the transport when it places the message (then `claimed`);
    /// its release wakes the operation (EngineChannel::retract).
    std::shared_ptr<void> token;
    bool claimed = false;
  };
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, Posted> posted;
  std::map<std::tuple<int, int, std::uint64_t>, NodeIn> p2p;  // (from rank, to rank, index)
  std::map<std::uint64_t, Result> failed;  // seq -> why it failed on another node
  std::optional<Result> broken;
  std::uint64_t bytes = 0;
  Clock::time_point expires;  // an inbox whose communicator never appears
  bool claimed = false;       // a communicator of this node uses it
  /// The executor of the communicator using it: woken when something arrives.
  std::weak_ptr<Executor> exec;
};
struct Comm;
using InboxRef = std::pair<std::shared_ptr<Inbox>, std::weak_ptr<Comm>>;

/// Where operations between nodes run: the node thread. The daemon sets
/// `post` to its event loop (the thread that reads the peer sockets), so that
/// a chunk that arrives is reduced and forwarded on the thread that read it;
/// without `post` (tests) the runner starts a thread of its own. Shared with
/// every executor and the callbacks that wake them, so that a late callback
/// finds it stopped rather than a destroyed engine.
struct NodeRunner {
  std::function<void(std::function<void()>)> post;  // set once, before serving
  /// Called by the own thread when idle for 20 ms (deadline checks).
  std::function<void()> idle;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  std::thread thread;

  /// Runs `f` later on the node thread (never inline).
  void run(std::function<void()> f);
  /// Stops and joins the own thread; later run() calls are dropped.
  void shut();
};

/// Runs a communicator's operations that span nodes, one after another, in a
/// fiber (engine/fiber.h) on the node thread. They block on other nodes: a
/// blocked operation yields the thread, so it never holds up another
/// communicator, the event loop or the worker pool.
struct Executor {
  std::shared_ptr<NodeRunner> runner;
  std::string comm;  // the communicator's name, for the log
  std::mutex mu;  // guards jobs
  std::deque<std::function<void()>> jobs;
  /// Set when a wake-up is queued on the node thread (at most one at a time).
  std::atomic<bool> wake_posted{false};
  // Node thread only:
  std::unique_ptr<Fiber> fiber;  // running the jobs
  /// The stack of the last fiber, for the next one: a fiber lasts while jobs
  /// are queued, so one operation at a time would map a stack each.
  FiberStack spare_stack;
  bool waiting = false;          // the fiber yielded in wait()
  Clock::time_point resumed_at;  // when the fiber last got the thread
  /// Scratch memory of the operations (NodeChannel::scratch).
  std::shared_ptr<MessageBytes> scratch;

  /// From any thread: resumes the fiber (or starts the next job) soon, on the
  /// node thread. Cheap when already queued.
  static void wake(const std::shared_ptr<Executor>& ex);
  /// From inside the executor's fiber: gives the node thread back until
  /// wake() (a message, a send done, a deadline sweep). Spurious returns
  /// happen: the caller re-checks what it waits for.
  static void wait(Executor& ex);
  /// On the node thread: resumes the fiber, or starts one for queued jobs.
  static void drive(const std::shared_ptr<Executor>& ex);
  /// From inside the fiber: gives the thread to the other handlers of the
  /// event loop (clients, heartbeats, other communicators) if it has held it
  /// for more than a few milliseconds, then goes on.
  static void take_turns(const std::shared_ptr<Executor>& ex);
  /// From inside the fiber: gives the thread to the handlers queued on it
  /// before this call (a send posted to the transport), then goes on.
  static void yield(const std::shared_ptr<Executor>& ex);
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

struct Joiner {
  ClientRef client;             // local joiners
  std::uint64_t request = 0;
  std::string address;          // remote joiners: their daemon ("" = this one)
  std::string node;             // remote joiners: their node name
  pid_t pid = 0;
};

/// A rank of this node waiting for another node's rendezvous daemon.
struct PendingJoin {
  ClientRef client;
  std::uint64_t request = 0;
  std::string id;
  std::string rendezvous;
  std::uint32_t nranks = 0;
  std::uint32_t rank = 0;
  Clock::time_point deadline;
};

struct Rendezvous {
  std::string name;
  int nranks = 0;
  std::vector<std::optional<Joiner>> joined;
  int count = 0;
  Clock::time_point started;
  Clock::time_point deadline;
};

inline std::string hex_prefix(const std::string& bytes, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < std::min(n, bytes.size()); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace detail

using namespace detail;

struct Engine::Impl {
  EngineOptions options;
  Registry& registry;
  Logger& log;
  mutable std::mutex mu;
  std::uint64_t comm_serial = 0;  // the last Comm::serial given (under mu)
  std::map<std::string, Rendezvous> rendezvous;
  std::map<std::uint64_t, std::pair<std::shared_ptr<Comm>, int>> handles;  // handle -> (comm, rank)
  std::uint64_t next_handle = 1;
  std::uint64_t completed = 0;
  bool stopping = false;
  gpu::GpuExecutor* gpu = nullptr;  // collectives on GPU buffers (engine/gpu/)
  // Communicators that span nodes.
  std::atomic<NodeTransport*> transport{nullptr};
  /// The profile's, replaced whole on reload (Engine::set_node_algorithms):
  /// each operation across nodes keeps the one it was submitted under
  /// (Slot::algorithms), so that a reload while it runs cannot change its
  /// algorithm halfway or race its reads.
  std::shared_ptr<const NodeAlgorithmOptions> algorithms =
      std::make_shared<const NodeAlgorithmOptions>();
  std::map<std::string, InboxRef> inboxes;  // uid -> inbox and the communicator using it
  std::multimap<std::string, PendingJoin> pending_joins;  // key (id@rendezvous) -> ranks
  std::shared_ptr<NodeRunner> runner = std::make_shared<NodeRunner>();
  std::vector<std::weak_ptr<Executor>> executors;  // every one made (pruned when woken)
  // Declared last: destroyed first, so its threads are joined (and their
  // tasks, which call back into this Impl, are done) before anything else goes.
  WorkerPool pool;

  Impl(EngineOptions o, Registry& r, Logger& l)
      : options(std::move(o)), registry(r), log(l), pool(options.worker_threads) {
    // The own node thread (no runner set) sweeps deadlines itself.
    runner->idle = [this] {
      std::lock_guard lock(mu);
      wake_executors();
    };
  }
  /// Stops the executors of communicators that span nodes (engine_nodes.cc).
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // ---- helpers (all with mu held) -------------------------------------------

  std::pair<std::shared_ptr<Comm>, int> resolve(const ClientRef& client, std::uint64_t handle) {
    auto it = handles.find(handle);
    if (it == handles.end()) {
      throw Error(Code::not_found, "unknown communicator handle " + std::to_string(handle) +
                                       " (never created, destroyed, or aborted)");
    }
    auto& [comm, rank] = it->second;
    if (comm->members[rank].session != client.session) {
      throw Error(Code::permission_denied,
                  "communicator handle " + std::to_string(handle) + " belongs to another client");
    }
    return it->second;
  }

  /// resolve(), or an error answer naming `what` (then the pointer is null).
  std::pair<std::shared_ptr<Comm>, int> resolve_or_answer(const ClientRef& client,
                                                          std::uint64_t request,
                                                          std::uint64_t handle,
                                                          std::string_view what,
                                                          std::vector<Delivery>& out) {
    try {
      return resolve(client, handle);
    } catch (const Error& e) {
      out.push_back({client.sink, request, error(e.code(), std::string(what) + ": " + e.what())});
      return {nullptr, 0};
    }
  }

  Span resolve_span(const ClientRef& client, const BufferArg& b, std::uint64_t bytes,
                    const char* which) {
    if (bytes == 0) return {};
    try {
      auto reg = registry.find_range(client.session, b.handle, b.offset, bytes);
      std::byte* p = reg->data() + b.offset;
      return Span{std::move(reg), p, bytes};
    } catch (const Error& e) {
      throw Error(e.code(), std::string(which) + " buffer: " + e.what());
    }
  }

  Result error(Code code, std::string message, std::uint64_t seq = 0) {
    Result r;
    r.code = code;
    r.message = std::move(message);
    r.seq = seq;
    return r;
  }

  /// How long an operation may wait to start after a submission: the
  /// client's own timeout, else the node's. Capped so that now + it cannot
  /// overflow the clock.
  std::chrono::milliseconds budget(std::chrono::milliseconds client) const {
    constexpr std::chrono::milliseconds kMax{std::int64_t{1} << 40};  // ~35 years
    return client.count() > 0 ? std::min(client, kMax) : options.operation_deadline;
  }

  /// A submission of `rank` at `now`: the slot's deadline becomes the earliest
  /// of its submissions' (each rank may have set its own timeout).
  void note_deadline(Slot& slot, bool fresh, Clock::time_point now,
                     std::chrono::milliseconds client, int rank) const {
    const Clock::time_point d = now + budget(client);
    if (!fresh && d >= slot.deadline) return;
    slot.deadline = d;
    slot.timeout = client.count() > 0 ? budget(client) : std::chrono::milliseconds(0);
    slot.timeout_rank = client.count() > 0 ? rank : -1;
  }

  /// An expired deadline as errors name it: the node's as it always was,
  /// "30000 ms (deadlines.operation_ms)"; a client's with whose it is.
  std::string deadline_text(std::chrono::milliseconds client, int rank) const {
    const std::string node = std::to_string(options.operation_deadline.count());
    if (client.count() <= 0) return node + " ms (deadlines.operation_ms)";
    return std::to_string(client.count()) + " ms (the operation's timeout, set by rank " +
           std::to_string(rank) + "; deadlines.operation_ms is " + node + ")";
  }

  void remove_work(Member& m, const std::function<bool(const Work&)>& pred) {
    m.queue.erase(std::remove_if(m.queue.begin(), m.queue.end(), pred), m.queue.end());
  }

  // ---- metrics (EngineOptions::observer) ----------------------------------------

  void observe_slot(const Comm& comm, const Slot& slot, Code code) {
    if (options.observer == nullptr) return;
    const Desc& d = slot.desc;
    std::uint64_t bytes = d.count * dtype_size(d.dtype);
    if (d.kind == OpKind::all_gather || d.kind == OpKind::reduce_scatter ||
        d.kind == OpKind::all_to_all) {
      bytes *= static_cast<std::uint64_t>(comm.nranks);
    } else if (d.kind == OpKind::barrier || d.kind == OpKind::split) {
      bytes = 0;
    }
    // In-node operations are copies between clients; spanning ones use the peer links.
    options.observer->operation_finished(d.kind, code, bytes, Clock::now() - slot.created,
                                         comm.spans_nodes() ? "tcp" : "local");
  }

  void observe_group(const Comm& comm, const Group& g, Code code) {
    if (options.observer == nullptr) return;
    std::uint64_t bytes = 0;
    for (const auto& item : g.items) {
      if (item.is_send) bytes += item.count * dtype_size(item.dtype);
    }
    options.observer->operation_finished(OpKind::p2p, code, bytes, Clock::now() - g.created,
                                         comm.spans_nodes() ? "tcp" : "local");
  }

  void fail_slot(Comm& comm, Slot& slot, Code code, const std::string& reason,
                 std::vector<Delivery>& out) {
    if (!slot.failed) observe_slot(comm, slot, code);
    slot.failed = true;
    slot.failure = error(code, reason, slot.seq);
    for (int r = 0; r < comm.nranks; ++r) {
      Part& part = slot.parts[r];
      if (!part.present) continue;
      part.present = false;
      Result res = slot.failure;
      res.message = std::string(to_string(slot.desc.kind)) + " (seq " + std::to_string(slot.seq) +
                    ") on " + comm.where(r) + ": " + reason;
      out.push_back({part.sink, part.request, std::move(res)});
      part.send = {};
      part.recv = {};
      part.gpu_sync.reset();  // releases the client's stream (its flag is written)
      remove_work(comm.members[r], [&](const Work& w) {
        return w.type == Work::Type::slot && w.seq == slot.seq;
      });
    }
  }

  void fail_group(Comm& comm, Group& g, Code code, const std::string& reason,
                  std::vector<Delivery>& out) {
    if (g.failed || g.answered) return;
    observe_group(comm, g, code);
    g.failed = true;
    g.answered = true;
    out.push_back({g.sink, g.request,
                   error(code,
                         "send/recv group (seq " + std::to_string(g.seq) + ") on " +
                             comm.where(g.rank) + ": " + reason,
                         g.seq)});
    remove_work(comm.members[g.rank],
                [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
    drop_gpu(g);
  }

  /// A GPU group is answered: its stream goes once the GPU work still holding
  /// its hand-off (copies in flight, staging being sent) lets go.
  static void drop_gpu(Group& g) {
    if (!g.gpu_sync) return;
    g.gpu_sync.reset();
    for (auto& item : g.items) {
      item.gpu_stage.reset();
      if (item.staged || item.staging) item.span = {};
    }
  }

  using SlotIt = std::map<std::uint64_t, Slot>::iterator;
  /// Forgets a finished slot; other nodes' late messages for it are dropped.
  SlotIt end_slot_it(Comm& comm, SlotIt it) {
    if (comm.spans_nodes()) {
      comm.end(it->first);
      purge_inbox(comm, it->first);
    }
    return comm.slots.erase(it);
  }
  void end_slot(Comm& comm, SlotIt it) { end_slot_it(comm, it); }

  /// Fails everything not yet running; later submissions fail at once.
  /// `tell_nodes`: the reason is this node's (a rank died, left, aborted),
  /// so the other nodes of the communicator are told too.
  /// `floor`: operations below this sequence number are not affected (a
  /// rank that left had finished them; other nodes may still be at them).
  void break_comm(Comm& comm, Code code, const std::string& reason, std::vector<Delivery>& out,
                  bool tell_nodes = true, std::uint64_t floor = 0) {
    const bool lower = !comm.broken || floor < comm.broken_floor;
    if (comm.spans_nodes() && lower) {
      comm.inbox->broken = error(code, reason);
      notify(*comm.inbox);
      if (tell_nodes) send_broken(comm, code, reason, floor);
    }
    if (!comm.broken) {
      comm.broken = error(code, reason);
      comm.broken_floor = floor;
    } else if (floor < comm.broken_floor) {
      comm.broken_floor = floor;
    }
    floor = comm.broken_floor;
    for (auto it = comm.slots.begin(); it != comm.slots.end();) {
      if (!it->second.started && it->first >= floor) {
        if (!it->second.failed) fail_slot(comm, it->second, code, reason, out);
        it = end_slot_it(comm, it);
      } else {
        ++it;
      }
    }
    for (auto& m : comm.members) {
      std::vector<std::shared_ptr<Group>> groups;
      for (auto& w : m.queue) {
        if (w.type == Work::Type::group) groups.push_back(w.group);
      }
      for (auto& g : groups) {
        const bool running = std::any_of(g->items.begin(), g->items.end(),
                                         [](const P2PItem& i) { return i.started; });
        if (!running) fail_group(comm, *g, code, reason, out);
      }
    }
  }

  /// Every live communicator once (handles map several ranks to one).
  std::vector<std::shared_ptr<Comm>> all_comms() const {
    std::vector<std::shared_ptr<Comm>> comms;
    for (const auto& [h, cr] : handles) comms.push_back(cr.first);
    std::sort(comms.begin(), comms.end());
    comms.erase(std::unique(comms.begin(), comms.end()), comms.end());
    return comms;
  }

  void drop_member(Comm& comm, int rank) {
    Member& m = comm.members[rank];
    m.active = false;
    handles.erase(m.handle);
    const bool local_left = std::any_of(comm.members.begin(), comm.members.end(),
                                        [](const Member& x) { return x.active && !x.remote; });
    if (!local_left) release_nodes(comm);
  }

  // ---- communicators that span nodes (engine_nodes.cc) ---------------------------

  /// Sets up the inbox and the executor of a communicator spanning nodes.
  void attach_nodes(const std::shared_ptr<Comm>& cp);
  /// Wakes the executor waiting on `in` (its message or failure arrived).
  static void notify(Inbox& in) {
    if (auto ex = in.exec.lock()) Executor::wake(ex);
  }
  /// Wakes every executor, so that waits re-check their deadlines (mu held).
  void wake_executors();
  /// Joins rank `rank` to the rendezvous `key`; an error text when it cannot.
  std::optional<std::pair<Code, std::string>> join_rendezvous(const std::string& key,
                                                              std::uint32_t nranks,
                                                              std::uint32_t rank, Joiner joiner,
                                                              std::vector<Delivery>& out);
  /// Creates this node's side of a communicator spanning nodes and answers its
  /// joiners (rank -> joiner; ranks of other nodes are absent).
  std::shared_ptr<Comm> make_spanning_comm(const std::string& uid, const std::string& name,
                                           const std::vector<int>& node_of_rank,
                                           const std::vector<pid_t>& pids,
                                           const std::vector<std::string>& addresses,
                                           const std::vector<std::string>& names,
                                           const std::map<int, Joiner>& local,
                                           std::vector<Delivery>& out);
  /// Pending joins of this node: fails the ones of `key` (rank < 0: all).
  void fail_pending_joins(const std::string& key, int rank, Code code, const std::string& why,
                          std::vector<Delivery>& out);
  void check_node_deadlines(Clock::time_point now, std::vector<Delivery>& out);
  void node_client_gone(std::uint64_t session, std::vector<Delivery>& out);
  void node_shutdown(const std::string& reason, std::vector<Delivery>& out);
  /// Its last local rank is gone: closes the executor, drops the inbox.
  void release_nodes(Comm& comm);
  /// Drops what other nodes sent for `seq`.
  void purge_inbox(Comm& comm, std::uint64_t seq);
  /// Whether `size` more bytes for `in` would pass memory.max_unreceived_bytes;
  /// if so, breaks its communicator (or marks the unclaimed inbox broken),
  /// naming `what` and the sending node, and drops what it held.
  /// Whether `size` more bytes would pass memory.max_unreceived_bytes (cheap;
  /// over_unreceived_limit then acts on it).
  bool unreceived_over(std::uint64_t size) const;
  bool over_unreceived_limit(const std::string& uid, Inbox& in, const std::shared_ptr<Comm>& cp,
                             std::uint64_t size, const std::string& what, const std::string& from,
                             std::vector<Delivery>& out);
  /// Tells the other nodes that this node broke the communicator.
  void send_broken(Comm& comm, Code code, const std::string& reason, std::uint64_t floor);
  /// Tells the other nodes that `seq` failed here.
  void send_slot_failed(Comm& comm, std::uint64_t seq, Code code, const std::string& reason);
  /// A collective whose local ranks are all in: runs on the executor.
  void start_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq);
  /// The executor's body for one operation.
  void run_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq);
  /// A send to, or a receive from, a rank on another node.
  void start_remote_item(const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& g,
                         P2PItem& item, std::vector<Delivery>& out,
                         std::vector<std::function<void()>>& tasks);
  /// Compares another node's description of `seq` with this node's; on a
  /// difference fails the slot here and there. True when they match.
  bool check_remote_desc(Comm& comm, std::uint64_t seq, std::vector<Delivery>& out);
  /// Answers a completed rendezvous whose ranks live on several nodes.
  void finish_rendezvous_across_nodes(const std::string& key, struct Rendezvous& rv,
                                      std::vector<Delivery>& out);
  /// Fails a rendezvous at this daemon, telling remote joiners' nodes.
  void fail_rendezvous(const std::string& key, struct Rendezvous& rv, Code code,
                       const std::string& why, int except_rank, std::vector<Delivery>& out);
  /// Sends a message built by `fill` to `address` (errors are logged).
  /// Sends `message` to the node at `address`; a failure breaks what spans
  /// that node. `also` (optional) hears the outcome too.
  void send_node(const std::string& address, OutMessage message, NodeTransport::Done also = nullptr);
  void handle_node_message(const std::string& peer, MessageBytes bytes,
                           std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks);
  void handle_node_down(const std::string& address, const std::string& node, const std::string& why,
                        std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks);
  /// Creates the children of a split from every rank's (color, key).
  void make_split_children(const std::shared_ptr<Comm>& cp, std::uint64_t seq,
                           const std::vector<std::pair<int, int>>& color_key,
                           std::map<int, CommInfo>& info);

  // ---- progress --------------------------------------------------------------

  /// Starts whatever can start; answers leaves and failures at queue heads.
  void progress(const std::shared_ptr<Comm>& cp, std::vector<Delivery>& out,
                std::vector<std::function<void()>>& tasks) {
    Comm& comm = *cp;
    for (bool changed = true; changed;) {
      changed = false;
      // Leaves whose earlier operations are all done.
      for (auto& m : comm.members) {
        if (!m.active || m.queue.empty() || m.queue.front().type != Work::Type::leave) continue;
        Work w = std::move(m.queue.front());
        m.queue.pop_front();
        out.push_back({w.sink, w.request, Result{}});
        drop_member(comm, m.rank);
        log.debug("comm_left", {{"comm", comm.name}, {"rank", m.rank}, {"pid", m.pid}});
        if (comm.active_members() > 0) {
          // Across nodes, the operations it finished may still be running
          // elsewhere: only later ones fail.
          break_comm(comm, Code::remote,
                     comm.who(m.rank) + " left the communicator (comm_destroy)", out, true,
                     comm.spans_nodes() ? m.next_seq : 0);
        }
        changed = true;
      }
      if (comm.broken && comm.broken_floor == 0) break;
      // A collective starts when it is at the head of every (local) rank's
      // queue; other nodes' ranks are met by the algorithm between nodes.
      auto first = std::find_if(comm.members.begin(), comm.members.end(),
                                [](const Member& m) { return !m.remote; });
      if (first != comm.members.end() && !first->queue.empty() &&
          first->queue.front().type == Work::Type::slot) {
        const std::uint64_t seq = first->queue.front().seq;
        auto it = comm.slots.find(seq);
        if (it != comm.slots.end() && !it->second.started && !it->second.failed &&
            (!comm.broken || seq < comm.broken_floor) &&
            it->second.arrived == comm.local_count &&
            std::all_of(comm.members.begin(), comm.members.end(), [&](const Member& m) {
              return m.remote || (!m.queue.empty() && m.queue.front().type == Work::Type::slot &&
                                  m.queue.front().seq == seq);
            })) {
          start_slot(cp, it->second, out, tasks);
          changed = true;
        }
      }
      // Point-to-point pairs whose groups are both in their ranks' leading
      // run of groups (no collective before them): a rank's isend and its
      // later irecv both wait for their peers, as Gloo's and NCCL's do, so
      // two ranks that each send first and receive second meet. The k-th
      // send from a to b still meets the k-th receive at b from a (index).
      for (auto& m : comm.members) {
        if (comm.broken) break;
        for (const auto& g : leading_groups(m)) {
        if (comm.broken || g->failed) break;
        for (std::size_t k = 0; k < g->items.size(); ++k) {
          auto& item = g->items[k];
          if (item.started) continue;
          if (comm.members[item.peer].remote) {
            if (g->gpu_sync && !item.staged) {
              // Through pinned host staging: a send runs once the executor
              // has its data on the host, a receive at once.
              if (!item.staging) stage_gpu_item(cp, g, k, out);
              if (g->failed) break;
              if (!item.staged) continue;
            }
            start_remote_item(cp, g, item, out, tasks);
            continue;
          }
          if (!item.is_send) continue;
          Member& peer = comm.members[item.peer];
          std::shared_ptr<Group> h;
          std::vector<P2PItem>::iterator match;
          for (const auto& cand : leading_groups(peer)) {
            match = std::find_if(cand->items.begin(), cand->items.end(), [&](const P2PItem& i) {
              return !i.is_send && i.peer == m.rank && i.index == item.index;
            });
            if (match != cand->items.end()) {
              h = cand;
              break;
            }
          }
          if (!h) continue;
          if (match->count * dtype_size(match->dtype) != item.count * dtype_size(item.dtype) ||
              match->dtype != item.dtype) {
            const std::string why =
                "mismatched send/recv: rank " + std::to_string(m.rank) + " sends " +
                std::to_string(item.count) + " " + std::string(to_string(item.dtype)) +
                " to rank " + std::to_string(item.peer) + " but rank " +
                std::to_string(item.peer) + " receives " + std::to_string(match->count) + " " +
                std::string(to_string(match->dtype)) + " from rank " + std::to_string(m.rank);
            fail_group(comm, *g, Code::mismatch, why, out);
            if (h != g) fail_group(comm, *h, Code::mismatch, why, out);
            changed = true;
            break;
          }
          const bool mixed = static_cast<bool>(g->gpu_sync) != static_cast<bool>(h->gpu_sync);
          if (mixed) {
            // One side GPU memory, the other host memory: the GPU side goes
            // through pinned host staging as it does across nodes (a send's
            // data is copied out once its stream reaches the group, a
            // receive's staging is copied back before its group answers);
            // the pair itself is then an ordinary host copy.
            const bool gpu_sends = static_cast<bool>(g->gpu_sync);
            const auto& gg = gpu_sends ? g : h;
            const std::size_t gk =
                gpu_sends ? k : static_cast<std::size_t>(match - h->items.begin());
            if (!gg->items[gk].staging) stage_gpu_item(cp, gg, gk, out);
            if (gg->failed) {
              // The host side would otherwise wait for its deadline.
              const auto& other = gpu_sends ? h : g;
              fail_group(comm, *other, Code::remote,
                         "its peer rank " + std::to_string(gg->rank) +
                             " (GPU buffer) could not be staged on the host",
                         out);
              changed = true;
              break;
            }
            if (!gg->items[gk].staged) continue;  // the send's data is not on the host yet
          }
          item.started = true;
          match->started = true;
          if (g->gpu_sync && !mixed) {
            start_gpu_pair(cp, g, h, item, *match, out);
            changed = true;
            if (g->failed || h->failed) break;
            continue;
          }
          start_pair(cp, g, h, item.span, match->span, tasks);
        }
        }
      }
    }
  }

  /// The send/recv groups at the head of a rank's queue, before its first
  /// collective or leave (copies: pairing may remove them from the queue).
  /// Stream-ordered (GPU) groups only at the very head: the client's stream
  /// waits on one flag word whose tickets must complete in order.
  static std::vector<std::shared_ptr<Group>> leading_groups(const Member& m) {
    std::vector<std::shared_ptr<Group>> run;
    for (const Work& w : m.queue) {
      if (w.type != Work::Type::group) break;
      if (w.group->gpu_sync && !run.empty()) break;
      run.push_back(w.group);
      if (w.group->gpu_sync) break;
    }
    return run;
  }

  void start_slot(const std::shared_ptr<Comm>& cp, Slot& slot, std::vector<Delivery>& out,
                  std::vector<std::function<void()>>& tasks) {
    Comm& comm = *cp;
    slot.started = true;
    const std::uint64_t seq = slot.seq;
    if (slot.desc.gpu) {
      start_gpu_slot(cp, slot, out);
      return;
    }
    if (comm.spans_nodes()) {
      start_across_nodes(cp, seq);
      return;
    }
    if (slot.desc.kind == OpKind::split) {
      do_split(cp, slot, out);
      return;
    }
    if (slot.desc.kind == OpKind::barrier) {
      complete_slot(comm, seq, out);
      return;
    }
    CollectivePlanInput in;
    in.kind = slot.desc.kind;
    in.dtype = slot.desc.dtype;
    in.redop = slot.desc.redop;
    in.count = slot.desc.count;
    in.root = slot.desc.root;
    for (auto& part : slot.parts) {
      in.send.push_back(part.send);
      in.recv.push_back(part.recv);
    }
    auto more = plan_collective(std::move(in), pool.size(), [this, cp, seq] {
      std::vector<Delivery> done;
      std::vector<std::function<void()>> next;
      {
        std::lock_guard lock(mu);
        complete_slot(*cp, seq, done);
        progress(cp, done, next);
      }
      pool.submit_all(std::move(next));
      deliver(done);
    });
    for (auto& t : more) tasks.push_back(std::move(t));
  }

  // ---- GPU hook: the executor enqueues the operation on the GPUs; the slot
  // leaves the queues at once (the next operation may be enqueued behind it,
  // stream order keeps them in order), and the answers wait for the GPU.
  void start_gpu_slot(const std::shared_ptr<Comm>& cp, Slot& slot, std::vector<Delivery>& out) {
    Comm& comm = *cp;
    gpu::GpuCollective op;
    op.comm = comm.name;
    op.seq = slot.seq;
    op.kind = slot.desc.kind;
    op.dtype = slot.desc.dtype;
    op.redop = slot.desc.redop;
    op.count = slot.desc.count;
    op.root = slot.desc.root;
    op.deadline = slot.deadline;
    for (int r = 0; r < comm.nranks; ++r) {
      const Part& part = slot.parts[r];
      op.send.push_back(part.send);
      op.recv.push_back(part.recv);
      op.sync.push_back(part.gpu_sync);
      op.who.push_back(comm.who(r));
    }
    const std::uint64_t seq = slot.seq;
    if (comm.spans_nodes()) {
      start_gpu_staged(cp, slot, std::move(op), out);
      return;
    }
    auto answers = std::make_shared<std::vector<Delivery>>();
    complete_slot(comm, seq, *answers);
    answer_when_done(answers, seq, out, [&](auto done) { gpu->run(std::move(op), std::move(done)); });
  }

  /// Calls start(done) for GPU work whose completion answers `answers`:
  /// `done(code, message)` delivers them (failed unless ok); an Error thrown
  /// by `start` fails them into `out` at once.
  template <typename Start>
  void answer_when_done(const std::shared_ptr<std::vector<Delivery>>& answers, std::uint64_t seq,
                        std::vector<Delivery>& out, Start&& start) {
    try {
      start(std::function<void(Code, std::string)>([this, answers, seq](Code code, std::string message) {
        if (code != Code::ok) {
          for (auto& d : *answers) d.result = error(code, message, seq);
        }
        deliver(*answers);
      }));
    } catch (const Error& e) {
      for (auto& d : *answers) {
        d.result = error(e.code(), e.what(), seq);
        out.push_back(std::move(d));
      }
    }
  }

  /// GPU buffers across nodes: the local ranks' inputs go to pinned host
  /// staging (the executor's GPU copies), the engine's host collective across
  /// nodes runs on the staging (run_across_nodes), and complete_slot hands the
  /// answers to the executor, which copies the outputs back and releases the
  /// ranks' streams before they go out.
  void start_gpu_staged(const std::shared_ptr<Comm>& cp, Slot& slot, gpu::GpuCollective op,
                        std::vector<Delivery>& out) {
    const std::uint64_t seq = slot.seq;
    std::weak_ptr<Comm> weak = cp;
    slot.stage_queued = Clock::now();
    {
      // Where the host collective waits for each piece of the input before
      // it reads it, the exchange starts once the first piece is in and the
      // copies of the others overlap it: pieces of an eighth of the input,
      // at least 512 KiB (a copy of less runs below the link's speed, and
      // each piece costs a copy call and an event under the lock).
      // Every rank of this node counts, whatever its memory: the host
      // collective runs over all of them (run_across_nodes).
      int local = 0;
      for (const auto& m : cp->members) local += m.remote ? 0 : 1;
      const std::uint64_t one = op.count * dtype_size(op.dtype);
      // The options the operation runs under (run_across_nodes), not the
      // profile's now: both must read its input the same way.
      const NodeAlgorithmOptions& algorithms =
          slot.algorithms ? *slot.algorithms : *this->algorithms;
      if (reads_input_in_pieces(op.kind, one, cp->nranks, local,
                                static_cast<int>(cp->node_address.size()), algorithms)) {
        const std::uint64_t in = one * (op.kind == OpKind::reduce_scatter ? cp->nranks : 1);
        op.in_piece_bytes = ipc::stage_piece_bytes(in);  // the client's rule too
        op.in_first_byte = first_input_read(op.kind, op.count, op.dtype, cp->node_of_rank, cp->my_node,
                                            static_cast<int>(cp->node_address.size()), algorithms);
      }
    }
    // Host spans on the staging: the host collective's buffers.
    auto on_staging = [](Slot& s, int nranks) {
      const auto& st = s.gpu_stage;
      for (int r = 0; r < nranks; ++r) {
        if (!s.parts[r].present) continue;
        auto host = [&](const Span& h) {
          return Span{std::shared_ptr<Registration>(st, &st->host), h.ptr, h.bytes};
        };
        s.parts[r].send = host(st->send[r]);
        s.parts[r].recv = host(st->recv[r]);
      }
    };
    try {
      slot.gpu_stage = gpu->stage_in(std::move(op), [this, weak, seq, on_staging](Code code, std::string why) {
        auto comm = weak.lock();
        if (!comm) return;
        std::vector<Delivery> done;
        std::vector<std::function<void()>> next;
        {
          std::lock_guard lock(mu);
          auto it = comm->slots.find(seq);
          if (it == comm->slots.end() || it->second.failed || !it->second.gpu_stage) return;
          Slot& s = it->second;
          if (code != Code::ok) {
            send_slot_failed(*comm, seq, code, why);
            log.warn("operation_failed", {{"comm", comm->name},
                                          {"seq", seq},
                                          {"op", to_string(s.desc.kind)},
                                          {"reason", why}});
            fail_slot(*comm, s, code, why, done);
            end_slot(*comm, it);
            progress(comm, done, next);
          } else {
            // The host collective runs on the staging; the GPU spans stay
            // alive in the stage until the outputs are copied back.
            s.staged_in = Clock::now();
            if (!s.gpu_stage->in) {  // with pieces it started at stage_in (below)
              on_staging(s, comm->nranks);
              start_across_nodes(comm, seq);
            }
          }
        }
        pool.submit_all(std::move(next));
        deliver(done);
      });
      if (slot.gpu_stage->in) {
        // The inputs arrive in pieces and the host collective waits for each
        // before it reads it (NodeChannel::reading), the first too: it starts
        // now. Its ready-to-receive messages and posted buffers then go out
        // while the GPU still waits for the ranks' streams and copies the
        // first piece, and a node whose inputs come in later than the other's
        // finds the other ready. Started after the first piece, each
        // operation would pay that round trip after its copies (45-60 us of
        // a 1 MiB staged all-gather).
        on_staging(slot, cp->nranks);
        start_across_nodes(cp, seq);
      }
    } catch (const Error& e) {
      send_slot_failed(*cp, seq, e.code(), e.what());
      auto it = cp->slots.find(seq);
      fail_slot(*cp, slot, e.code(), e.what(), out);
      if (it != cp->slots.end()) end_slot(*cp, it);
    }
  }

  void complete_slot(Comm& comm, std::uint64_t seq, std::vector<Delivery>& out_) {
    auto it = comm.slots.find(seq);
    if (it == comm.slots.end()) return;
    Slot& slot = it->second;
    // Staged GPU operation: the answers wait for the copies back to the GPUs.
    std::vector<Delivery> staged;
    std::vector<Delivery>& out = slot.gpu_stage ? staged : out_;
    for (int r = 0; r < comm.nranks; ++r) {
      Part& part = slot.parts[r];
      Member& m = comm.members[r];
      if (!m.queue.empty() && m.queue.front().type == Work::Type::slot &&
          m.queue.front().seq == seq) {
        m.queue.pop_front();
      }
      if (!part.present) continue;
      Result res;
      res.seq = seq;
      out.push_back({part.sink, part.request, std::move(res)});
    }
    ++completed;
    observe_slot(comm, slot, Code::ok);
    if (slot.gpu_stage) {
      auto answers = std::make_shared<std::vector<Delivery>>(std::move(staged));
      answer_when_done(answers, seq, out_, [&](auto done) {
        if (!log.enabled(config::LogLevel::debug)) {
          gpu->stage_out(std::move(slot.gpu_stage), std::move(done));
          return;
        }
        // Where a staged operation's time goes: the copies in (from queueing,
        // so with the wait for the ranks' inputs), the exchange, the copies out.
        const auto us = [](Clock::duration d) {
          return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
        };
        // `at_us`: when it was queued, on the steady clock (CLOCK_MONOTONIC),
        // which the daemons of one host share: daemons that stand for nodes
        // on one machine can be lined up (which node came in late).
        const auto exchanged = Clock::now();
        gpu->stage_out(std::move(slot.gpu_stage),
                       [this, done = std::move(done), name = comm.name, seq, kind = slot.desc.kind,
                        at = us(slot.stage_queued.time_since_epoch()),
                        in = us(slot.staged_in - slot.stage_queued), across = us(exchanged - slot.staged_in),
                        start = us(slot.across_started - slot.staged_in), exchanged,
                        us](Code code, std::string why) {
                         log.debug("gpu_staged", {{"comm", name},
                                                  {"seq", seq},
                                                  {"op", to_string(kind)},
                                                  {"at_us", at},
                                                  {"in_us", in},
                                                  {"exchange_us", across},
                                                  // of which: until the node thread ran it
                                                  // (negative: it started before the inputs
                                                  // were in, GpuStage::in)
                                                  {"start_us", start},
                                                  {"out_us", us(Clock::now() - exchanged)}});
                         done(code, std::move(why));
                       });
      });
    }
    end_slot(comm, it);
  }

  void start_pair(const std::shared_ptr<Comm>& cp, std::shared_ptr<Group> sender,
                  std::shared_ptr<Group> receiver, Span src, Span dst,
                  std::vector<std::function<void()>>& tasks) {
    auto more = plan_copy(std::move(src), std::move(dst), pool.size(),
                          [this, cp, sender, receiver] {
                            std::vector<Delivery> done;
                            std::vector<std::function<void()>> next;
                            {
                              std::lock_guard lock(mu);
                              item_done(*cp, *sender, done);
                              item_done(*cp, *receiver, done);
                              progress(cp, done, next);
                            }
                            pool.submit_all(std::move(next));
                            deliver(done);
                          });
    for (auto& t : more) tasks.push_back(std::move(t));
  }

  void item_done(Comm& comm, Group& g, std::vector<Delivery>& out) {
    ++g.done;
    finish_group(comm, g, out);
  }

  /// Answers a group whose items are all done. A GPU group's receives from
  /// other nodes are copied back to the GPU first, once the rank's stream
  /// has reached the group (its ready word): they may have arrived before.
  void finish_group(Comm& comm, Group& g, std::vector<Delivery>& out) {
    if (g.done < g.items.size() || g.answered) return;
    for (const auto& item : g.items) {
      if (item.staged && !item.is_send && !item.ready) return;  // stage_gpu_item finishes it
    }
    g.answered = true;
    Result res;
    res.seq = g.seq;
    ++completed;
    observe_group(comm, g, Code::ok);
    remove_work(comm.members[g.rank],
                [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
    // GPU group: receives from other nodes are copied back from their staging
    // before the answer goes (the stream is released after them).
    std::vector<std::shared_ptr<gpu::GpuStage>> back;
    for (auto& item : g.items) {
      if (item.staged && !item.is_send && item.gpu_stage) back.push_back(item.gpu_stage);
    }
    if (back.empty()) {
      out.push_back({g.sink, g.request, std::move(res)});
      drop_gpu(g);
      return;
    }
    auto answers = std::make_shared<std::vector<Delivery>>();
    answers->push_back({g.sink, g.request, std::move(res)});
    struct Left {
      std::mutex mu;
      std::size_t n;
      Code code = Code::ok;
      std::string why;
    };
    auto left = std::make_shared<Left>();
    left->n = back.size();
    const std::uint64_t seq = g.seq;
    drop_gpu(g);  // the stages below hold the hand-off until their copies are done
    answer_when_done(answers, seq, out, [&](auto done) {
      for (auto& st : back) {
        gpu->stage_out(st, [left, done](Code code, std::string why) {
          std::unique_lock lock(left->mu);
          if (code != Code::ok && left->code == Code::ok) {
            left->code = code;
            left->why = std::move(why);
          }
          if (--left->n != 0) return;
          lock.unlock();
          done(left->code, left->why);
        });
      }
    });
  }

  /// The executor's operation for point-to-point bytes of `comm`'s group
  /// `seq`, holding the ranks' hand-off until the last RankSync drops.
  static gpu::GpuCollective gpu_p2p_op(const Comm& comm, std::uint64_t seq, std::uint64_t bytes,
                                       Clock::time_point deadline) {
    gpu::GpuCollective op;
    op.comm = comm.name;
    op.seq = seq;
    op.kind = OpKind::p2p;
    op.dtype = DType::uint8;
    op.count = bytes;
    op.deadline = deadline;
    op.hold = true;
    return op;
  }

  /// A send/recv pair inside the node on GPU buffers: the executor copies
  /// the sender's buffer into the receiver's over the peer mapping, after
  /// both ranks' inputs are ready on their streams.
  void start_gpu_pair(const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& sender,
                      const std::shared_ptr<Group>& receiver, P2PItem& send, P2PItem& recv,
                      std::vector<Delivery>& out) {
    Comm& comm = *cp;
    gpu::GpuCollective op = gpu_p2p_op(comm, sender->seq, send.span.bytes,
                                       std::min(sender->deadline, receiver->deadline));
    op.send = {send.span, Span{}};
    op.recv = {Span{}, recv.span};
    op.sync = {sender->gpu_sync, receiver->gpu_sync};
    op.who = {comm.who(sender->rank), comm.who(receiver->rank)};
    std::weak_ptr<Comm> weak = cp;
    try {
      gpu->run(std::move(op), [this, weak, sender, receiver](Code code, std::string why) {
        auto live = weak.lock();
        if (!live) return;
        locked([&](std::vector<Delivery>& out2, std::vector<std::function<void()>>& tasks2) {
          if (code != Code::ok) {
            const std::string reason = "send from rank " + std::to_string(sender->rank) +
                                       " to rank " + std::to_string(receiver->rank) +
                                       " on GPU buffers failed: " + why;
            fail_group(*live, *sender, code, reason, out2);
            if (receiver != sender) fail_group(*live, *receiver, code, reason, out2);
          } else {
            item_done(*live, *sender, out2);
            item_done(*live, *receiver, out2);
          }
          progress(live, out2, tasks2);
        });
      });
    } catch (const Error& e) {
      fail_group(comm, *sender, e.code(), e.what(), out);
      if (receiver != sender) fail_group(comm, *receiver, e.code(), e.what(), out);
    }
  }

  /// A GPU group's item with a peer on another node: the executor waits for
  /// the rank's stream and copies a send's data to pinned host staging (a
  /// receive gets staging of its size); then the item runs as a host one.
  void stage_gpu_item(const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& g,
                      std::size_t k, std::vector<Delivery>& out) {
    Comm& comm = *cp;
    P2PItem& item = g->items[k];
    item.staging = true;
    gpu::GpuCollective op = gpu_p2p_op(comm, g->seq, item.span.bytes, g->deadline);
    op.send = {item.is_send ? item.span : Span{}};
    op.recv = {item.is_send ? Span{} : item.span};
    op.sync = {g->gpu_sync};
    op.who = {comm.who(g->rank)};
    std::weak_ptr<Comm> weak = cp;
    auto host_span = [](P2PItem& it) {
      const auto& st = it.gpu_stage;
      const Span& h = it.is_send ? st->send[0] : st->recv[0];
      it.span = Span{std::shared_ptr<Registration>(st, &st->host), h.ptr, h.bytes};
      it.staged = true;
    };
    try {
      item.gpu_stage = gpu->stage_in(std::move(op), [this, weak, g, k, host_span](Code code, std::string why) {
        auto live = weak.lock();
        if (!live) return;
        locked([&](std::vector<Delivery>& out2, std::vector<std::function<void()>>& tasks2) {
          if (g->failed || g->answered) return;
          P2PItem& it = g->items[k];
          if (code != Code::ok || !it.gpu_stage) {
            fail_group(*live, *g, code == Code::ok ? Code::internal : code,
                       (it.is_send ? "send to rank " : "recv from rank ") +
                           std::to_string(it.peer) + " on GPU buffers: " + why,
                       out2);
          } else if (it.is_send) {
            host_span(it);  // its data is on the host now
          } else {
            it.ready = true;  // its copy back may go once it has arrived
            finish_group(*live, *g, out2);
          }
          progress(live, out2, tasks2);
        });
      });
      // A receive takes the data into its staging as soon as it arrives (an
      // eager sender may leave the communicator right after sending).
      if (!item.is_send) host_span(item);
    } catch (const Error& e) {
      fail_group(comm, *g, e.code(), e.what(), out);
    }
  }

  void do_split(const std::shared_ptr<Comm>& cp, Slot& slot, std::vector<Delivery>& out) {
    Comm& parent = *cp;
    std::vector<std::pair<int, int>> color_key(parent.nranks);
    for (int r = 0; r < parent.nranks; ++r) color_key[r] = {slot.parts[r].color, slot.parts[r].key};
    std::map<int, CommInfo> info;  // parent rank -> new communicator
    make_split_children(cp, slot.seq, color_key, info);
    const std::uint64_t seq = slot.seq;
    std::vector<Delivery> replies;
    for (int r = 0; r < parent.nranks; ++r) {
      if (!slot.parts[r].present) continue;
      Result res;
      res.seq = seq;
      res.comm = info.count(r) ? info[r] : CommInfo{};
      replies.push_back({slot.parts[r].sink, slot.parts[r].request, std::move(res)});
      slot.parts[r].present = false;
    }
    complete_slot(parent, seq, out);
    for (auto& d : replies) out.push_back(std::move(d));
  }

  void deliver(std::vector<Delivery>& out) {
    for (auto& d : out) {
      if (d.sink) d.sink->complete(d.request, std::move(d.result));
    }
    out.clear();
  }

  // ---- requests -----------------------------------------------------------------

  /// Runs `fn` under the engine lock, then starts the tasks it produced and
  /// delivers its answers. `run_inline`: the caller is a daemon worker (the
  /// ring poller), and an operation that is a single task runs right here,
  /// saving the wake-up of a pool thread — most of a small operation's cost.
  template <typename Fn>
  void locked(Fn&& fn, bool run_inline = false) {
    std::vector<Delivery> out;
    std::vector<std::function<void()>> tasks;
    {
      std::lock_guard lock(mu);
      fn(out, tasks);
    }
    if (run_inline && tasks.size() == 1) {
      deliver(out);
      tasks.front()();
      return;
    }
    pool.submit_all(std::move(tasks));
    deliver(out);
  }

  /// Validates one rank's collective and resolves its buffers. Throws Error.
  Desc validate(const ClientRef& client, const CollectiveArgs& a, int nranks, int rank,
                Part& part) {
    Desc d;
    d.kind = a.kind;
    if (a.kind == OpKind::barrier || a.kind == OpKind::split) return d;
    const auto dtype = dtype_from_int(a.dtype);
    if (!dtype) throw Error(Code::invalid_argument, "unknown dtype " + std::to_string(a.dtype));
    d.dtype = *dtype;
    d.count = a.count;
    const bool reducing = a.kind == OpKind::all_reduce || a.kind == OpKind::reduce ||
                          a.kind == OpKind::reduce_scatter;
    if (reducing) {
      const auto op = redop_from_int(a.redop);
      if (!op) throw Error(Code::invalid_argument, "unknown reduction " + std::to_string(a.redop));
      d.redop = *op;
    }
    const bool rooted = a.kind == OpKind::broadcast || a.kind == OpKind::reduce;
    if (rooted) {
      if (a.root < 0 || a.root >= nranks) {
        throw Error(Code::invalid_argument, "root " + std::to_string(a.root) +
                                                " is not a rank of this communicator (0.." +
                                                std::to_string(nranks - 1) + ")");
      }
      d.root = a.root;
    }
    const std::uint64_t es = dtype_size(d.dtype);
    const std::uint64_t n = static_cast<std::uint64_t>(nranks);
    if (a.count > (std::uint64_t{1} << 46) / es / n) {
      throw Error(Code::invalid_argument, "count " + std::to_string(a.count) + " is too large");
    }
    const std::uint64_t one = a.count * es;
    std::uint64_t send_bytes = one, recv_bytes = one;
    switch (a.kind) {
      case OpKind::all_gather: recv_bytes = one * n; break;
      case OpKind::reduce_scatter: send_bytes = one * n; break;
      case OpKind::all_to_all: send_bytes = recv_bytes = one * n; break;
      case OpKind::broadcast: if (rank != a.root) send_bytes = 0; break;
      case OpKind::reduce: if (rank != a.root) recv_bytes = 0; break;
      default: break;
    }
    part.send = resolve_span(client, a.send, send_bytes, "send");
    part.recv = resolve_span(client, a.recv, recv_bytes, "recv");
    check_memory_kind(a, part);
    d.gpu = a.gpu != nullptr;
    // Overlapping send and receive buffers are only allowed in the in-place
    // layout of each operation; anything else would read half-written data.
    if (part.send.ptr && part.recv.ptr && part.send.reg == part.recv.reg) {
      const std::byte* s = part.send.ptr;
      const std::byte* r = part.recv.ptr;
      const bool overlap = s < r + part.recv.bytes && r < s + part.send.bytes;
      bool in_place = false;
      switch (a.kind) {
        case OpKind::all_gather: in_place = s == r + rank * one; break;
        case OpKind::reduce_scatter: in_place = r == s + rank * one; break;
        default: in_place = s == r; break;
      }
      if (overlap && !in_place) {
        throw Error(Code::invalid_argument,
                    "send and recv buffers overlap but are not the in-place layout of " +
                        std::string(to_string(a.kind)));
      }
    }
    return d;
  }

  /// Host operations take host buffers, GPU operations GPU buffers of the same
  /// allocations the client registered (buffer ids: freed and reallocated
  /// memory is refused).
  void check_memory_kind(const CollectiveArgs& a, Part& part) {
    for (const auto* s : {&part.send, &part.recv}) {
      if (!s->reg) continue;
      const char* which = s == &part.send ? "send" : "recv";
      const bool on_device = s->reg->device != nullptr;
      if (!a.gpu && on_device) {
        throw Error(Code::invalid_argument,
                    std::string(which) + " buffer is GPU memory: use the stream-ordered call");
      }
      if (a.gpu && a.gpu->client_staged) {
        // The client's own host staging (its registration, checked like any
        // host buffer); the executor refuses it inside one node.
        if (on_device) {
          throw Error(Code::invalid_argument,
                      std::string(which) +
                          " buffer is GPU memory, but the operation is staged by the client");
        }
        continue;
      }
      if (a.gpu && !on_device) {
        throw Error(Code::invalid_argument,
                    std::string(which) + " buffer is host memory, but the operation is on GPU buffers");
      }
      if (a.gpu) {
        const std::uint64_t now = s == &part.send ? a.gpu->send_buffer_id : a.gpu->recv_buffer_id;
        if (now != s->reg->device->buffer_id()) {
          throw Error(Code::invalid_argument,
                      std::string(which) + " buffer: stale registration " +
                          std::to_string(s->reg->handle) + ": it was made for buffer id " +
                          std::to_string(s->reg->device->buffer_id()) +
                          ", but the memory there is now buffer id " + std::to_string(now) +
                          " (freed and reallocated); register it again");
        }
      }
    }
    if (a.gpu && gpu == nullptr) {
      throw Error(Code::unavailable, "this daemon has no GPU executor");
    }
    part.gpu_sync = a.gpu;
  }

  void submit_slot(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                   const CollectiveArgs& args, int color, int key) {
    locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
      auto [cp, rank] = resolve_or_answer(client, request, handle, to_string(args.kind), out);
      if (!cp) return;
      Comm& comm = *cp;
      const std::string op(to_string(args.kind));
      if (stopping) {
        out.push_back({client.sink, request,
                       error(Code::aborted, op + " on " + comm.where(rank) +
                                                ": the daemon is stopping")});
        return;
      }
      if (comm.broken && comm.members[rank].next_seq >= comm.broken_floor) {
        out.push_back({client.sink, request,
                       error(comm.broken->code,
                             op + " on " + comm.where(rank) + ": " + comm.broken->message)});
        return;
      }
      Member& m = comm.members[rank];
      const std::uint64_t seq = m.next_seq++;
      auto [it, fresh] = comm.slots.try_emplace(seq);
      Slot& slot = it->second;
      const Clock::time_point now = Clock::now();
      if (fresh) {
        slot.seq = seq;
        slot.parts.resize(comm.nranks);
        slot.created = now;
      }
      note_deadline(slot, fresh, now, args.deadline, rank);
      slot.arrived += 1;
      if (slot.failed) {
        Result res = slot.failure;
        res.message = op + " (seq " + std::to_string(seq) + ") on " + comm.where(rank) + ": " +
                      slot.failure.message;
        out.push_back({client.sink, request, std::move(res)});
        if (slot.arrived >= comm.local_count) end_slot(comm, it);
        return;
      }
      Part part;
      part.request = request;
      part.sink = client.sink;
      part.session = client.session;
      part.pid = client.pid;
      part.color = color;
      part.key = key;
      Desc desc;
      try {
        desc = validate(client, args, comm.nranks, rank, part);
      } catch (const Error& e) {
        part.present = true;
        slot.parts[rank] = std::move(part);
        if (!slot.has_desc) slot.desc.kind = args.kind;
        fail_slot(comm, slot, e.code(),
                  comm.who(rank) + " submitted an invalid " + op + ": " + e.what(), out);
        if (slot.arrived >= comm.local_count) end_slot(comm, it);
        return;
      }
      part.present = true;
      slot.parts[rank] = std::move(part);
      if (!slot.has_desc) {
        slot.desc = desc;
        slot.has_desc = true;
        slot.desc_rank = rank;
        if (comm.spans_nodes()) {
          slot.algorithms = algorithms;
          slot.plan = node_plan(desc.kind, desc.count, desc.dtype, comm.nranks,
                                static_cast<int>(comm.node_address.size()), *slot.algorithms);
          // Other nodes may have sent their view of this operation already.
          if (!check_remote_desc(comm, seq, out)) return;
        }
      } else if (!(slot.desc == desc) || slot.desc.gpu != desc.gpu) {
        // Named both ways, so that whoever reads either rank's error sees the pair.
        fail_slot(comm, slot, Code::mismatch,
                  "mismatched operations for sequence number " + std::to_string(seq) + ": " +
                      comm.who(slot.desc_rank) + " submitted " + slot.desc.str() + " but " +
                      comm.who(rank) + " submitted " + desc.str(),
                  out);
        if (slot.arrived >= comm.local_count) end_slot(comm, it);
        return;
      }
      m.queue.push_back(Work{Work::Type::slot, seq, nullptr, 0, nullptr});
      progress(cp, out, tasks);
    }, client.inline_small);
  }
};

}  // namespace collectived::engine

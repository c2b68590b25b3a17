// The engine's state and its parts (engine/engine.h's Impl). Not a public
// header. One mutex guards the state; every function that needs it held
// takes a `Locked` (engine/engine_lock.h) as its first parameter, so that the
// compiler checks the discipline. The bodies live by job:
//   matching.cc       requests, sequence numbers, queues, starting and completing
//   failures.cc       failing, breaking, deadlines, departed clients, metrics
//   validate.cc       what a submission must satisfy (free functions)
//   rendezvous.cc     rendezvous (here and at another node's daemon) and split
//   across_nodes.cc   operations of communicators that span nodes
//   node_messages.cc  one handler per message from another node's engine
//   gpu_staging.cc    the glue to the GPU executor (engine/gpu/)
//   engine.cc         the facade (engine/engine.h) and status
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm.h"
#include "engine/engine.h"
#include "engine/engine_lock.h"
#include "engine/gpu/executor.h"
#include "engine/node_executor.h"
#include "engine/node_inbox.h"
#include "engine/node_wire.h"
#include "engine/rendezvous.h"
#include "engine/worker_pool.h"

namespace collectived::engine {

using Tasks = std::vector<std::function<void()>>;
using Deliveries = std::vector<Delivery>;

struct Engine::Impl {
  EngineOptions options;  // operation/rendezvous deadlines: under mu
  Registry& registry;
  Logger& log;
  mutable std::mutex mu;
  bool stopping = false;
  gpu::GpuExecutor* gpu = nullptr;  // collectives on GPU buffers (engine/gpu/)

  /// This daemon's communicators, by the handle of each of its local ranks.
  struct Communicators {
    std::map<std::uint64_t, std::pair<std::shared_ptr<Comm>, int>> by_handle;  // -> (comm, rank)
    std::uint64_t next_handle = 1;
    std::uint64_t serial = 0;     // the last Comm::serial given
    std::uint64_t completed = 0;  // operations answered ok (EngineStats)
  } communicators;

  /// Rendezvous in progress: at this daemon (by key, id@address), and this
  /// node's ranks waiting for another node's rendezvous daemon.
  struct Joins {
    std::map<std::string, Rendezvous> here;
    std::multimap<std::string, PendingJoin> pending;
  } joins;

  /// What communicators that span nodes share.
  struct Nodes {
    std::atomic<NodeTransport*> transport{nullptr};
    /// The profile's, replaced whole on reload (Engine::set_node_algorithms):
    /// each operation across nodes keeps the one it was submitted under
    /// (Slot::algorithms), so that a reload while it runs cannot change its
    /// algorithm halfway or race its reads.
    std::shared_ptr<const NodeAlgorithmOptions> algorithms =
        std::make_shared<const NodeAlgorithmOptions>();
    std::map<std::string, InboxRef> inboxes;  // uid -> inbox and the communicator using it
    std::shared_ptr<NodeRunner> runner = std::make_shared<NodeRunner>();
    std::vector<std::weak_ptr<Executor>> executors;  // every one made (pruned when woken)
  } nodes;

  // Declared last: destroyed first, so its threads are joined (and their
  // tasks, which call back into this Impl, are done) before anything else goes.
  WorkerPool pool;

  Impl(EngineOptions o, Registry& r, Logger& l);
  /// Stops the executors of communicators that span nodes.
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  static Result error(Code code, std::string message, std::uint64_t seq = 0);

  /// Runs `fn(Locked, out, tasks)` under the engine lock, then starts the
  /// tasks it produced and delivers its answers. `run_inline`: the caller is
  /// a daemon worker (the ring poller), and an operation that is a single
  /// task runs right here, saving the wake-up of a pool thread (most of a
  /// small operation's cost).
  template <typename Fn>
  void locked(Fn&& fn, bool run_inline = false) {
    Deliveries out;
    Tasks tasks;
    {
      EngineLock lock(mu);
      fn(lock.token(), out, tasks);
    }
    if (run_inline && tasks.size() == 1) {
      deliver(out);
      tasks.front()();
      return;
    }
    pool.submit_all(std::move(tasks));
    deliver(out);
  }
  static void deliver(Deliveries& out);

  // ---- requests and matching (matching.cc) ---------------------------------------

  std::pair<std::shared_ptr<Comm>, int> resolve(Locked, const ClientRef& client,
                                                std::uint64_t handle);
  /// resolve(), or an error answer naming `what` (then the pointer is null).
  std::pair<std::shared_ptr<Comm>, int> resolve_or_answer(Locked, const ClientRef& client,
                                                          std::uint64_t request,
                                                          std::uint64_t handle,
                                                          std::string_view what, Deliveries& out);
  /// A collective (or split) of one rank: matched by sequence number.
  void submit_slot(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                   const CollectiveArgs& args, int color, int key);
  /// A send/recv group of one rank.
  void submit_group(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                    const std::vector<P2PArgs>& items, std::shared_ptr<gpu::RankSync> gpu,
                    std::chrono::milliseconds deadline);
  void leave(const ClientRef& client, std::uint64_t request, std::uint64_t handle);
  void abort(const ClientRef& client, std::uint64_t request, std::uint64_t handle);

  /// Starts whatever can start; answers leaves and failures at queue heads.
  void progress(Locked, const std::shared_ptr<Comm>& cp, Deliveries& out, Tasks& tasks);
  void start_slot(Locked, const std::shared_ptr<Comm>& cp, Slot& slot, Deliveries& out,
                  Tasks& tasks);
  void complete_slot(Locked, Comm& comm, std::uint64_t seq, Deliveries& out);
  void item_done(Locked, Comm& comm, Group& g, Deliveries& out);
  /// Answers a group whose items are all done.
  void finish_group(Locked, Comm& comm, Group& g, Deliveries& out);

  // ---- failures, deadlines, metrics (failures.cc) ------------------------------------

  /// How long an operation may wait to start after a submission: the
  /// client's own timeout, else the node's.
  std::chrono::milliseconds budget(Locked, std::chrono::milliseconds client) const;
  /// A submission of `rank` at `now`: the slot's deadline becomes the earliest
  /// of its submissions' (each rank may have set its own timeout).
  void note_deadline(Locked, Slot& slot, bool fresh, Clock::time_point now,
                     std::chrono::milliseconds client, int rank) const;
  /// An expired deadline as errors name it.
  std::string deadline_text(Locked, std::chrono::milliseconds client, int rank) const;
  static void remove_work(Locked, Member& m, const std::function<bool(const Work&)>& pred);
  void observe_slot(Locked, const Comm& comm, const Slot& slot, Code code) const;
  void observe_group(Locked, const Comm& comm, const Group& g, Code code) const;
  /// Answers every rank's part with the failure. `unqueue` false: the caller
  /// takes the slot's work out of the ranks' queues itself (break_comm, once
  /// for all the slots it fails).
  void fail_slot(Locked, Comm& comm, Slot& slot, Code code, const std::string& reason,
                 Deliveries& out, bool unqueue = true);
  void fail_group(Locked, Comm& comm, Group& g, Code code, const std::string& reason,
                  Deliveries& out, bool unqueue = true);
  using SlotIt = std::map<std::uint64_t, Slot>::iterator;
  /// Forgets a finished slot; other nodes' late messages for it are dropped.
  SlotIt end_slot(Locked, Comm& comm, SlotIt it);
  /// Fails everything not yet running; later submissions fail at once.
  /// `tell_nodes`: the reason is this node's (a rank died, left, aborted),
  /// so the other nodes of the communicator are told too.
  /// `floor`: operations below this sequence number are not affected (a
  /// rank that left had finished them; other nodes may still be at them).
  void break_comm(Locked, Comm& comm, Code code, const std::string& reason, Deliveries& out,
                  bool tell_nodes = true, std::uint64_t floor = 0);
  /// Every live communicator once (handles map several ranks to one).
  std::vector<std::shared_ptr<Comm>> all_comms(Locked) const;
  void drop_member(Locked, Comm& comm, int rank);
  void client_gone(std::uint64_t session);
  void check_deadlines();
  void shutdown(const std::string& reason);
  void expire_slots(Locked, Comm& comm, Clock::time_point now, Deliveries& out);
  void expire_groups(Locked, Comm& comm, Clock::time_point now, Deliveries& out);

  // ---- rendezvous and split (rendezvous.cc) -------------------------------------------

  void comm_init(const ClientRef& client, std::uint64_t request, const std::string& secret,
                 const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank);
  /// comm_init of a rank whose rendezvous is at another node's daemon.
  void forward_join(Locked, const ClientRef& client, std::uint64_t request, const std::string& key,
                    const std::string& secret, const std::string& rendezvous, std::uint32_t nranks,
                    std::uint32_t rank);
  /// Joins rank `rank` to the rendezvous `key`; an error text when it cannot.
  std::optional<std::pair<Code, std::string>> join_rendezvous(Locked, const std::string& key,
                                                              std::uint32_t nranks,
                                                              std::uint32_t rank, Joiner joiner,
                                                              Deliveries& out);
  /// Answers a completed rendezvous whose ranks live on several nodes.
  void finish_rendezvous_across_nodes(Locked, const std::string& key, Rendezvous& rv,
                                      Deliveries& out);
  /// Creates this node's side of a communicator spanning nodes and answers its
  /// joiners (rank -> joiner; ranks of other nodes are absent).
  std::shared_ptr<Comm> make_spanning_comm(Locked, const std::string& uid, const std::string& name,
                                           const std::vector<int>& node_of_rank,
                                           const std::vector<pid_t>& pids,
                                           const std::vector<std::string>& addresses,
                                           const std::vector<std::string>& names,
                                           const std::map<int, Joiner>& local, Deliveries& out);
  /// Fails a rendezvous at this daemon, telling remote joiners' nodes.
  void fail_rendezvous(Locked, const std::string& key, Rendezvous& rv, Code code,
                       const std::string& why, int except_rank, Deliveries& out);
  /// Pending joins of this node: fails the ones of `key` (rank < 0: all).
  void fail_pending_joins(Locked, const std::string& key, int rank, Code code,
                          const std::string& why, Deliveries& out);
  void send_join_reply(const std::string& to, const std::string& key, int rank, Code code,
                       const std::string& why);
  void expire_rendezvous(Locked, Clock::time_point now, Deliveries& out);
  void rendezvous_client_gone(Locked, std::uint64_t session, Deliveries& out);
  void do_split(Locked, const std::shared_ptr<Comm>& cp, Slot& slot, Deliveries& out);
  /// Creates the children of a split from every rank's (color, key).
  void make_split_children(Locked, const std::shared_ptr<Comm>& cp, std::uint64_t seq,
                           const std::vector<std::pair<int, int>>& color_key,
                           std::map<int, CommInfo>& info);

  // ---- communicators that span nodes (across_nodes.cc) --------------------------------

  /// Sets up the inbox and the executor of a communicator spanning nodes.
  void attach_nodes(Locked, const std::shared_ptr<Comm>& cp);
  /// Its last local rank is gone: drops the inbox.
  void release_nodes(Locked, Comm& comm);
  /// Drops what other nodes sent for `seq`.
  void purge_inbox(Locked, Comm& comm, std::uint64_t seq);
  /// Wakes every executor, so that waits re-check their deadlines.
  void wake_executors(Locked);
  /// The plan of an operation across nodes and what its runner needs beyond
  /// it, decided once at submission (Slot::run).
  static NodeRun plan_node_run(const Comm& comm, const Desc& desc,
                               const NodeAlgorithmOptions& options);
  /// Sends `message` to the node at `address`; a failure breaks what spans
  /// that node. `also` (optional) hears the outcome too.
  void send_node(const std::string& address, OutMessage message,
                 NodeTransport::Done also = nullptr);
  /// Tells the other nodes that this node broke the communicator.
  void send_broken(Locked, Comm& comm, Code code, const std::string& reason, std::uint64_t floor);
  /// Tells the other nodes that `seq` failed here.
  void send_slot_failed(Locked, Comm& comm, std::uint64_t seq, Code code,
                        const std::string& reason);
  /// Compares another node's description of `seq` with this node's; on a
  /// difference fails the slot here and there. True when they match.
  bool check_remote_desc(Locked, Comm& comm, std::uint64_t seq, Deliveries& out);
  /// A collective whose local ranks are all in: runs on the executor.
  void start_across_nodes(Locked, const std::shared_ptr<Comm>& cp, std::uint64_t seq);
  /// The executor's body for one operation (takes the lock itself).
  void run_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq);
  /// A send to, or a receive from, a rank on another node.
  void start_remote_item(Locked, const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& g,
                         P2PItem& item, Deliveries& out, Tasks& tasks);
  void check_node_deadlines(Locked, Clock::time_point now, Deliveries& out);
  void node_client_gone(Locked, std::uint64_t session);
  void node_shutdown(Locked, const std::string& reason, Deliveries& out);
  void handle_node_down(Locked, const std::string& address, const std::string& node,
                        const std::string& why, Deliveries& out, Tasks& tasks);

  // ---- messages from other nodes (node_messages.cc) ---------------------------------

  void handle_node_message(Locked, const std::string& peer, MessageBytes bytes, Deliveries& out,
                           Tasks& tasks);
  void on_join(Locked, const std::string& from, nodewire::Join::Reader j, Deliveries& out);
  void on_join_reply(Locked, const std::string& from, nodewire::JoinReply::Reader r,
                     Deliveries& out);
  void on_join_cancel(Locked, const std::string& from, nodewire::JoinCancel::Reader c,
                      Deliveries& out);
  void on_data(Locked, const std::string& from, Decoded& d, Deliveries& out, Tasks& tasks);
  void on_broken(Locked, nodewire::Broken::Reader b, Deliveries& out, Tasks& tasks);
  void on_slot_failed(Locked, nodewire::SlotFailed::Reader f, Deliveries& out, Tasks& tasks);
  /// Whether `size` more bytes would pass memory.max_unreceived_bytes (cheap;
  /// over_unreceived_limit then acts on it).
  bool unreceived_over(Locked, std::uint64_t size) const;
  /// Whether `size` more bytes for `in` would pass memory.max_unreceived_bytes;
  /// if so, breaks its communicator (or marks the unclaimed inbox broken),
  /// naming `what` and the sending node, and drops what it held.
  bool over_unreceived_limit(Locked, const std::string& uid, Inbox& in,
                             const std::shared_ptr<Comm>& cp, std::uint64_t size,
                             const std::string& what, const std::string& from, Deliveries& out);

  // ---- the GPU executor's glue (gpu_staging.cc) --------------------------------------

  /// The executor enqueues the operation on the GPUs; the slot leaves the
  /// queues at once, and the answers wait for the GPU.
  void start_gpu_slot(Locked, const std::shared_ptr<Comm>& cp, Slot& slot, Deliveries& out);
  /// GPU buffers across nodes: through pinned host staging.
  void start_gpu_staged(Locked, const std::shared_ptr<Comm>& cp, Slot& slot, gpu::GpuCollective op,
                        Deliveries& out);
  /// complete_slot of a staged operation: the answers wait for the copies
  /// back to the GPUs.
  void stage_out_slot(Locked, Comm& comm, Slot& slot, Deliveries staged, Deliveries& out);
  /// finish_group of a GPU group with receives from other nodes: copied back
  /// from their staging before the answer goes.
  void stage_back_group(Locked, Group& g, Result res, Deliveries& out);
  /// Calls start(done) for GPU work whose completion answers `answers`.
  template <typename Start>
  void answer_when_done(const std::shared_ptr<Deliveries>& answers, std::uint64_t seq,
                        Deliveries& out, Start&& start);
  /// A GPU group is answered: its stream goes once the GPU work still
  /// holding its hand-off lets go.
  static void drop_gpu(Locked, Group& g);
  static gpu::GpuCollective gpu_p2p_op(const Comm& comm, std::uint64_t seq, std::uint64_t bytes,
                                       Clock::time_point deadline);
  void start_gpu_pair(Locked, const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& sender,
                      const std::shared_ptr<Group>& receiver, P2PItem& send, P2PItem& recv,
                      Deliveries& out);
  /// A GPU group's item with a peer on another node: staged on the host.
  void stage_gpu_item(Locked, const std::shared_ptr<Comm>& cp, const std::shared_ptr<Group>& g,
                      std::size_t k, Deliveries& out);

 private:
  // Steps of the functions above (matching.cc, across_nodes.cc).
  bool answer_leaves(Locked, Comm& comm, Deliveries& out);
  bool start_ready_collective(Locked, const std::shared_ptr<Comm>& cp, Deliveries& out,
                              Tasks& tasks);
  bool pair_groups(Locked, const std::shared_ptr<Comm>& cp, Deliveries& out, Tasks& tasks);
  enum class Next { item, group };
  Next pair_item(Locked, const std::shared_ptr<Comm>& cp, Member& m,
                 const std::shared_ptr<Group>& g, std::size_t k, bool& changed, Deliveries& out,
                 Tasks& tasks);
  void submit_part(Locked, const ClientRef& client, std::uint64_t request,
                   const std::shared_ptr<Comm>& cp, int rank, const CollectiveArgs& args, int color,
                   int key, Deliveries& out, Tasks& tasks);
  void start_pair(const std::shared_ptr<Comm>& cp, std::shared_ptr<Group> sender,
                  std::shared_ptr<Group> receiver, Span src, Span dst, Tasks& tasks);
  void start_host_slot(Locked, const std::shared_ptr<Comm>& cp, Slot& slot, Tasks& tasks);
  struct AcrossOp;
  bool prepare_across(Locked, Comm& comm, std::uint64_t seq, AcrossOp& a);
  void exchange_across(const std::shared_ptr<Comm>& cp, std::uint64_t seq, AcrossOp& a);
  void finish_across(Locked, const std::shared_ptr<Comm>& cp, std::uint64_t seq, AcrossOp& a,
                     Deliveries& out, Tasks& tasks);
};

}  // namespace collectived::engine

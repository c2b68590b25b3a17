// The engine: communicators, rendezvous, operation matching and ordering,
// deadlines, and execution on the worker pool. It knows nothing of sockets:
// requests come in as calls, results go out through each client's
// CompletionSink.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/log.h"
#include "engine/algorithm_options.h"
#include "engine/op.h"
#include "engine/registry.h"
#include "engine/transport/transport.h"

namespace collectived::engine {

namespace gpu {
class GpuExecutor;  // engine/gpu/executor.h
}

/// Told about every finished operation (daemon/metrics.h counts them). Called
/// under the engine's lock, from the event loop or a worker: implementations
/// must be cheap (atomics) and must not call back into the engine.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  /// `bytes`: the operation's size as nccl-tests counts it (all_gather and
  /// all_to_all: the whole receive buffer of one rank; p2p: bytes sent);
  /// `latency`: first submission to completion; `transport`: what moved it.
  virtual void operation_finished(OpKind kind, Code code, std::uint64_t bytes,
                                  Clock::duration latency, std::string_view transport) = 0;
};

struct EngineOptions {
  std::string node_name;
  std::string rendezvous_address;  ///< "host:port" of this daemon (unique ids name it)
  std::chrono::milliseconds operation_deadline{30000};
  std::chrono::milliseconds rendezvous_deadline{60000};
  std::size_t worker_threads = 0;  ///< 0: one per CPU
  /// memory.max_unreceived_bytes: data from other nodes that no operation here
  /// has taken yet, all communicators together; 0 = unlimited.
  std::uint64_t max_unreceived_bytes = 0;
  EngineObserver* observer = nullptr;  ///< metrics; outlives the engine
};

struct EngineStats {
  std::uint32_t communicators = 0;
  std::uint32_t in_flight = 0;   ///< operations submitted and not yet answered
  std::uint64_t completed = 0;   ///< operations completed successfully
  std::uint32_t worker_threads = 0;
};

/// One rank of a communicator, for status (collectivectl status, comms).
struct RankSnapshot {
  std::uint32_t rank = 0;
  pid_t pid = 0;
  std::uint64_t session = 0;
  std::string node;
  bool active = true;         ///< false once left, aborted or dead
  std::uint64_t next_seq = 0; ///< sequence number of its next collective (this node's ranks)
  bool remote = false;        ///< on another node (its daemon shows its operations)
};

/// An operation submitted and not yet answered.
struct OpSnapshot {
  std::uint64_t seq = 0;
  std::string op;                     ///< "all_reduce(count=..., dtype=...)"
  std::chrono::milliseconds age{0};   ///< since its first submission
  bool started = false;               ///< running (every rank arrived, at every queue head)
  int rank = -1;                      ///< the owning rank of a send/recv group; -1: collective
  std::vector<std::uint32_t> missing; ///< this node's ranks that have not submitted it (group: unmatched peers)
};

/// What a client session needs to know of one of its communicators to shape
/// a request (GPU operations across nodes are cut into chunks).
struct CommShape {
  std::uint64_t id = 0;  ///< the communicator on this daemon (the same for all its ranks)
  std::uint64_t next_seq = 0;  ///< sequence number of the rank's next collective
  std::uint32_t rank = 0;
  std::uint32_t nranks = 0;
  std::uint32_t nodes = 1;  ///< nodes its ranks live on
};

struct CommSnapshot {
  std::string name;
  std::uint32_t nranks = 0;
  std::vector<RankSnapshot> ranks;
  std::vector<OpSnapshot> ops;
  std::string broken;  ///< why it can no longer run operations ("": healthy)
};

/// Thread-safe. Every request is answered exactly once through the caller's
/// sink: with a result, an error, or at the latest when its deadline expires.
class Engine final : public NodeReceiver {
 public:
  Engine(EngineOptions options, Registry& registry, Logger& log);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Collectives on GPU buffers run there (engine/gpu/); null: refused.
  /// Set once, before requests arrive. Not owned.
  void set_gpu_executor(gpu::GpuExecutor* executor);

  void set_deadlines(std::chrono::milliseconds operation, std::chrono::milliseconds rendezvous);

  /// Joins the communicator named by (secret, rendezvous address).
  void comm_init(const ClientRef& client, std::uint64_t request, const std::string& secret,
                 const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank);
  void comm_split(const ClientRef& client, std::uint64_t request, std::uint64_t comm, int color,
                  int key);
  void comm_destroy(const ClientRef& client, std::uint64_t request, std::uint64_t comm);
  void comm_abort(const ClientRef& client, std::uint64_t request, std::uint64_t comm);

  void collective(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                  const CollectiveArgs& args);
  /// `gpu` set: a stream-ordered group on GPU buffers (every item's buffer is
  /// a GPU registration): inside the node the executor copies between the
  /// ranks' mappings; across nodes the data goes through pinned host staging.
  /// `deadline`: as CollectiveArgs::deadline (0: the node's).
  void p2p_group(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                 const std::vector<P2PArgs>& items,
                 std::shared_ptr<gpu::RankSync> gpu = nullptr,
                 std::chrono::milliseconds deadline = std::chrono::milliseconds(0));

  /// A client session ended (disconnect, crash, kill): its ranks are dead.
  void client_gone(std::uint64_t session);
  /// Fails operations and rendezvous whose deadline passed. Call periodically.
  void check_deadlines();
  /// Fails everything pending with Code::aborted and `reason` (daemon stopping).
  void shutdown(const std::string& reason);

  EngineStats stats() const;
  /// The communicator `comm` of client `session`; nullopt if it has no such handle.
  std::optional<CommShape> comm_shape(std::uint64_t session, std::uint64_t comm) const;
  /// Every communicator with its ranks and in-flight operations (status).
  std::vector<CommSnapshot> snapshot() const;

  // ---- communicators that span nodes (across_nodes.cc) ----

  /// The network to other nodes' daemons; null (the default): single node only.
  /// Set before serving; `transport` must outlive the engine's use of it.
  void set_node_transport(NodeTransport* transport);
  /// Where operations between nodes run: `post` runs a function later on one
  /// thread, always the same (the daemon: its event loop, which reads the
  /// peer sockets: a chunk is then read, reduced and forwarded on one thread,
  /// with no hand-off). Each operation runs there as a fiber that yields while
  /// it waits. Unset (tests): a thread of the engine's own. Set once, before
  /// serving; that thread must call check_deadlines() periodically.
  void set_node_runner(std::function<void(std::function<void()>)> post);
  /// Chunking and algorithm choice between nodes (profile keys collectives.*).
  void set_node_algorithms(const NodeAlgorithmOptions& options);
  /// Whether a reduce-scatter over `nodes` nodes with one rank per node may
  /// leave that rank's own contribution to its client (the GPU combines it),
  /// under the algorithms set last.
  bool reduce_scatter_own_elsewhere(int nodes) const;
  /// A message another node's daemon (at `peer`) sent to this engine.
  void node_message(const std::string& peer, MessageBytes message) override;
  /// Where the payload of a node message goes, asked by the transport when
  /// the message's `head` (the bytes node_message() will get) arrives ahead
  /// of its `bytes` of payload: the buffer an operation posted for exactly
  /// that message (NodeChannel::post), or none. Thread-safe.
  Placement place_node_message(std::span<const std::byte> head, std::uint64_t bytes) override;
  /// The connection to the daemon at `address` (node `node`) ended: every
  /// communicator spanning it breaks with an error naming it and `why`.
  void node_down(const std::string& address, const std::string& node,
                 const std::string& why) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectived::engine

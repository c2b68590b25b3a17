// What clients ask the engine to do, and what the engine answers.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "engine/dtype.h"
#include "engine/registry.h"
#include "ipc/error.h"

namespace collectived::engine {

namespace gpu {
class RankSync;  // engine/gpu/executor.h
}

using Clock = std::chrono::steady_clock;

enum class OpKind : std::uint8_t {
  all_reduce,
  all_gather,
  reduce_scatter,
  broadcast,
  reduce,
  all_to_all,
  barrier,
  split,    // comm_split: a collective that creates communicators
  p2p,      // a group of sends and receives
};

std::string_view to_string(OpKind kind);

/// A place in a registered buffer, as the client names it.
struct BufferArg {
  std::uint64_t handle = 0;
  std::uint64_t offset = 0;
};

/// One rank's collective request, before validation.
struct CollectiveArgs {
  OpKind kind = OpKind::barrier;
  std::uint32_t dtype = 0;
  std::uint32_t redop = 0;
  std::uint64_t count = 0;
  std::int32_t root = 0;
  BufferArg send;
  BufferArg recv;
  /// Set for a stream-ordered collective on GPU buffers (engine/gpu/): the
  /// rank's stream hand-off. Both buffers must then be GPU registrations.
  std::shared_ptr<gpu::RankSync> gpu;
  /// The rank's own timeout (collective_comm_set_timeout): the operation
  /// fails if not started this long after this submission. 0: the node's
  /// deadlines.operation_ms.
  std::chrono::milliseconds deadline{0};
};

/// CollectiveArgs::deadline from the wire's deadlineMs (unsigned; 0: the
/// node's), capped where a time point past it would overflow the clock.
inline std::chrono::milliseconds deadline_from_wire(std::uint64_t ms) {
  constexpr std::uint64_t kMax = std::uint64_t{1} << 40;  // ~35 years
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms < kMax ? ms : kMax));
}

/// One send or receive of a p2p group.
struct P2PArgs {
  bool is_send = false;
  std::uint32_t peer = 0;
  BufferArg buffer;
  std::uint64_t count = 0;
  std::uint32_t dtype = 0;
  /// GPU groups: the client's buffer id of the item's allocation now (0: not
  /// checked); a registration made for freed and reallocated memory is refused.
  std::uint64_t buffer_id = 0;
};

/// A validated, mapped byte range of a registration; holds the mapping alive.
struct Span {
  std::shared_ptr<Registration> reg;
  std::byte* ptr = nullptr;
  std::uint64_t bytes = 0;
};

/// A communicator as one rank sees it.
struct CommInfo {
  std::uint64_t handle = 0;  ///< 0: no communicator (split with a negative color)
  std::uint32_t rank = 0;
  std::uint32_t nranks = 0;
  std::string name;
  std::uint32_t nodes = 1;  ///< nodes its ranks live on
  std::uint32_t node = 0;   ///< this node's index among them
  /// The lowest rank on node (node + 1) % nodes: whose block of a
  /// reduce-scatter's input this node sends first (first_input_read).
  std::uint32_t next_node_first_rank = 0;
};

/// The answer to one request.
struct Result {
  Code code = Code::ok;
  std::string message;
  std::uint64_t seq = 0;
  std::optional<CommInfo> comm;
};

/// Where the engine delivers results. Implemented by the daemon's client
/// session; called from the event loop or from worker threads, never under
/// an engine lock.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void complete(std::uint64_t request_id, Result result) = 0;
};

/// The client a request came from.
struct ClientRef {
  std::uint64_t session = 0;
  pid_t pid = 0;
  std::shared_ptr<CompletionSink> sink;
  /// The call comes from a daemon worker thread (not the event loop), which
  /// may run a small operation itself instead of waking a pool thread.
  bool inline_small = false;
};

}  // namespace collectived::engine

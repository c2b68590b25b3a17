// Each client's flag page and interprocess events (runtime.cc), and the
// RankSync of each rank of an operation made from them. The executor's lock
// guards the sessions.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"
#include "engine/gpu/rank_sync.h"
#include "ipc/fd.h"

namespace collectived::engine::gpu {

struct Session {
  std::shared_ptr<FlagPage> flags;
  std::map<std::uint32_t, std::shared_ptr<OpenedEvent>> events;
};

class Sessions {
 public:
  explicit Sessions(ExecutorState& state) : s_(state) {}
  Sessions(const Sessions&) = delete;
  Sessions& operator=(const Sessions&) = delete;

  /// GpuExecutor's calls of the same names.
  void attach_flags(std::uint64_t session, UniqueFd memfd, std::uint64_t bytes);
  std::shared_ptr<RankSync> make_sync(std::uint64_t session, const GpuSyncArgs& a);
  std::vector<std::shared_ptr<RankSync>> make_chunked(std::uint64_t session,
                                                      const GpuSyncArgs& args, ChunkedArgs chunked);
  /// The client went away (under the executor's lock): its page and events
  /// go to the graveyard.
  void forget_locked(std::uint64_t session);
  /// At the executor's end.
  void clear() { sessions_.clear(); }

 private:
  ExecutorState& s_;
  std::map<std::uint64_t, Session> sessions_;
};

}  // namespace collectived::engine::gpu

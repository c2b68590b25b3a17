// The daemon side of the shared-memory fast path: one thread that polls every
// attached client's submission ring, and sleeps on their doorbells when idle.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ipc/fd.h"

namespace collectived::daemon {

class ClientSession;

/// Polls rings (busy-poll with sched_yield, then sleep on eventfds). Runs
/// submissions on its own thread, never on the event loop.
class RingPoller {
 public:
  /// `spin`: how long an idle poller keeps polling before it sleeps.
  explicit RingPoller(std::chrono::microseconds spin);
  ~RingPoller();
  RingPoller(const RingPoller&) = delete;
  RingPoller& operator=(const RingPoller&) = delete;

  /// Starts polling `session`'s ring; `doorbell` is the eventfd its client
  /// writes when the poller sleeps.
  void attach(std::shared_ptr<ClientSession> session, int doorbell);
  /// Stops polling it; when this returns the poller no longer touches it.
  void detach(const ClientSession* session);
  std::size_t attached() const;

 private:
  void run();
  bool poll_all();

  const std::chrono::microseconds spin_;
  mutable std::mutex mutex_;  // held while polling: detach waits for the round
  std::vector<std::pair<std::shared_ptr<ClientSession>, int>> sessions_;
  UniqueFd epoll_;
  UniqueFd wake_;  // attach/stop wake the sleeping poller
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace collectived::daemon

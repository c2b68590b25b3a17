// The exchange with which the clients of a communicator decide to run its
// stream-ordered collectives with their own kernels (client/direct.h), and
// swap the handles of their scratch memory: rounds of "every rank's blob",
// answered when every rank has joined. It is not an operation of the
// communicator (it takes no sequence number), so a rank that never joins —
// one whose collectives are on host memory — must not leave the others
// waiting: a collective on host memory (other than a barrier) from a rank
// before the first round is answered declines the communicator, as does a
// communicator spanning nodes, a rank that leaves, or the deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace collectived::daemon {

class DirectBroker {
 public:
  /// Every rank's blob in rank order; or `declined` saying why not.
  using Reply = std::function<void(const std::vector<std::string>& blobs, const std::string& declined)>;

  /// Rank `rank` of communicator `comm` (this daemon's id for it; `nranks`
  /// ranks on `nodes` nodes) joins `round` (1, 2, 3) with `blob`; `reply`
  /// runs once (possibly before this returns). Any thread.
  void join(std::uint64_t comm, std::uint32_t round, std::uint32_t rank, std::uint32_t nranks,
            std::uint32_t nodes, std::uint64_t session, std::string blob, Reply reply);
  /// A collective on host memory (not a barrier) of rank `rank`. Hot path:
  /// one map lookup once the first round is answered. Any thread.
  void host_collective(std::uint64_t comm, std::uint32_t rank, const std::string& who);
  /// The session's joins are dropped; the rounds it was in are declined.
  void session_gone(std::uint64_t session);
  /// Forgets the communicator (destroyed).
  void comm_gone(std::uint64_t comm);
  /// Declines the rounds waiting longer than `deadline` (the profile's
  /// operation deadline), naming who did not join.
  void check_deadlines(std::chrono::milliseconds deadline);
  /// Communicators with state (for tests and status).
  std::size_t size() const;

 private:
  struct Waiter {
    std::uint32_t rank;
    std::uint64_t session;
    Reply reply;
  };
  struct Round {
    std::vector<std::optional<std::string>> blobs;
    std::vector<Waiter> waiting;
    std::chrono::steady_clock::time_point since;
    bool done = false;
    std::vector<std::string> result;
    std::string declined;
  };
  struct Comm {
    std::map<std::uint32_t, Round> rounds;
    bool first_done = false;  // round 1 answered: host collectives no longer matter
    std::string host_first;   // set: a rank's first collective was on host memory
  };
  /// Answers every waiter of `r` (lock released first); `out` collects the calls.
  static void finish(Round& r, std::vector<std::function<void()>>& out);

  mutable std::mutex mu_;
  std::map<std::uint64_t, Comm> comms_;
};

}  // namespace collectived::daemon

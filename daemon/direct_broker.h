// The exchange with which the clients of a communicator decide to run its
// stream-ordered collectives with their own kernels (client/direct.h), and
// swap the handles of their scratch memory: rounds of "every rank's blob",
// answered when every rank has joined. It is not an operation of the
// communicator (it takes no sequence number), so a rank that never joins —
// one whose collectives are on host memory — must not leave the others
// waiting. The ranks join the first round where their next collective is
// (sequence number k, the same on every rank: collectives run in one order);
// a rank whose collective k or later is on host memory is not joining, and
// declines the communicator, as do ranks on several nodes, a rank that
// leaves, and the deadline. Host collectives before k (a rank's start-up
// exchanges) do not matter.
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
  /// ranks on `nodes` nodes), whose next collective is `seq`, joins `round`
  /// (1, 2, 3) with `blob`; `reply` runs once (possibly before this
  /// returns). Any thread.
  void join(std::uint64_t comm, std::uint32_t round, std::uint32_t rank, std::uint32_t nranks,
            std::uint32_t nodes, std::uint64_t seq, std::uint64_t session, std::string blob,
            Reply reply);
  /// Rank `rank` (process `pid`) submits collective `seq` on host memory.
  /// Hot path: one map lookup, nothing allocated once recorded. Any thread.
  void host_collective(std::uint64_t comm, std::uint32_t rank, std::uint64_t seq, long pid);
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
    bool first_done = false;     // round 1 answered: host collectives no longer matter
    std::uint64_t position = 0;  // round 1: the sequence number the ranks joined at
    bool host_seen = false;      // a host collective came (the latest below)
    std::uint64_t host_seq = 0;  // the highest sequence number of a host collective
    std::uint32_t host_rank = 0;  // who made that collective
    long host_pid = 0;
  };
  /// Answers every waiter of `r` (lock released first); `out` collects the calls.
  static void finish(Round& r, std::vector<std::function<void()>>& out);

  mutable std::mutex mu_;
  std::map<std::uint64_t, Comm> comms_;
};

}  // namespace collectived::daemon

#include "daemon/direct_broker.h"

namespace collectived::daemon {

void DirectBroker::finish(Round& r, std::vector<std::function<void()>>& out) {
  r.done = true;
  if (r.declined.empty()) {
    r.result.clear();
    for (auto& b : r.blobs) r.result.push_back(b.value_or(std::string()));
  }
  for (auto& w : r.waiting) {
    out.push_back([reply = std::move(w.reply), result = r.result, declined = r.declined] {
      reply(result, declined);
    });
  }
  r.waiting.clear();
}

namespace {
std::string host_text(std::uint32_t rank, long pid, std::uint64_t seq) {
  return "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") runs collective " +
         std::to_string(seq) +
         " of the communicator on host memory (every rank must be on GPU memory for the "
         "client's kernels)";
}
}  // namespace

void DirectBroker::join(std::uint64_t comm, std::uint32_t round, std::uint32_t rank,
                        std::uint32_t nranks, std::uint32_t nodes, std::uint64_t seq,
                        std::uint64_t session, std::string blob, Reply reply) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mu_);
    Comm& c = comms_[comm];
    Round& r = c.rounds[round];
    if (r.blobs.empty()) {
      r.blobs.resize(nranks);
      r.since = std::chrono::steady_clock::now();
      // Only ranks of one node share GPUs over NVLink: the kernels need
      // every rank's scratch mapped in every rank's process.
      if (nodes > 1) {
        r.declined = "its ranks live on " + std::to_string(nodes) +
                     " nodes (the client's kernels need every rank on one node)";
      } else if (round == 1 && c.host_seen && c.host_seq >= seq) {
        r.declined = host_text(c.host_rank, c.host_pid, c.host_seq);
      }
      if (round == 1) c.position = seq;
      r.done = !r.declined.empty();
    }
    if (r.done || !r.declined.empty()) {
      calls.push_back([reply = std::move(reply), result = r.result, declined = r.declined] {
        reply(result, declined);
      });
      if (round == 1) c.first_done = true;
    } else {
      if (rank < r.blobs.size()) r.blobs[rank] = std::move(blob);
      r.waiting.push_back(Waiter{rank, session, std::move(reply)});
      bool all = true;
      for (const auto& b : r.blobs) all = all && b.has_value();
      if (all) {
        finish(r, calls);
        if (round == 1) c.first_done = true;
      }
    }
  }
  for (auto& f : calls) f();
}

void DirectBroker::host_collective(std::uint64_t comm, std::uint32_t rank, std::uint64_t seq,
                                   long pid) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mu_);
    Comm& c = comms_[comm];
    if (c.first_done) return;
    if (!c.host_seen || seq >= c.host_seq) {
      c.host_seen = true;
      c.host_seq = seq;
      c.host_rank = rank;
      c.host_pid = pid;
    }
    auto it = c.rounds.find(1);
    if (it != c.rounds.end() && !it->second.done && seq >= c.position) {
      it->second.declined = host_text(c.host_rank, c.host_pid, c.host_seq);
      finish(it->second, calls);
      c.first_done = true;
    }
  }
  for (auto& f : calls) f();
}

void DirectBroker::session_gone(std::uint64_t session) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, c] : comms_) {
      for (auto& [round, r] : c.rounds) {
        if (r.done) continue;
        std::optional<std::uint32_t> gone;
        for (auto it = r.waiting.begin(); it != r.waiting.end();) {
          if (it->session == session) {
            gone = it->rank;
            it = r.waiting.erase(it);
          } else {
            ++it;
          }
        }
        if (gone) {
          r.declined = "rank " + std::to_string(*gone) + "'s client disconnected during the exchange";
          finish(r, calls);
          if (round == 1) c.first_done = true;
        }
      }
    }
  }
  for (auto& f : calls) f();
}

void DirectBroker::comm_gone(std::uint64_t comm) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mu_);
    auto it = comms_.find(comm);
    if (it == comms_.end()) return;
    for (auto& [round, r] : it->second.rounds) {
      if (r.done) continue;
      r.declined = "the communicator was destroyed during the exchange";
      finish(r, calls);
    }
    comms_.erase(it);
  }
  for (auto& f : calls) f();
}

void DirectBroker::check_deadlines(std::chrono::milliseconds deadline) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (auto& [id, c] : comms_) {
      for (auto& [round, r] : c.rounds) {
        if (r.done || r.blobs.empty() || now - r.since < deadline) continue;
        std::string missing;
        for (std::size_t k = 0; k < r.blobs.size(); ++k) {
          if (r.blobs[k]) continue;
          missing += (missing.empty() ? "" : ", ") + std::to_string(k);
        }
        r.declined = "rank(s) " + missing + " did not reach their first stream-ordered collective within " +
                     std::to_string(deadline.count()) + " ms (deadlines.operation_ms)";
        finish(r, calls);
        if (round == 1) c.first_done = true;
      }
    }
  }
  for (auto& f : calls) f();
}

std::size_t DirectBroker::size() const {
  std::lock_guard lock(mu_);
  return comms_.size();
}

}  // namespace collectived::daemon

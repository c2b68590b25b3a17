#include "engine/gpu/completion.h"

#include <algorithm>
#include <chrono>

namespace collectived::engine::gpu {

void Completion::start() {
  completer_ = std::thread([this] { loop(); });
}

void Completion::stop() {
  {
    std::lock_guard lock(s_.mu);
    stopping_ = true;
  }
  cv_.notify_all();
  if (completer_.joinable()) completer_.join();
}

void Completion::queue_locked(std::vector<Pending> ps) {
  for (auto& p : ps) pending_.push_back(std::move(p));
  ++generation_;
  cv_.notify_one();
}

void Completion::queue_locked(Pending p) {
  pending_.push_back(std::move(p));
  ++generation_;
  cv_.notify_one();
}

void Completion::client_gone_locked(std::uint64_t session) {
  // Operations of this client still queued on the GPUs: their input may
  // never be marked ready. Mark it from here (the daemon's CPU writes the
  // word in the shared page), so that the daemon's streams (and every other
  // rank's stream behind them) go on, and fail them naming the rank.
  for (auto& p : pending_) {
    for (std::size_t r = 0; r < p.syncs.size(); ++r) {
      auto* s = static_cast<Sync*>(p.syncs[r].get());
      if (s == nullptr || s->session != session) continue;
      s->release_ready();
      if (p.failure.empty()) {
        p.failure = (r < p.who.size() ? p.who[r] : "a rank") +
                    " disconnected (its client process exited or was killed) while the operation "
                    "was queued on the GPU; the outputs are undefined";
      }
    }
  }
  cv_.notify_all();
}

void Completion::loop() {
  int idle = 0;
  std::uint64_t seen = 0;
  for (;;) {
    std::vector<Pending> finished;
    Expired expired;
    bool waiting = false;
    bool stopping = false;
    std::vector<Pending*> snapshot;
    const Take take = take_snapshot(snapshot, stopping, seen, idle);
    if (take == Take::quit) return;
    if (take == Take::again) continue;
    // Query outside the lock (the event loop enqueues under it). Entries of
    // pending_ stay put (std::list) and only this thread removes them; their
    // tails and deadlines do not change once queued.
    const auto now = Clock::now();
    std::vector<Pending*> done_now;
    bool due = stopping;
    query(snapshot, now, done_now, waiting, due);
    if (!done_now.empty() || due) collect(done_now, now, stopping, finished, expired);
    answer(finished, expired);
    if (!finished.empty() || !expired.empty()) idle = 0;
    if (waiting && finished.empty()) {
      back_off(idle);
    }
  }
}

Completion::Take Completion::take_snapshot(std::vector<Pending*>& snapshot, bool& stopping,
                                           std::uint64_t& seen, int& idle) {
  std::unique_lock lock(s_.mu);
  if (pending_.empty()) {
    if (stopping_) return Take::quit;
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    return Take::again;
  }
  if (stopping_) {
    // Stopping: every operation was answered and its streams released
    // below; give the GPU a few seconds, then leave what is stuck.
    if (stop_since_ == Clock::time_point{}) stop_since_ = Clock::now();
    if (Clock::now() - stop_since_ > std::chrono::seconds(5)) return Take::quit;
  }
  if (generation_ != seen) {
    seen = generation_;
    idle = 0;
  }
  stopping = stopping_;
  for (auto& p : pending_) snapshot.push_back(&p);
  return Take::go;
}

void Completion::query(const std::vector<Pending*>& snapshot, Clock::time_point now,
                       std::vector<Pending*>& done_now, bool& waiting, bool& due) {
  for (Pending* p : snapshot) {
    bool done = std::all_of(p->ready_words.begin(), p->ready_words.end(),
                            [](const auto& sv) { return sv.first->ready_reached(sv.second); });
    for (auto& [dev, e] : p->tails) {
      if (!done) break;
      const cudaError_t r = cudaEventQuery(e);
      if (r == cudaErrorNotReady) {
        done = false;
        break;
      }
      if (r != cudaSuccess) {
        std::lock_guard lock(s_.mu);
        if (p->failure.empty()) {
          p->failure = std::string("GPU ") + std::to_string(dev) + ": " + cudaGetErrorName(r) +
                       " (" + cudaGetErrorString(r) + ")";
          p->failure_code = Code::system;
        }
      }
    }
    if (done) {
      done_now.push_back(p);
    } else {
      waiting = true;
      if (!p->answered && now >= p->deadline) due = true;
    }
  }
}

void Completion::collect(const std::vector<Pending*>& done_now, Clock::time_point now,
                         bool stopping, std::vector<Pending>& finished, Expired& expired) {
  std::lock_guard lock(s_.mu);
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = *it;
    if (std::find(done_now.begin(), done_now.end(), &p) != done_now.end()) {
      finished.push_back(std::move(p));
      it = pending_.erase(it);
      continue;
    }
    if (!p.answered && (now >= p.deadline || stopping)) {
      p.answered = true;
      std::string why = expire(p);
      if (stopping) why = "the daemon is stopping; " + why;
      expired.emplace_back(std::move(p.done), std::move(why));
    }
    ++it;
  }
}

void Completion::answer(std::vector<Pending>& finished, Expired& expired) {
  for (auto& [done, why] : expired) {
    s_.log.warn("gpu_operation_timeout", {{"reason", why}});
    if (done) done(Code::timeout, why);
  }
  for (auto& p : finished) {
    Code code = Code::ok;
    std::string message;
    if (!p.failure.empty()) {
      code = p.failure_code;
      message = p.failure;
    }
    p.spans.clear();
    p.syncs.clear();
    p.keep.reset();
    {
      std::lock_guard lock(s_.mu);
      for (auto& [dev, e] : p.events) s_.devices[dev].free_events.push_back(e);
    }
    if (!p.answered && p.done) p.done(code, message);
  }
}

void Completion::back_off(int& idle) {
  // Short operations finish within microseconds: yield first, then
  // back off so that a long or stuck one does not burn a core.
  ++idle;
  if (idle < 2000) {
    std::this_thread::yield();
  } else if (idle < 4000) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string Completion::expire(Pending& p) {
  std::string missing;
  for (std::size_t r = 0; r < p.syncs.size(); ++r) {
    auto* s = static_cast<Sync*>(p.syncs[r].get());
    if (s == nullptr || s->ready_reached()) continue;
    if (!missing.empty()) missing += ", ";
    missing += r < p.who.size() ? p.who[r] : "rank " + std::to_string(r);
  }
  for (auto& rs : p.syncs) {
    auto* s = static_cast<Sync*>(rs.get());
    if (s == nullptr) continue;
    s->release_ready();
    if (p.releases_done) s->release_done();
  }
  if (!p.failure.empty()) return p.failure;
  if (!missing.empty()) {
    return "timed out (deadlines.operation_ms) waiting for the input of " + missing +
           ": the work queued before the operation on its CUDA stream has not finished (a "
           "stuck kernel, or a stream waiting on something that never comes); the outputs are "
           "undefined and every rank's stream was released";
  }
  return "timed out (deadlines.operation_ms): every rank's input was ready, but the GPU did not "
         "finish the operation in time" +
         blocked_behind(p) + "; the outputs are undefined and every rank's stream was released";
}

std::string Completion::blocked_behind(const Pending& p) const {
  std::string out;
  for (const Pending& q : pending_) {
    if (&q == &p) break;
    if (q.answered) continue;
    bool shared = false;
    for (const auto& s : q.streams) {
      shared = shared || std::find(p.streams.begin(), p.streams.end(), s) != p.streams.end();
    }
    if (!shared) continue;
    std::string missing;
    for (std::size_t r = 0; r < q.syncs.size(); ++r) {
      auto* s = static_cast<const Sync*>(q.syncs[r].get());
      if (s == nullptr || s->ready_reached()) continue;
      missing += (missing.empty() ? "" : ", ") +
                 (r < q.who.size() ? q.who[r] : "rank " + std::to_string(r));
    }
    out += (out.empty() ? "" : "; ") + std::string("an operation of communicator ") + q.comm +
           (missing.empty() ? " whose GPU work has not finished"
                            : " still waiting for the input of " + missing);
  }
  return out.empty() ? "" : " (queued behind, on the daemon's stream: " + out + ")";
}

}  // namespace collectived::engine::gpu

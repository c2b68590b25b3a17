// The CUDA executor's queued operations and the completion thread that
// answers them (runtime.cc): each when its GPU work is done, or at its
// deadline, naming the ranks whose input never came (expire()) or the
// operations it waits behind on the daemon's streams (blocked_behind()).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"
#include "engine/gpu/rank_sync.h"

namespace collectived::engine::gpu {

struct Pending {
  std::vector<std::pair<int, cudaEvent_t>> tails;   // (device, event): all streams' last work
  std::vector<std::pair<int, cudaEvent_t>> events;  // to return to the pools
  std::vector<std::shared_ptr<RankSync>> syncs;     // by rank; null for other nodes' ranks
  std::vector<std::string> who;                     // by rank
  std::vector<Span> spans;                          // keep the mappings open until the GPU is done
  std::shared_ptr<void> keep;                       // a staged operation's stage
  std::function<void(Code, std::string)> done;
  std::string failure;  // set when a client taking part died while it was queued
  Code failure_code = Code::remote;
  Clock::time_point deadline = Clock::time_point::max();
  bool answered = false;      // done() ran (deadline): wait for the GPU only to recycle
  bool releases_done = true;  // the op writes the ranks' done words (not stage_in)
  /// Ranks staged by their client: done also waits for their ready words to
  /// reach these values (a piece's, or the last), which the CPU reads (the
  /// syncs are held alive by `syncs`).
  std::vector<std::pair<const Sync*, std::uint32_t>> ready_words;
  /// Where it was queued (device, stream): an operation that times out with
  /// every input ready names the ones queued before it there that still
  /// wait for theirs (expire()). `comm`: its communicator, for that message.
  std::vector<std::pair<int, cudaStream_t>> streams;
  std::string comm;
};

class Completion {
 public:
  explicit Completion(ExecutorState& state) : s_(state) {}
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  /// Starts the completion thread (once the GPUs are open).
  void start();
  /// Answers what is still queued ("the daemon is stopping"), gives the GPU
  /// a few seconds, and joins the thread.
  void stop();
  /// Queues operations, in order (under the executor's lock).
  void queue_locked(std::vector<Pending> ps);
  void queue_locked(Pending p);
  /// A client went away (under the executor's lock): its operations still
  /// queued fail naming its rank, and the daemon's streams go past its input.
  void client_gone_locked(std::uint64_t session);

 private:
  enum class Take { go, again, quit };
  using Expired = std::vector<std::pair<std::function<void(Code, std::string)>, std::string>>;

  /// The completion thread: polls every queued operation's last events
  /// (cudaEventQuery: nothing here waits on the GPU without a bound), answers
  /// each when its GPU work is done, and answers at the deadline those that
  /// are not, naming the ranks whose input never became ready and releasing
  /// every rank's stream from the CPU.
  void loop();
  Take take_snapshot(std::vector<Pending*>& snapshot, bool& stopping, std::uint64_t& seen,
                     int& idle);
  void query(const std::vector<Pending*>& snapshot, Clock::time_point now,
             std::vector<Pending*>& done_now, bool& waiting, bool& due);
  void collect(const std::vector<Pending*>& done_now, Clock::time_point now, bool stopping,
               std::vector<Pending>& finished, Expired& expired);
  void answer(std::vector<Pending>& finished, Expired& expired);
  static void back_off(int& idle);
  /// The deadline passed with `p` still on the GPU (under mu_): names the
  /// ranks whose input is not ready, then lets the daemon's streams past those
  /// inputs and releases every rank's stream from the CPU (outputs undefined).
  std::string expire(Pending& p);
  /// What `p` waits behind on its streams (mu_ held): the operations queued
  /// there before it whose inputs are not all ready, naming the ranks.
  std::string blocked_behind(const Pending& p) const;

  ExecutorState& s_;
  std::condition_variable cv_;
  bool stopping_ = false;
  Clock::time_point stop_since_{};
  std::list<Pending> pending_;
  std::uint64_t generation_ = 0;  // operations queued so far (the completer's back-off)
  std::thread completer_;
};

}  // namespace collectived::engine::gpu

// One operation's NodeChannel (engine/node_algorithms.h) over the engine's
// transport and inbox: what an algorithm between nodes sends goes out as
// `data` messages (engine/node_wire.h), what it receives it takes from the
// communicator's inbox, and it waits by yielding its fiber (NodeExecutor).
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "engine/engine_core.h"

namespace collectived::engine {

class EngineChannel final : public NodeChannel {
 public:
  EngineChannel(Engine::Impl& impl, std::shared_ptr<Comm> comm, std::uint64_t seq, Desc desc,
                NodePlan plan, std::chrono::microseconds input_poll, int desc_rank,
                Clock::time_point deadline, std::string deadline_text,
                std::chrono::milliseconds budget);

  int node() const override { return comm_->my_node; }
  int nodes() const override { return static_cast<int>(comm_->node_address.size()); }

  /// Completion of this operation's sends; shared with their callbacks, which
  /// may run after the channel is gone (a failed operation does not wait).
  struct Sends {
    std::mutex mu;
    std::weak_ptr<Executor> exec;  // woken when a send is done
    int outstanding = 0;
    std::map<int, int> by_node;  // node -> sends not yet done
    Code code = Code::ok;
    std::string why;
  };
  /// What every send of the operation keeps alive: the ranks' registrations
  /// (their mappings), the scratch buffer, and the sender's own `owner`.
  struct Keep {
    std::shared_ptr<const void> op, scratch, owner;
  };

  /// Memory that the operation's sends read from and that must outlive them:
  /// the ranks' buffers. Pieces sent from them name their client mapping
  /// (OutMessage::regions), so a transport may read them in place.
  void keep_alive(std::shared_ptr<const std::vector<Span>> spans);

  void send(int to, std::uint64_t tag, std::span<const std::span<const std::byte>> pieces,
            std::shared_ptr<const void> owner) override;

  void flush() override;

  std::byte* scratch(std::size_t bytes) override;

  void compute(const std::function<void()>& work) override;

  int parallelism() const override;

  struct AsyncWork {
    std::atomic<bool> done{false};
    std::exception_ptr error;
  };

  Ticket compute_async(std::function<void()> work) override;

  bool compute_done(const Ticket& ticket) override;

  void compute_wait(const Ticket& ticket) override;

  void start_sends() override;

  NodePayload recv(int from, std::uint64_t tag) override;

  /// Where a local rank's host staging (input or output) of a staged GPU
  /// operation lies.
  struct Staging {
    const std::byte* base;
    std::uint64_t bytes;
    int rank;
  };
  /// A staged GPU operation's inputs, arriving in pieces (GpuStage::in), and
  /// where they lie. Null: all there.
  std::shared_ptr<gpu::InPieces> in_pieces;
  std::vector<Staging> inputs;
  void reading(const std::byte* p, std::uint64_t bytes) override;

  /// Returns once every piece is in: the ranks' streams reached the
  /// operation and their inputs are in host memory. The algorithms read all
  /// of every input, so that this returns at once after them, except on a
  /// broadcast's node without its root, whose one empty piece is only the
  /// streams' wait: its exchange may end first, and its outputs go back to
  /// the GPUs only after that (stage_out). Nothing to wait for without pieces.
  void await_inputs();

  /// Where chunks of the local ranks' outputs told final go (a staged GPU
  /// operation copies them back to the GPU early); unset: nowhere.
  std::function<void(const std::byte*, std::uint64_t)> on_written;
  void written(const std::byte* p, std::uint64_t bytes) override;

  void post(int from, std::uint64_t tag, std::span<std::byte> dest) override;

  /// At the end of the operation, whatever its outcome: withdraws the
  /// buffers it posted, and waits until the transport writes into none of
  /// them (a placed message still arriving when the operation failed). The
  /// reads end when their bytes are in or their connection closes (peer
  /// heartbeats bound that); past the operation budget again it gives up and
  /// logs it.
  void retract();

  /// The failure came from another node (it was told there already).
  bool remote_failure = false;

 private:
  void check_stopping();

  /// What ends this operation whatever it waits for (a message, an input
  /// piece): another node failed it, the communicator broke (a node died),
  /// this node's input copies failed (naming `rank`'s input; -1: unknown),
  /// the daemon is stopping.
  void check_ended_locked(Locked, int rank);
  std::string input_of(int rank) const;
  /// Until the first `need` pieces in copy order are in (InPieces), within
  /// the deadline; `rank`: whose input, for the errors (-1: this node's).
  void wait_pieces(std::uint32_t need, int rank);

  Engine::Impl& I_;
  std::shared_ptr<Comm> comm_;
  std::uint64_t seq_;
  Desc desc_;
  NodePlan plan_;
  std::chrono::microseconds input_poll_;  // NodeAlgorithmOptions::input_poll
  int desc_rank_;
  Clock::time_point deadline_;
  std::string deadline_text_;  // how errors name deadline_ (Impl::deadline_text)
  std::chrono::milliseconds budget_;  // the node's: bounds retract()
  std::shared_ptr<Sends> sends_ = std::make_shared<Sends>();
  std::shared_ptr<const void> keep_;
  std::vector<HostRegion*> regions_;  // of the memory keep_ holds
  bool sent_ = false;  // a send since the fiber last gave the thread back (recv)
  std::shared_ptr<const MessageBytes> scratch_;
  // Receives posted (post): their inbox keys, and the transport's holds.
  std::vector<std::tuple<std::uint64_t, std::uint64_t, int>> posted_;
  std::vector<std::weak_ptr<void>> tokens_;
};

}  // namespace collectived::engine

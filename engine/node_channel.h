// One operation's link to the other nodes of its communicator: the interface
// every algorithm between nodes is written against (engine/algorithms/). The
// engine implements it over the daemons' transport, the tests in memory; the
// algorithms see no transport header, only this and the received bytes
// (engine/message_bytes.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "engine/message_bytes.h"
#include "ipc/error.h"

namespace collectived::engine {

/// One message received from another node: `size` bytes at `data()`.
struct NodePayload {
  MessageBytes storage;
  std::size_t offset = 0;
  std::size_t size = 0;
  /// Set when the transport read the payload straight into the buffer the
  /// receiver posted for it (NodeChannel::post): the bytes are there.
  const std::byte* placed = nullptr;
  const std::byte* data() const { return placed != nullptr ? placed : storage.data() + offset; }
};

/// One operation's link to the other nodes of its communicator. Nodes are
/// numbered 0..nodes()-1 the same way on every node.
class NodeChannel {
 public:
  virtual ~NodeChannel() = default;
  virtual int node() const = 0;
  virtual int nodes() const = 0;
  /// Sends the concatenation of `pieces` to `to` under `tag` (unique within the
  /// operation for each sender and receiver). Does not block on the receiver.
  /// Zero copy: the bytes are read in place after it returns, so they must
  /// stay unchanged until flush() returns. `owner`, if given, keeps the memory
  /// alive should the operation end (fail) before the send is done.
  virtual void send(int to, std::uint64_t tag, std::span<const std::span<const std::byte>> pieces,
                    std::shared_ptr<const void> owner) = 0;
  /// Blocks until every send so far has left (the transport no longer reads
  /// its bytes). Throws Error at the deadline or if a send failed.
  virtual void flush() = 0;
  /// The sends so far start moving now, before a local pass that does not
  /// depend on them (they may otherwise wait for the next receive). Does
  /// not wait for them. Default: nothing (sends move by themselves).
  virtual void start_sends() {}
  /// A scratch buffer of at least `bytes`, valid (and kept by the channel's
  /// sends) until the operation ends; contents undefined. Reused between
  /// operations, so that large temporaries do not fault in fresh pages each
  /// time. One buffer per channel: a second call invalidates the first.
  virtual std::byte* scratch(std::size_t bytes) = 0;
  /// Runs `work` (a pass over large buffers: a local reduction, the copies to
  /// the ranks' outputs) and returns when it is done, rethrowing what it
  /// threw. The engine runs it on its worker pool, so that the thread that
  /// serves the peers (heartbeats, other operations, clients) is not held up
  /// for the milliseconds to seconds a large pass takes. Default: inline.
  virtual void compute(const std::function<void()>& work) { work(); }
  /// How many passes over chunks an algorithm may have running at once on
  /// other threads (compute_async); 1: run each inline, where the chunk is
  /// (a machine without cores to spare: the hand-off costs more than it
  /// frees).
  virtual int parallelism() const { return 1; }
  /// What compute_async returns: compute_wait(ticket) waits for that work.
  using Ticket = std::shared_ptr<void>;
  /// Starts `work` (a pass over one chunk) on the worker pool and returns at
  /// once. Every ticket must be waited for before the operation returns,
  /// also when it fails (the work writes into the ranks' buffers). Default:
  /// runs it inline.
  virtual Ticket compute_async(std::function<void()> work) {
    work();
    return nullptr;
  }
  /// Returns when the work of `ticket` is done, rethrowing what it threw.
  virtual void compute_wait(const Ticket& ticket) { (void)ticket; }
  /// Whether the work of `ticket` is done (compute_wait then returns at
  /// once). Does not block.
  virtual bool compute_done(const Ticket& ticket) {
    (void)ticket;
    return true;
  }
  /// The message `from` sent under `tag`. Blocks until it arrived; throws Error
  /// at the operation's deadline, when the communicator broke, or when the
  /// sender's operation does not match this node's (naming both).
  virtual NodePayload recv(int from, std::uint64_t tag) = 0;
  /// Offers `dest` for the message `from` sends under `tag`, if it carries
  /// exactly dest.size() bytes: the transport may then read them from the
  /// network straight into `dest`, and recv() returns a payload whose data()
  /// is dest.data() (nothing left to copy). Only an offer: a message that
  /// arrived already, or one the transport does not place, comes as usual.
  /// The operation does not write `dest` until that recv() returns, and reads
  /// it meanwhile (sends from it) only where the message is the receiver's
  /// answer to those very bytes, so that it cannot arrive before they were
  /// read; the channel waits for any write into it to end before the
  /// operation does.
  virtual void post(int from, std::uint64_t tag, std::span<std::byte> dest) {
    (void)from, (void)tag, (void)dest;
  }

  /// Bytes [p, p + bytes) of a local rank's output are final: the operation
  /// wrote them and will neither write nor move them again. Told only where
  /// the node has one rank and no pass over the whole output follows (not
  /// avg, whose division comes last), as chunks land. A staged GPU operation
  /// copies them back to the GPU at once, overlapping the rest of the
  /// exchange (the engine's channel); others ignore it. Default: nothing.
  virtual void written(const std::byte* p, std::uint64_t bytes) { (void)p, (void)bytes; }

  /// Bytes [p, p + bytes) of a local rank's input are read next (sent,
  /// reduced, copied): returns once they are there. Called before every read
  /// of an input where reads_input_in_pieces() says so, and only there. A
  /// staged GPU operation of that shape starts its exchange while its inputs
  /// are still on the GPUs and copies them to host memory in pieces
  /// meanwhile; this waits for the pieces that cover the range (the engine's
  /// channel).
  /// Throws Error at the deadline or when the copies failed. Default: they
  /// are there.
  virtual void reading(const std::byte* p, std::uint64_t bytes) { (void)p, (void)bytes; }

  void send(int to, std::uint64_t tag, const void* data, std::size_t bytes,
            std::shared_ptr<const void> owner = nullptr) {
    const std::span<const std::byte> one(static_cast<const std::byte*>(data), bytes);
    send(to, tag, std::span<const std::span<const std::byte>>(&one, 1), std::move(owner));
  }
};

}  // namespace collectived::engine

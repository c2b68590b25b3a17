// The engine's NodeTransport (engine/transport/transport.h) over verbs pairs:
// what the daemon plugs in, per peer, once verbs is selected for it. Each
// engine message is one tagged write (tag = per-peer sequence number) from a
// registered pool buffer; the receiving side reassembles the pieces and hands
// whole messages on in the order they were sent. A broken pair reports the
// peer down once (the engine then fails the communicators spanning it).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/transport/transport.h"
#include "engine/transport/verbs/verbs_transport.h"

namespace collectived::verbs {

class VerbsNodeTransport final : public engine::NodeTransport {
 public:
  /// A whole message from the daemon at `address` (Engine::node_message).
  using Deliver = std::function<void(const std::string& address, std::vector<std::byte> message)>;
  /// The pair to `address` (node `node`) broke (Engine::node_down).
  using Down = std::function<void(const std::string& address, const std::string& node,
                                  const std::string& why)>;
  /// Opens a pair to `address` on demand (the daemon: over the authenticated
  /// peer connection's exchange channel); may be empty (pairs only via add_pair).
  /// Runs in the first send() to an address without a healthy pair: it blocks
  /// that caller (at most the connect deadline it applies).
  using Connector = std::function<std::unique_ptr<Pair>(const std::string& address)>;

  VerbsNodeTransport(Device& device, Connector connector, Deliver deliver, Down down,
                     Clock::duration send_deadline);
  ~VerbsNodeTransport() override;

  /// Queues `message` (copied into one buffer here: the pair writes from its
  /// registered pool); `done` runs on the peer's sender thread once the write
  /// completed (or failed, with the pair's error naming the node).
  void send(const std::string& address, engine::OutMessage message, Done done) override;

  /// Uses `pair` for `address` (a connection the peer opened, or one made ahead).
  void add_pair(const std::string& address, std::unique_ptr<Pair> pair);

  /// Whether a healthy pair to `address` exists.
  bool connected(const std::string& address) const;

  struct Peer;

 private:
  std::shared_ptr<Peer> peer_for(const std::string& address, bool create);
  void add_pair(const std::string& address, std::unique_ptr<Pair> pair,
                const std::string& connect_error);

  Device& device_;
  Connector connector_;
  Deliver deliver_;
  Down down_;
  Clock::duration send_deadline_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
};

}  // namespace collectived::verbs

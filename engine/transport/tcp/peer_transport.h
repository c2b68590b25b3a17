// The engine's NodeTransport (engine/transport/transport.h) over the daemon's
// authenticated TCP peer connections (engine/transport/tcp/peer_manager.h): engine messages
// travel on their own channel, and arrive at Engine::node_message.
#pragma once

#include <cstdint>

#include "engine/transport/tcp/peer_manager.h"
#include "engine/engine.h"
#include "engine/transport/transport.h"

namespace collectived::tcp {

/// The peer-connection channel of engine messages (ipc/node.capnp).
inline constexpr std::uint64_t kEngineChannel = 2;

class PeerTransport final : public engine::NodeTransport {
 public:
  explicit PeerTransport(PeerManager& peers) : peers_(peers) {}
  void send(const std::string& address, engine::OutMessage message, Done done) override;

  /// Routes the engine channel and peer failures of `peers` to `engine`.
  static void connect(PeerManager& peers, engine::Engine& engine);

 private:
  PeerManager& peers_;
};

}  // namespace collectived::tcp

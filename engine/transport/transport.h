// The engine's view of the network between daemons: it sends opaque messages
// to other nodes' daemons, named by their rendezvous address ("host:port"),
// and is handed what arrives (Engine::node_message) and which nodes went away
// (Engine::node_down). Algorithms never see sockets or verbs: they talk to a
// NodeChannel (engine/node_algorithms.h) that the engine builds on this.
//
// Implementations: the daemon's authenticated TCP peer connections
// (engine/transport/tcp/peer_transport.h, over engine/transport/tcp/peer_manager.h); the verbs transport
// joins here under the same interface.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "ipc/error.h"

namespace collectived::engine {

class NodeTransport {
 public:
  /// Called once the message is handed to the network (or could not be): from
  /// any thread, never from inside send().
  using Done = std::function<void(Code code, const std::string& message)>;

  virtual ~NodeTransport() = default;
  /// Sends `message` to the daemon at `address`, opening the connection if
  /// needed. Messages to one address arrive in the order they were sent while
  /// the connection lasts. Thread-safe.
  virtual void send(const std::string& address, std::vector<std::byte> message, Done done) = 0;
};

}  // namespace collectived::engine

// The engine's NodeTransport (engine/transport/transport.h) over the daemon's
// authenticated TCP peer connections (engine/transport/tcp/device.h): engine messages
// travel on their own channel, and arrive at a NodeReceiver (the engine).
#pragma once

#include <cstdint>

#include "engine/transport/tcp/device.h"
#include "engine/transport/transport.h"

namespace collectived::engine::transport::tcp {

/// The peer-connection channel of engine messages (ipc/node.capnp).
inline constexpr std::uint64_t kEngineChannel = 2;

class NodeTransport final : public engine::NodeTransport {
 public:
  explicit NodeTransport(Device& peers) : peers_(peers) {}
  void send(const std::string& address, engine::OutMessage message, Done done) override;

  /// Routes the engine channel and peer failures of `peers` to `receiver`.
  static void connect(Device& peers, engine::NodeReceiver& receiver);

 private:
  Device& peers_;
};

}  // namespace collectived::engine::transport::tcp

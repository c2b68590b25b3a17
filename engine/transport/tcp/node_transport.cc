#include "engine/transport/tcp/node_transport.h"

namespace collectived::engine::transport::tcp {

void NodeTransport::send(const std::string& address, engine::OutMessage message, Done done) {
  peers_.send(address, kEngineChannel, std::move(message),
              [done = std::move(done)](const PeerResult& r) { done(r.code, r.message); });
}

void NodeTransport::connect(Device& peers, engine::NodeReceiver& engine) {
  peers.on_data(kEngineChannel, [&engine](const std::string& peer, std::uint64_t,
                                          std::uint64_t, engine::MessageBytes payload) {
    engine.node_message(peer, std::move(payload));
  });
  peers.on_place(kEngineChannel, [&engine](const std::string&, std::span<const std::byte> head,
                                           std::uint64_t bytes) {
    return engine.place_node_message(head, bytes);
  });
  peers.on_peer_down([&engine](const std::string& peer, const std::string& node, Code,
                               const std::string& why) { engine.node_down(peer, node, why); });
}

}  // namespace collectived::engine::transport::tcp

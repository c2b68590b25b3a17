// ClientSession's requests about peer daemons (kept apart from session.cc).
#include "engine/transport/tcp/device.h"
#include "daemon/session.h"

namespace collectived::daemon {

void ClientSession::handle_peer_ping(std::uint64_t id, wire::PeerPing::Reader req) {
  const std::string address = req.getAddress().cStr();
  std::weak_ptr<ClientSession> weak = weak_from_this();
  // Answered when the ping returns or fails, within deadlines.connect_ms.
  host_.peers().ping(address, [weak, id, address](const tcp::PingReply& r) {
    auto self = weak.lock();
    if (!self || self->closed()) return;
    if (!r.result.ok()) {
      self->host_.logger().info("peer_ping_failed", {{"session", self->id_},
                                                     {"peer", address},
                                                     {"code", to_string(r.result.code)},
                                                     {"error", r.result.message}});
      self->reply_error(id, r.result.code, "PeerPing " + address + ": " + r.result.message);
      return;
    }
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(id);
    auto pong = m.initPeerPong();
    pong.setNode(r.node.c_str());
    pong.setRttUs(r.rtt_us);
    pong.setSkewMs(r.skew_ms);
    pong.setNewConnection(r.new_connection);
    self->send(ipc::encode_frame(b));
  });
}

}  // namespace collectived::daemon

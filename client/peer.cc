// libcollective: requests about other nodes' daemons (collectivectl doctor).
#include <string>

#include "client/client_internal.h"
#include "client/collective.h"
#include "client/connection.h"

using namespace collectived;
using namespace collectived::client;

extern "C" {

collective_result_t collective_peer_ping(collective_client_t* client, const char* address,
                                         collective_peer_ping_t* out) {
  if (client == nullptr || address == nullptr || out == nullptr) {
    return fail(Code::invalid_argument, "collective_peer_ping: client, address and out must be set");
  }
  return guarded("collective_peer_ping", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initPeerPing().setAddress(address);
    // The daemon answers within its deadlines.connect_ms, which is not told to
    // clients; this bounds a daemon that stopped answering.
    auto reply = client->conn->call(b, {}, Clock::now() + kControlTimeout + kDeadlineMargin);
    if (!reply->message().isPeerPong()) {
      throw Error(Code::protocol, "the daemon answered PeerPing with another message");
    }
    auto pong = reply->message().getPeerPong();
    *out = collective_peer_ping_t{};
    copy_text(out->node_name, sizeof out->node_name, pong.getNode().cStr());
    out->rtt_us = pong.getRttUs();
    out->skew_ms = pong.getSkewMs();
    out->new_connection = pong.getNewConnection() ? 1 : 0;
  });
}

}  // extern "C"

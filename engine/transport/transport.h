// The engine's view of the network between daemons: it sends opaque messages
// to other nodes' daemons, named by their rendezvous address ("host:port"),
// and is told what arrives and which nodes went away through a NodeReceiver
// (the engine is one): transports never include the engine. Algorithms never
// see sockets or verbs: they talk to a NodeChannel (engine/node_channel.h)
// that the engine builds on this.
//
// Messages are sent without copying their bulk bytes: an OutMessage is a small
// header the transport owns plus payload pieces that it reads in place until
// it reports the send done. Received messages arrive in a MessageBytes, which
// is allocated without zero-filling (the transport writes every byte).
//
// Implementations: the daemon's authenticated TCP peer connections
// (engine/transport/tcp/node_transport.h, over engine/transport/tcp/device.h)
// and verbs (engine/transport/verbs/node_transport.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/message_bytes.h"
#include "engine/transport/host_region.h"
#include "ipc/error.h"

namespace collectived::engine {

/// One outgoing message: `head` followed by the bytes of `payload`, in order.
struct OutMessage {
  std::vector<std::byte> head;
  /// Read in place, zero copy: they must stay valid and unchanged until the
  /// send's Done has run.
  std::vector<std::span<const std::byte>> payload;
  /// Owns the memory `payload` points into, where the sender may go away
  /// before the send is done (the transport holds it until then).
  std::shared_ptr<const void> keep;
  /// Empty, or one entry per `payload` piece: the client mapping the piece
  /// lies in (null: memory of the daemon's own, such as scratch). A transport
  /// that registers memory with hardware may register the region once and
  /// read the piece in place; `keep` holds the mapping until Done.
  std::vector<HostRegion*> regions;

  std::size_t size() const {
    std::size_t n = head.size();
    for (const auto& p : payload) n += p.size();
    return n;
  }
  /// The message as one contiguous copy (transports that cannot gather).
  std::vector<std::byte> flatten() const {
    std::vector<std::byte> out;
    out.reserve(size());
    out.insert(out.end(), head.begin(), head.end());
    for (const auto& p : payload) out.insert(out.end(), p.begin(), p.end());
    return out;
  }
};

/// Where a received message's payload goes instead of a fresh MessageBytes:
/// the receiver's own buffer (an operation's output), chosen from the
/// message's head before its bytes arrive, so that they are copied once,
/// from the socket into place. `dest` null: no placement. The transport holds
/// `keep` until it writes no more into `dest` (the message complete, or its
/// connection gone); the owner waits for that before it reuses the memory.
struct Placement {
  std::byte* dest = nullptr;
  std::shared_ptr<void> keep;
};

/// What a transport tells whoever receives node messages (the engine).
/// Thread-safe: called from the transports' threads.
class NodeReceiver {
 public:
  virtual ~NodeReceiver() = default;
  /// A message another node's daemon (at `peer`) sent.
  virtual void node_message(const std::string& peer, MessageBytes message) = 0;
  /// Where the payload of a message goes, asked when its `head` (the bytes
  /// node_message() will get) arrives ahead of its `bytes` of payload.
  virtual Placement place_node_message(std::span<const std::byte> head, std::uint64_t bytes) = 0;
  /// The connection to the daemon at `address` (node `node`) ended.
  virtual void node_down(const std::string& address, const std::string& node,
                         const std::string& why) = 0;
};

class NodeTransport {
 public:
  /// Called once the message is handed to the network (or could not be): from
  /// any thread, never from inside send(). After it runs the transport no
  /// longer reads the payload.
  using Done = std::function<void(Code code, const std::string& message)>;

  virtual ~NodeTransport() = default;
  /// Sends `message` to the daemon at `address`, opening the connection if
  /// needed. Messages to one address arrive in the order they were sent while
  /// the connection lasts. Thread-safe.
  virtual void send(const std::string& address, OutMessage message, Done done) = 0;
};

}  // namespace collectived::engine

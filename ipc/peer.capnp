# The daemon <-> daemon protocol of collectived (peer connections over TCP).
#
# Serialization only, framed exactly like the client protocol (ipc/frame.h):
# a 16-byte header (magic "CDF1", payload bytes, descriptors = 0, reserved)
# followed by one `PeerMessage` as a flat array. No descriptors ever travel
# on a peer connection.
#
# A connection between two daemons is `streams` TCP streams. Each stream opens
# with the same handshake, driven by the initiator (the daemon that dialed):
#
#   initiator                                  acceptor
#   hello {version, node, nonceI, ...}    -->
#                                         <--  challenge {version, node, nonceA}
#   response {proofI}                     -->        (acceptor checks proofI)
#                                         <--  ready {proofA}
#   (initiator checks proofA)
#
#   proofI = HMAC-SHA256(secret, transcript("initiator"))
#   proofA = HMAC-SHA256(secret, transcript("acceptor"))
#
# The transcript binds the protocol version, both node names and listen
# addresses, the address the initiator dialed, the connection id, the stream
# index and both nonces (daemon/peer_auth.h has the exact encoding). The
# secret never crosses the wire; fresh nonces from both sides make a recorded
# proof worthless later; distinct role labels stop a proof from being
# reflected back. Either side that fails a check, or meets a protocol version
# it does not speak, sends `error` and closes the stream.
#
# After the handshake, each side sends `heartbeat` every deadlines.heartbeat_ms
# on every stream and answers the other's with `heartbeatAck`; `data` carries
# opaque payloads (collective traffic) split into chunks across the streams.
#
# Compatibility: `PeerHello.protocolVersion` stays field 0 of the first
# message forever, so that any two versions can tell each other apart.
# Fields and union members are only ever added.

@0xb924660ab1d14613;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("collectived::peerwire");

using Wire = import "protocol.capnp";

# 2: data chunks carry their bytes raw after the frame (DataChunk.raw).
# 3: a large message's head may travel in every chunk's frame (DataChunk.head),
#    its raw bytes then being the payload alone.
# 4: the engine's broadcast chain and pairwise all-gather wait for the
#    receiver's ready-to-receive message (engine/node_algorithms.cc): a node
#    at 3 would never send it.
const peerProtocolVersion :UInt32 = 4;

# Bytes of each side's nonce.
const nonceBytes :UInt32 = 32;

# initiator -> acceptor: the first frame of every stream.
struct PeerHello {
  protocolVersion @0 :UInt32;
  nodeName @1 :Text;
  listenAddress @2 :Text;    # "host:port" where the initiator accepts peers ("" = nowhere)
  streamIndex @3 :UInt32;    # 0 .. streams-1
  streams @4 :UInt32;        # streams of this connection
  connectionId @5 :UInt64;   # random, the same on every stream of one connection
  nonce @6 :Data;            # nonceBytes from the initiator's CSPRNG
  dialedAddress @7 :Text;    # "ip:port" the initiator connected to (bound into the proofs)
  daemonVersion @8 :Text;    # for logs
}

# acceptor -> initiator.
struct PeerChallenge {
  protocolVersion @0 :UInt32;
  nodeName @1 :Text;
  listenAddress @2 :Text;
  nonce @3 :Data;            # nonceBytes from the acceptor's CSPRNG
  daemonVersion @4 :Text;
}

# initiator -> acceptor: proves the initiator knows the secret.
struct PeerResponse {
  proof @0 :Data;
}

# acceptor -> initiator: the acceptor accepted the initiator, and proves that
# it knows the secret too.
struct PeerReady {
  proof @0 :Data;
}

# Both ways, every deadlines.heartbeat_ms on every stream (and on demand for a ping).
struct Heartbeat {
  seq @0 :UInt64;
  sentNs @1 :UInt64;         # sender's monotonic clock, echoed back (RTT)
  wallNs @2 :Int64;          # sender's wall clock (ns since the Unix epoch)
}

struct HeartbeatAck {
  seq @0 :UInt64;            # the heartbeat's seq
  echoSentNs @1 :UInt64;     # the heartbeat's sentNs
  wallNs @2 :Int64;          # the answering side's wall clock when it answered (skew)
}

# Refusal or failure; the sender closes the stream after it.
struct PeerError {
  code @0 :Wire.Code;
  message @1 :Text;          # says what failed, on which node, and why
  nodeName @2 :Text;         # the sender's node name (may be empty)
}

# One chunk of an opaque message on a channel. A message of `total` bytes is
# split into chunks of at most tcp.chunk_bytes, spread over the streams; the
# receiver reassembles them by (channel, seq) and delivers whole messages of a
# channel in seq order.
#
# The chunk's bytes are not inside the frame: `raw` bytes follow the frame on
# the same stream, unframed. So the sender writes them straight from the
# message (one gathered write, no copy into a Cap'n Proto message) and the
# receiver reads them straight into the reassembly buffer at `offset`.
# Chunks of one message never overlap; a message is complete when its chunks
# cover it.
struct DataChunk {
  channel @0 :UInt64;
  seq @1 :UInt64;            # per connection and channel: 0, 1, 2, ...
  offset @2 :UInt64;         # of this chunk in the message
  total @3 :UInt64;          # bytes of the whole message
  payload @4 :Data;          # unused since protocol 2: must be empty
  raw @5 :UInt64;            # bytes of this chunk, following the frame
  streaming @6 :Bool;        # the sender has more data queued for this connection:
                             # a hint that the receiver may copy it on a bulk thread
  head @7 :Data;             # non-empty: the message's head, the same in every chunk;
                             # offset/total/raw then count the payload after it only.
                             # The receiver can place the payload where it belongs
                             # (an operation's output) before its bytes arrive.
}

struct PeerMessage {
  union {
    hello @0 :PeerHello;
    challenge @1 :PeerChallenge;
    response @2 :PeerResponse;
    ready @3 :PeerReady;
    heartbeat @4 :Heartbeat;
    heartbeatAck @5 :HeartbeatAck;
    error @6 :PeerError;
    data @7 :DataChunk;
  }
}

# Setting up a verbs (RDMA) connection between two daemons
# (engine/transport/select.h): the payload of DataChunk messages on channel 3,
# so that queue-pair parameters travel over this authenticated connection.
# Only the daemon with the lower listen address initiates (`open`); the other
# one asks it to with `request`. Both sides then run the exchange of
# engine/transport/verbs (`data`, in `seq` order), and `abort` tells the other
# side why it failed. `refuse`: this daemon does not use verbs (the reason);
# the asking side falls back to TCP.
struct VerbsSetup {
  attempt @0 :UInt64;        # the initiator's id of this setup (0 in request and its refusal)
  seq @1 :UInt32;            # data: 0, 1, 2, ... per attempt and direction
  union {
    request @2 :Text;        # the sender's node name
    open @3 :Text;           # the initiator's node name
    accept @4 :Text;         # the responder's node name
    refuse @5 :Text;
    data @6 :Data;
    abort @7 :Text;
  }
  rails @8 :UInt32;          # open, accept: HCAs the sender opened (0: a daemon from before rails, one)
}

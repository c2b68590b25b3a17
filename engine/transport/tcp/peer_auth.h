// Authentication of daemon-to-daemon connections: the cluster secret, nonces,
// HMAC-SHA256 proofs, and the handshake of one stream as a state machine that
// knows nothing of sockets (engine/transport/tcp/pair.h ferries its frames).
//
// The handshake (ipc/peer.capnp has the message flow):
//   initiator -> hello {version, node, listen address, stream, connection id, nonceI, dialed}
//   acceptor  -> challenge {version, node, listen address, nonceA}
//   initiator -> response {proofI = HMAC(secret, transcript, "initiator")}
//   acceptor  -> ready {proofA = HMAC(secret, transcript, "acceptor")}   (after checking proofI)
//   initiator checks proofA.
// Both sides prove knowledge of the secret; the secret never crosses the wire;
// each side's fresh nonce makes recorded proofs useless; the role label stops
// a proof from being reflected; binding the dialed address stops a daemon from
// relaying another daemon's handshake to a third one. The proofs authenticate
// the connection's opening only: the traffic after it is neither encrypted nor
// integrity-protected (run peer traffic on a trusted network).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ipc/error.h"
#include "ipc/peer.capnp.h"

namespace collectived::engine::transport::tcp {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256
using Nonce = std::array<std::byte, kNonceBytes>;
using Proof = std::array<std::byte, kProofBytes>;

/// The cluster secret's bytes; wiped from memory on destruction. Move-only.
class Secret {
 public:
  Secret() = default;
  explicit Secret(std::vector<std::byte> bytes) : bytes_(std::move(bytes)) {}
  Secret(Secret&& other) noexcept = default;
  Secret& operator=(Secret&& other) noexcept;
  Secret(const Secret&) = delete;
  Secret& operator=(const Secret&) = delete;
  ~Secret();

  bool empty() const { return bytes_.empty(); }
  std::span<const std::byte> bytes() const { return bytes_; }

 private:
  void wipe();
  std::vector<std::byte> bytes_;
};

/// A loaded secret file and what is worth warning about it.
struct SecretFile {
  Secret secret;
  std::vector<std::string> warnings;  ///< e.g. readable by others
};

/// Reads the cluster secret from `path` (the profile's peer.secret_file).
/// Trailing newlines are ignored (`openssl rand -hex 32 > FILE` works).
/// Throws Error naming the file and the profile key when `path` is empty, the
/// file is missing, unreadable, not a regular file, larger than 64 KiB or
/// empty. Warns when the file is readable or writable by group or others, or
/// the secret is shorter than 16 bytes.
SecretFile load_secret(const std::string& path);

/// kNonceBytes from OpenSSL's CSPRNG (RAND_bytes). Throws Error(internal) if it fails.
Nonce random_nonce();
/// A random 64-bit value (connection ids).
std::uint64_t random_u64();

/// What both sides' proofs are computed over.
struct Transcript {
  std::uint32_t protocol_version = 0;
  std::string initiator_node;
  std::string initiator_listen;
  std::string acceptor_node;
  std::string acceptor_listen;
  std::string dialed;  ///< "ip:port" the initiator connected to
  std::uint64_t connection_id = 0;
  std::uint32_t stream_index = 0;
  std::uint32_t streams = 0;
  Nonce initiator_nonce{};
  Nonce acceptor_nonce{};
};

enum class Role { initiator, acceptor };

/// HMAC-SHA256(secret, label || role || each field length-prefixed).
Proof prove(const Secret& secret, Role role, const Transcript& transcript);
/// Constant-time comparison (CRYPTO_memcmp) of `proof` with prove(...); false
/// when the length is wrong or the secret is empty.
bool verify(const Secret& secret, Role role, const Transcript& transcript,
            std::span<const std::byte> proof);

/// Who a daemon is on the peer protocol.
struct PeerIdentity {
  std::uint32_t protocol_version = 0;
  std::string node;
  std::string listen_address;  ///< "host:port"; empty when it accepts no peers
  std::string daemon_version;
};

/// The handshake of one stream, one side. Feed it every received message
/// until state() is no longer in_progress; send every frame it returns, in
/// order (the last frame of a refusal is a PeerError, after which the stream
/// is closed).
class Handshake {
 public:
  enum class State { in_progress, done, failed };

  /// The initiator side: the daemon that dialed `dialed` ("ip:port").
  Handshake(const Secret& secret, PeerIdentity local, std::uint64_t connection_id,
            std::uint32_t stream_index, std::uint32_t streams, std::string dialed);
  /// The acceptor side, on a socket whose local end is `local_endpoint` ("ip:port").
  Handshake(const Secret& secret, PeerIdentity local, std::string local_endpoint);

  /// The frames to send first: the initiator's hello; nothing for the acceptor.
  std::vector<std::vector<std::byte>> start();
  /// Handles one received message; returns the frames to send.
  std::vector<std::vector<std::byte>> on_message(peerwire::PeerMessage::Reader message);
  /// Ends the handshake as failed (deadline, closed stream) with `why`.
  void abort(Code code, std::string why);

  State state() const { return state_; }
  bool initiator() const { return initiator_; }
  /// After done: the other side. During the handshake: what is known so far.
  const PeerIdentity& remote() const { return remote_; }
  std::uint64_t connection_id() const { return transcript_.connection_id; }
  std::uint32_t stream_index() const { return transcript_.stream_index; }
  std::uint32_t streams() const { return transcript_.streams; }
  /// After failed: why, and whether the other side refused us (it sent a PeerError).
  Code error_code() const { return error_code_; }
  const std::string& error() const { return error_; }
  bool refused_by_peer() const { return refused_by_peer_; }
  /// After failed: one side refused the other (secret, version, protocol),
  /// rather than the handshake being cut short (deadline, closed stream).
  bool refused() const { return refused_by_peer_ || refused_by_us_; }

 private:
  using Frames = std::vector<std::vector<std::byte>>;
  Frames refuse(Code code, std::string why);
  std::string remote_name() const;
  /// Whether `proof` is the other side's, as `role`, over this transcript.
  bool proves(Role role, capnp::Data::Reader proof) const;
  /// The refusal of a wrong proof (it names the secret file).
  Frames refuse_unproven();
  // One per step of the handshake (on_message dispatches).
  void on_error(peerwire::PeerMessage::Reader m);
  Frames on_hello(peerwire::PeerMessage::Reader m);
  Frames on_challenge(peerwire::PeerMessage::Reader m);
  Frames on_response(peerwire::PeerMessage::Reader m);
  Frames on_ready(peerwire::PeerMessage::Reader m);
  std::string version_mismatch(std::uint32_t theirs) const;

  const Secret& secret_;
  const bool initiator_;
  PeerIdentity local_;
  PeerIdentity remote_;
  std::string local_endpoint_;  // acceptor: where it was reached
  Transcript transcript_;
  enum class Step { hello, challenge, response, ready } expect_;
  State state_ = State::in_progress;
  Code error_code_ = Code::ok;
  std::string error_;
  bool refused_by_peer_ = false;
  bool refused_by_us_ = false;
};

/// Encodes a PeerError frame from node `node` (may be empty).
std::vector<std::byte> encode_peer_error(Code code, const std::string& message,
                                         const std::string& node = {});

}  // namespace collectived::engine::transport::tcp

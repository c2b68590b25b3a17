#include "engine/transport/tcp/peer_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "ipc/fd.h"
#include "ipc/frame.h"

namespace collectived::engine::transport::tcp {

namespace {

constexpr std::size_t kMaxSecretBytes = 64 * 1024;
constexpr std::size_t kWeakSecretBytes = 16;
constexpr std::uint32_t kMaxStreams = 64;  // tcp.streams_per_peer's upper bound
constexpr std::string_view kLabel = "collectived peer authentication v1";

const char* how_to_make_one() {
  return "write the same random bytes to it on every node, e.g. "
         "`openssl rand -hex 32 > FILE && chmod 600 FILE`";
}

void put_u32(std::vector<unsigned char>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

void put_u64(std::vector<unsigned char>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

void put_bytes(std::vector<unsigned char>& out, const void* p, std::size_t n) {
  put_u32(out, static_cast<std::uint32_t>(n));
  const auto* b = static_cast<const unsigned char*>(p);
  out.insert(out.end(), b, b + n);
}

void put_text(std::vector<unsigned char>& out, std::string_view s) {
  put_bytes(out, s.data(), s.size());
}

std::vector<unsigned char> encode(Role role, const Transcript& t) {
  std::vector<unsigned char> out;
  out.reserve(256);
  put_text(out, kLabel);
  put_text(out, role == Role::initiator ? "initiator" : "acceptor");
  put_u32(out, t.protocol_version);
  put_text(out, t.initiator_node);
  put_text(out, t.initiator_listen);
  put_text(out, t.acceptor_node);
  put_text(out, t.acceptor_listen);
  put_text(out, t.dialed);
  put_u64(out, t.connection_id);
  put_u32(out, t.stream_index);
  put_u32(out, t.streams);
  put_bytes(out, t.initiator_nonce.data(), t.initiator_nonce.size());
  put_bytes(out, t.acceptor_nonce.data(), t.acceptor_nonce.size());
  return out;
}

bool copy_nonce(capnp::Data::Reader in, Nonce& out) {
  if (in.size() != kNonceBytes) return false;
  std::memcpy(out.data(), in.begin(), kNonceBytes);
  return true;
}

capnp::Data::Reader as_data(const auto& bytes) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size());
}

std::string mode_text(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

const char* step_name(peerwire::PeerMessage::Which w) {
  switch (w) {
    case peerwire::PeerMessage::HELLO: return "hello";
    case peerwire::PeerMessage::CHALLENGE: return "challenge";
    case peerwire::PeerMessage::RESPONSE: return "response";
    case peerwire::PeerMessage::READY: return "ready";
    case peerwire::PeerMessage::HEARTBEAT: return "heartbeat";
    case peerwire::PeerMessage::HEARTBEAT_ACK: return "heartbeatAck";
    case peerwire::PeerMessage::ERROR: return "error";
    case peerwire::PeerMessage::DATA: return "data";
  }
  return "an unknown message";
}

std::vector<std::vector<std::byte>> one_frame(capnp::MessageBuilder& b) {
  std::vector<std::vector<std::byte>> out;
  out.push_back(ipc::encode_frame(b));
  return out;
}

}  // namespace

// --- Secret ------------------------------------------------------------------

Secret& Secret::operator=(Secret&& other) noexcept {
  if (this != &other) {
    wipe();
    bytes_ = std::move(other.bytes_);
  }
  return *this;
}

Secret::~Secret() { wipe(); }

void Secret::wipe() {
  if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
  bytes_.clear();
}

SecretFile load_secret(const std::string& path) {
  if (path.empty()) {
    throw Error(Code::invalid_argument,
                "peer.secret_file is empty, but daemon-to-daemon connections authenticate with "
                "the cluster secret: name a file in peer.secret_file and " +
                    std::string(how_to_make_one()));
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) {
    const int err = errno;
    throw Error(err == ENOENT ? Code::not_found : Code::system,
                "cannot read the cluster secret " + path + " (peer.secret_file): " +
                    std::strerror(err) + (err == ENOENT ? std::string("; ") + how_to_make_one()
                                                        : std::string()));
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw_errno("fstat of the cluster secret " + path);
  if (!S_ISREG(st.st_mode)) {
    throw Error(Code::invalid_argument,
                "the cluster secret " + path + " (peer.secret_file) is not a regular file");
  }
  if (static_cast<std::uint64_t>(st.st_size) > kMaxSecretBytes) {
    throw Error(Code::invalid_argument,
                "the cluster secret " + path + " (peer.secret_file) has " +
                    std::to_string(st.st_size) + " bytes; at most 65536 are allowed");
  }
  std::vector<std::byte> bytes(static_cast<std::size_t>(st.st_size) + 1);
  std::size_t got = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno("read of the cluster secret " + path);
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
    if (got > kMaxSecretBytes) {
      throw Error(Code::invalid_argument, "the cluster secret " + path +
                                              " (peer.secret_file) grew beyond 65536 bytes");
    }
    if (got == bytes.size()) bytes.resize(bytes.size() * 2);
  }
  bytes.resize(got);
  while (!bytes.empty() && (bytes.back() == std::byte{'\n'} || bytes.back() == std::byte{'\r'})) {
    bytes.pop_back();
  }
  SecretFile out{Secret(std::move(bytes)), {}};
  if (out.secret.empty()) {
    throw Error(Code::invalid_argument, "the cluster secret " + path +
                                            " (peer.secret_file) is empty; " + how_to_make_one());
  }
  if ((st.st_mode & 077) != 0) {
    out.warnings.push_back("the cluster secret " + path + " has mode " + mode_text(st.st_mode) +
                           ": group or others may read or change it; run `chmod 600 " + path +
                           "`");
  }
  if (out.secret.bytes().size() < kWeakSecretBytes) {
    out.warnings.push_back("the cluster secret " + path + " holds only " +
                           std::to_string(out.secret.bytes().size()) +
                           " bytes; use at least 16 random bytes (" + how_to_make_one() + ")");
  }
  return out;
}

// --- Nonces and proofs ---------------------------------------------------------

Nonce random_nonce() {
  Nonce n;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    throw Error(Code::internal, "RAND_bytes failed: OpenSSL's random generator is not seeded");
  }
  return n;
}

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof v) != 1) {
    throw Error(Code::internal, "RAND_bytes failed: OpenSSL's random generator is not seeded");
  }
  return v;
}

Proof prove(const Secret& secret, Role role, const Transcript& transcript) {
  if (secret.empty()) throw Error(Code::internal, "no cluster secret to prove knowledge of");
  const auto data = encode(role, transcript);
  Proof out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.bytes().data(), static_cast<int>(secret.bytes().size()),
           data.data(), data.size(), reinterpret_cast<unsigned char*>(out.data()), &len) ==
          nullptr ||
      len != kProofBytes) {
    throw Error(Code::internal, "HMAC-SHA256 failed in OpenSSL");
  }
  return out;
}

bool verify(const Secret& secret, Role role, const Transcript& transcript,
            std::span<const std::byte> proof) {
  if (secret.empty() || proof.size() != kProofBytes) return false;
  const Proof expected = prove(secret, role, transcript);
  return CRYPTO_memcmp(expected.data(), proof.data(), kProofBytes) == 0;
}

// --- Frames ----------------------------------------------------------------------

std::vector<std::byte> encode_peer_error(Code code, const std::string& message,
                                         const std::string& node) {
  capnp::MallocMessageBuilder b;
  auto e = b.initRoot<peerwire::PeerMessage>().initError();
  e.setCode(static_cast<wire::Code>(code));
  e.setMessage(message.c_str());
  e.setNodeName(node.c_str());
  return ipc::encode_frame(b);
}

// --- Handshake -------------------------------------------------------------------

Handshake::Handshake(const Secret& secret, PeerIdentity local, std::uint64_t connection_id,
                     std::uint32_t stream_index, std::uint32_t streams, std::string dialed)
    : secret_(secret), initiator_(true), local_(std::move(local)), expect_(Step::challenge) {
  transcript_.protocol_version = local_.protocol_version;
  transcript_.initiator_node = local_.node;
  transcript_.initiator_listen = local_.listen_address;
  transcript_.dialed = std::move(dialed);
  transcript_.connection_id = connection_id;
  transcript_.stream_index = stream_index;
  transcript_.streams = streams;
  transcript_.initiator_nonce = random_nonce();
  remote_.listen_address = transcript_.dialed;
}

Handshake::Handshake(const Secret& secret, PeerIdentity local, std::string local_endpoint)
    : secret_(secret),
      initiator_(false),
      local_(std::move(local)),
      local_endpoint_(std::move(local_endpoint)),
      expect_(Step::hello) {
  transcript_.protocol_version = local_.protocol_version;
  transcript_.acceptor_node = local_.node;
  transcript_.acceptor_listen = local_.listen_address;
}

std::string Handshake::remote_name() const {
  std::string s;
  if (!remote_.node.empty()) {
    s = "node " + remote_.node;
    if (!remote_.listen_address.empty()) s += " (" + remote_.listen_address + ")";
  } else if (!remote_.listen_address.empty()) {
    s = "the daemon at " + remote_.listen_address;
  } else {
    s = "the connecting daemon";
  }
  return s;
}

std::string Handshake::version_mismatch(std::uint32_t theirs) const {
  const std::string them = remote_.node.empty() ? std::string("the other daemon")
                                                : "node " + remote_.node;
  const std::string them_version =
      remote_.daemon_version.empty() ? "" : " (collectived " + remote_.daemon_version + ")";
  return "peer protocol version mismatch: " + them + them_version + " speaks peer protocol " +
         std::to_string(theirs) + ", node " + local_.node + " (collectived " +
         local_.daemon_version + ") speaks peer protocol " +
         std::to_string(local_.protocol_version) +
         "; run the same collectived version on every node";
}

std::vector<std::vector<std::byte>> Handshake::start() {
  if (!initiator_) return {};
  capnp::MallocMessageBuilder b;
  auto h = b.initRoot<peerwire::PeerMessage>().initHello();
  h.setProtocolVersion(local_.protocol_version);
  h.setNodeName(local_.node.c_str());
  h.setListenAddress(local_.listen_address.c_str());
  h.setStreamIndex(transcript_.stream_index);
  h.setStreams(transcript_.streams);
  h.setConnectionId(transcript_.connection_id);
  h.setNonce(as_data(transcript_.initiator_nonce));
  h.setDialedAddress(transcript_.dialed.c_str());
  h.setDaemonVersion(local_.daemon_version.c_str());
  return one_frame(b);
}

void Handshake::abort(Code code, std::string why) {
  if (state_ != State::in_progress) return;
  state_ = State::failed;
  error_code_ = code;
  error_ = std::move(why);
}

std::vector<std::vector<std::byte>> Handshake::refuse(Code code, std::string why) {
  // The same sentence is logged here and sent to the other side, so that both
  // logs say who refused whom and why.
  const std::string text = "node " + local_.node + " refused " + remote_name() + ": " + why;
  abort(code, text);
  refused_by_us_ = true;
  std::vector<std::vector<std::byte>> out;
  out.push_back(encode_peer_error(code, text, local_.node));
  return out;
}

bool Handshake::proves(Role role, capnp::Data::Reader proof) const {
  return verify(secret_, role, transcript_,
                {reinterpret_cast<const std::byte*>(proof.begin()), proof.size()});
}

Handshake::Frames Handshake::refuse_unproven() {
  return refuse(Code::permission_denied,
                "authentication failed: " + remote_name() +
                    " did not prove knowledge of the cluster secret; peer.secret_file must hold "
                    "the same bytes on both nodes");
}

Handshake::Frames Handshake::on_message(peerwire::PeerMessage::Reader m) {
  if (state_ != State::in_progress) return {};
  using W = peerwire::PeerMessage;
  const auto which = m.which();
  if (which == W::ERROR) {
    on_error(m);
    return {};
  }
  switch (expect_) {
    case Step::hello:
      if (which == W::HELLO) return on_hello(m);
      break;
    case Step::challenge:
      if (which == W::CHALLENGE) return on_challenge(m);
      break;
    case Step::response:
      if (which == W::RESPONSE) return on_response(m);
      break;
    case Step::ready:
      if (which == W::READY) return on_ready(m);
      break;
  }
  static constexpr const char* kExpected[] = {"hello", "challenge", "response", "ready"};
  return refuse(Code::protocol, std::string("it sent ") + step_name(which) +
                                    " during the handshake, where " +
                                    kExpected[static_cast<int>(expect_)] + " was expected");
}

void Handshake::on_error(peerwire::PeerMessage::Reader m) {
  const auto e = m.getError();
  if (remote_.node.empty()) remote_.node = std::string(e.getNodeName().cStr()).substr(0, 256);
  state_ = State::failed;
  refused_by_peer_ = true;
  error_code_ = code_from_wire(static_cast<std::uint16_t>(e.getCode()));
  if (error_code_ == Code::ok) error_code_ = Code::remote;
  error_ = e.getMessage().cStr();
  if (error_.empty()) error_ = remote_name() + " refused the connection without a reason";
}

Handshake::Frames Handshake::on_hello(peerwire::PeerMessage::Reader m) {
  using W = peerwire::PeerMessage;
  const auto h = m.getHello();
  remote_.protocol_version = h.getProtocolVersion();
  remote_.node = std::string(h.getNodeName().cStr()).substr(0, 256);
  remote_.listen_address = std::string(h.getListenAddress().cStr()).substr(0, 256);
  remote_.daemon_version = std::string(h.getDaemonVersion().cStr()).substr(0, 64);
  if (remote_.protocol_version != local_.protocol_version) {
    return refuse(Code::protocol, version_mismatch(remote_.protocol_version));
  }
  transcript_.initiator_node = remote_.node;
  transcript_.initiator_listen = remote_.listen_address;
  transcript_.dialed = h.getDialedAddress().cStr();
  transcript_.connection_id = h.getConnectionId();
  transcript_.stream_index = h.getStreamIndex();
  transcript_.streams = h.getStreams();
  if (!copy_nonce(h.getNonce(), transcript_.initiator_nonce)) {
    return refuse(Code::protocol, "its hello carries a nonce of " +
                                      std::to_string(h.getNonce().size()) + " bytes, not " +
                                      std::to_string(kNonceBytes));
  }
  if (transcript_.streams == 0 || transcript_.streams > kMaxStreams ||
      transcript_.stream_index >= transcript_.streams) {
    return refuse(Code::protocol, "stream " + std::to_string(transcript_.stream_index) +
                                      " of " + std::to_string(transcript_.streams) +
                                      " is out of range (1..64 streams)");
  }
  if (transcript_.dialed != local_endpoint_) {
    return refuse(Code::permission_denied,
                  "it dialed " + transcript_.dialed + " but reached this daemon at " +
                      local_endpoint_ +
                      " (address translation or a relay between the nodes; peer "
                      "connections must reach the daemon's own address)");
  }
  transcript_.acceptor_nonce = random_nonce();
  capnp::MallocMessageBuilder b;
  auto c = b.initRoot<W>().initChallenge();
  c.setProtocolVersion(local_.protocol_version);
  c.setNodeName(local_.node.c_str());
  c.setListenAddress(local_.listen_address.c_str());
  c.setNonce(as_data(transcript_.acceptor_nonce));
  c.setDaemonVersion(local_.daemon_version.c_str());
  expect_ = Step::response;
  return one_frame(b);
}

Handshake::Frames Handshake::on_challenge(peerwire::PeerMessage::Reader m) {
  using W = peerwire::PeerMessage;
  const auto c = m.getChallenge();
  remote_.protocol_version = c.getProtocolVersion();
  remote_.node = std::string(c.getNodeName().cStr()).substr(0, 256);
  const std::string listen = c.getListenAddress().cStr();
  remote_.listen_address = listen.empty() ? transcript_.dialed : listen.substr(0, 256);
  remote_.daemon_version = std::string(c.getDaemonVersion().cStr()).substr(0, 64);
  if (remote_.protocol_version != local_.protocol_version) {
    return refuse(Code::protocol, version_mismatch(remote_.protocol_version));
  }
  if (!copy_nonce(c.getNonce(), transcript_.acceptor_nonce)) {
    return refuse(Code::protocol, "its challenge carries a nonce of " +
                                      std::to_string(c.getNonce().size()) + " bytes, not " +
                                      std::to_string(kNonceBytes));
  }
  transcript_.acceptor_node = remote_.node;
  transcript_.acceptor_listen = listen;
  const Proof proof = prove(secret_, Role::initiator, transcript_);
  capnp::MallocMessageBuilder b;
  b.initRoot<W>().initResponse().setProof(as_data(proof));
  expect_ = Step::ready;
  return one_frame(b);
}

Handshake::Frames Handshake::on_response(peerwire::PeerMessage::Reader m) {
  using W = peerwire::PeerMessage;
  if (!proves(Role::initiator, m.getResponse().getProof())) return refuse_unproven();
  const Proof proof = prove(secret_, Role::acceptor, transcript_);
  capnp::MallocMessageBuilder b;
  b.initRoot<W>().initReady().setProof(as_data(proof));
  state_ = State::done;
  return one_frame(b);
}

Handshake::Frames Handshake::on_ready(peerwire::PeerMessage::Reader m) {
  if (!proves(Role::acceptor, m.getReady().getProof())) return refuse_unproven();
  state_ = State::done;
  return {};
}

}  // namespace collectived::engine::transport::tcp

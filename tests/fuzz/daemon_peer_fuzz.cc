// Fuzz target: daemon -> daemon frames through the real peer listener of an
// in-process collectived (Device, Pair, PeerStream).
//
// Input: byte 0 is flags (bit 0: first authenticate honestly, with the
// cluster secret, as a one-stream connection; else the bytes arrive before
// any handshake); the rest is the byte stream sent on the connection. Then
// the harness half-closes and waits for the daemon to close the stream:
// one that does not within 30 s is a finding, like a crash or a sanitizer
// report.
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "engine/transport/tcp/peer_auth.h"
#include "ipc/frame.h"
#include "tests/fuzz/inproc_daemon.h"

using namespace collectived;
namespace tcp = collectived::engine::transport::tcp;

namespace {

// Reads one frame (blocking, 5 s). nullptr when the daemon closed.
std::unique_ptr<ipc::IncomingFrame> read_frame(int fd, ipc::FrameDecoder& decoder) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    if (auto f = decoder.next()) return f;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "the daemon did not answer the handshake within 5 s\n");
      std::abort();
    }
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, 100);
    std::vector<UniqueFd> fds;
    auto r = ipc::recv_some(fd, decoder.read_space(), fds);
    if (r.eof) return nullptr;
    decoder.commit(r.bytes);
  }
}

// The honest initiator's side of daemon/peer_auth.h, over the socket.
bool authenticate(int fd, const fuzz::InprocDaemon& d) {
  tcp::Secret secret(std::vector<std::byte>(reinterpret_cast<const std::byte*>(d.secret.data()),
                                               reinterpret_cast<const std::byte*>(d.secret.data()) +
                                                   d.secret.size()));
  tcp::PeerIdentity me;
  me.protocol_version = peerwire::PEER_PROTOCOL_VERSION;
  me.node = "fuzzer";
  me.listen_address = "";  // accepts no peers: the daemon never dials back
  me.daemon_version = "fuzz";
  tcp::Handshake hs(secret, me, tcp::random_u64(), 0, 1,
                       "127.0.0.1:" + std::to_string(d.peer_port));
  ipc::FrameDecoder decoder(ipc::Limits::for_max_frame(64 * 1024));
  auto send = [&](const std::vector<std::vector<std::byte>>& frames) {
    for (const auto& f : frames) {
      if (!fuzz::send_all(fd, f)) return false;
    }
    return true;
  };
  if (!send(hs.start())) return false;
  while (hs.state() == tcp::Handshake::State::in_progress) {
    auto frame = read_frame(fd, decoder);
    if (!frame) return false;
    if (!send(hs.on_message(frame->root<peerwire::PeerMessage>()))) return false;
  }
  if (hs.state() != tcp::Handshake::State::done) {
    std::fprintf(stderr, "honest handshake failed: %s\n", hs.error().c_str());
    std::abort();
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const auto& d = fuzz::daemon();
  UniqueFd s = fuzz::connect_tcp(d.peer_port);
  bool open = true;
  if (data[0] & 1) open = authenticate(s.get(), d);
  if (open) fuzz::send_all(s.get(), {reinterpret_cast<const std::byte*>(data + 1), size - 1});
  // 30 s: one authenticated DataChunk announcing a 1 GiB message makes the
  // daemon allocate and zero all of it at once (seconds under ASan).
  fuzz::drain_until_closed(s.get(), 30);
  return 0;
}

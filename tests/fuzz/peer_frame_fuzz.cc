// Fuzz target: daemon -> daemon frames before authentication, as an accepting
// or dialing daemon reads them (ipc/peer.capnp, daemon/peer_auth.h).
//
// Input: byte 0 picks the side (even: the acceptor, odd: the initiator) and
// the read size; the rest is the byte stream from the other daemon. Frames
// are decoded under the unauthenticated limit (64 KiB), each PeerMessage is
// read field by field and handed to the real handshake state machine until it
// finishes; what it answers is decoded again, as the other side would.
#include <algorithm>
#include <capnp/pretty-print.h>
#include <kj/exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "engine/transport/tcp/peer_auth.h"
#include "ipc/error.h"
#include "ipc/frame.h"

using namespace collectived;
namespace tcp = collectived::engine::transport::tcp;
using tcp::Handshake;

namespace {

tcp::PeerIdentity identity() {
  tcp::PeerIdentity id;
  id.protocol_version = peerwire::PEER_PROTOCOL_VERSION;
  id.node = "fuzz-node";
  id.listen_address = "127.0.0.1:47600";
  id.daemon_version = "fuzz";
  return id;
}

const tcp::Secret& secret() {
  static const tcp::Secret s(std::vector<std::byte>(32, std::byte{0x5a}));
  return s;
}

void check_answers(const std::vector<std::vector<std::byte>>& frames) {
  for (const auto& f : frames) {
    // What the state machine sends must be a well-formed frame.
    try {
      auto frame = ipc::decode_frame(f, ipc::Limits::for_max_frame(64 * 1024));
      ipc::with_protocol_checks("answer", [&] {
        auto text = kj::str(frame->root<peerwire::PeerMessage>());
        (void)text;
      });
    } catch (const Error& e) {
      std::fprintf(stderr, "the handshake sent a malformed frame: %s\n", e.what());
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const bool initiator = (data[0] & 1) != 0;
  const std::size_t step = (data[0] >> 1) + 1;
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), size - 1);

  auto hs = initiator ? std::make_unique<Handshake>(secret(), identity(), 42, 0, 1,
                                                    "127.0.0.1:47601")
                      : std::make_unique<Handshake>(secret(), identity(), "127.0.0.1:47600");
  check_answers(hs->start());

  ipc::FrameDecoder decoder(ipc::Limits::for_max_frame(64 * 1024));
  try {
    std::size_t at = 0;
    while (at < bytes.size() && hs->state() == Handshake::State::in_progress) {
      auto space = decoder.read_space();
      const std::size_t n = std::min({step, space.size(), bytes.size() - at});
      std::memcpy(space.data(), bytes.data() + at, n);
      at += n;
      decoder.commit(n);
      while (auto frame = decoder.next()) {
        ipc::with_protocol_checks("peer", [&] {
          auto m = frame->root<peerwire::PeerMessage>();
          auto text = kj::str(m);
          (void)text;
          check_answers(hs->on_message(m));
        });
        if (hs->state() != Handshake::State::in_progress) break;
      }
    }
  } catch (const Error&) {
    // The link closes the stream.
  }
  if (hs->state() == Handshake::State::in_progress) hs->abort(Code::timeout, "fuzz input ended");
  if (hs->state() == Handshake::State::done) {
    // Only an honest peer that knows the secret gets here; the fuzzer cannot.
    std::fprintf(stderr, "handshake completed without the secret\n");
    std::abort();
  }
  return 0;
}

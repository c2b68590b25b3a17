// Fuzz target: client -> daemon frames through the real daemon: one client
// session of an in-process collectived per input (session dispatch, registry,
// memfd mapping, engine: rendezvous, collectives, send/recv, split, destroy).
//
// Input: byte 0 is flags (bit 0: skip the Hello this harness sends first);
// the rest is a stream of frames. Each frame is sent with as many descriptors
// as its header declares, in the same sendmsg as its first byte; the low bits
// of the header's reserved word (which the daemon ignores) pick their kind:
// sealed memfds (0, what libcollective sends), unsealed memfds, eventfds,
// pipes. Then the harness half-closes and waits for the daemon to
// close the session: a daemon that does not within 10 s is a finding, like a
// crash or a sanitizer report.
//
// Handles: the daemon numbers registrations and communicators daemon-wide, so
// a recorded input could not name its own. A well-formed Deregister,
// Collective, P2PGroup, CommSplit, CommDestroy or CommAbort whose handle is
// 1..8 has it replaced by the session's n-th registration (buffers) or
// communicator (comm) when there is one; the harness waits for the answer to
// each RegisterHost and CommInit (1 s at most) to learn them. Other values
// go through unchanged (forged and foreign handles).
//
// Addresses: the fuzzer must never make the daemon reach another host (or
// another test's daemon on this one). A CommInit's rendezvous address is set
// to this daemon's own unless it is a "local:" one, and a PeerPing's to this
// daemon's own peer listener.
#include <fcntl.h>
#include <sys/eventfd.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <capnp/message.h>

#include <cstddef>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#include "ipc/frame.h"
#include "ipc/protocol.capnp.h"
#include "tests/fuzz/inproc_daemon.h"

using namespace collectived;

namespace {

std::uint32_t get_u32(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
         std::uint32_t(p[3]) << 24;
}

UniqueFd make_fd(unsigned kind) {
  switch (kind % 4) {
    case 0: {  // what libcollective sends: a sealed memfd
      UniqueFd fd(::memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING));
      if (::ftruncate(fd.get(), 1 << 16) != 0) std::abort();
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
      return fd;
    }
    case 1: {  // a memfd the client could still truncate
      UniqueFd fd(::memfd_create("fuzz", MFD_CLOEXEC));
      if (::ftruncate(fd.get(), 1 << 16) != 0) std::abort();
      return fd;
    }
    case 2:
      return UniqueFd(::eventfd(0, EFD_CLOEXEC));
    default: {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) std::abort();
      ::close(p[1]);
      return UniqueFd(p[0]);
    }
  }
}

std::vector<std::byte> hello_frame() {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(1);
  auto h = m.initHello();
  h.setProtocolVersion(wire::PROTOCOL_VERSION);
  h.setClientName("fuzz");
  h.setLibraryVersion("fuzz");
  return ipc::encode_frame(b);
}

// What this session has been given, in order.
struct Handles {
  std::vector<std::uint64_t> buffers;
  std::vector<std::uint64_t> comms;
  std::uint64_t buffer(std::uint64_t h) const {
    return h >= 1 && h <= buffers.size() ? buffers[h - 1] : h;
  }
  std::uint64_t comm(std::uint64_t h) const {
    return h >= 1 && h <= comms.size() ? comms[h - 1] : h;
  }
};

// A copy of a well-formed frame with its relative handles replaced; empty when
// the frame is not one the daemon would accept as a message (sent as is).
std::vector<std::byte> with_handles(const fuzz::InprocDaemon& d,
                                    std::span<const std::byte> frame, std::uint32_t nfds,
                                    const Handles& h, wire::Message::Which& which,
                                    std::uint64_t& id) {
  try {
    // decode_frame reads ring slots, which carry no descriptors.
    std::vector<std::byte> copy(frame.begin(), frame.end());
    if (copy.size() >= ipc::kHeaderBytes) std::memset(copy.data() + 8, 0, 4);
    // The daemon's own limits: a frame it would read, the harness reads too.
    auto in = ipc::decode_frame(copy, ipc::Limits::for_max_frame(d.max_frame_bytes));
    return ipc::with_protocol_checks("harness", [&] {
      auto m = in->message();
      which = m.which();
      id = m.getId();
      capnp::MallocMessageBuilder b;
      b.setRoot(m);
      auto out = b.getRoot<wire::Message>();
      switch (which) {
        case wire::Message::COMM_INIT:
          if (!std::string_view(m.getCommInit().getRendezvous().cStr()).starts_with("local:")) {
            out.getCommInit().setRendezvous(d.rendezvous.c_str());
          }
          break;
        case wire::Message::PEER_PING:
          out.getPeerPing().setAddress(("127.0.0.1:" + std::to_string(d.peer_port)).c_str());
          break;
        case wire::Message::DEREGISTER:
          out.getDeregister().setHandle(h.buffer(m.getDeregister().getHandle()));
          break;
        case wire::Message::COLLECTIVE: {
          auto c = out.getCollective();
          c.setComm(h.comm(c.getComm()));
          c.getSend().setHandle(h.buffer(c.getSend().getHandle()));
          c.getRecv().setHandle(h.buffer(c.getRecv().getHandle()));
          break;
        }
        case wire::Message::P2P_GROUP: {
          auto g = out.getP2pGroup();
          g.setComm(h.comm(g.getComm()));
          for (auto item : g.getItems()) {
            item.getBuffer().setHandle(h.buffer(item.getBuffer().getHandle()));
          }
          break;
        }
        case wire::Message::COMM_SPLIT:
          out.getCommSplit().setComm(h.comm(m.getCommSplit().getComm()));
          break;
        case wire::Message::COMM_DESTROY:
          out.getCommDestroy().setComm(h.comm(m.getCommDestroy().getComm()));
          break;
        case wire::Message::COMM_ABORT:
          out.getCommAbort().setComm(h.comm(m.getCommAbort().getComm()));
          break;
        default:
          return std::vector<std::byte>{};
      }
      return ipc::encode_frame(b, nfds);
    });
  } catch (const Error&) {
    return {};
  }
}

// Reads answers for up to `timeout`, recording registrations and
// communicators, until the answer to `id` arrived. False: the daemon closed.
bool collect(int fd, ipc::FrameDecoder& decoder, Handles& h, std::uint64_t id,
             std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    while (auto f = decoder.next()) {
      auto m = f->message();
      if (m.isRegistered()) h.buffers.push_back(m.getRegistered().getHandle());
      if (m.isCommReady() && m.getCommReady().getComm() != 0) {
        h.comms.push_back(m.getCommReady().getComm());
      }
      if (m.getId() == id) return true;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return true;
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
    std::vector<UniqueFd> fds;
    auto r = ipc::recv_some(fd, decoder.read_space(), fds);
    if (r.eof) return false;
    decoder.commit(r.bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const auto& d = fuzz::daemon();
  const std::uint8_t flags = data[0];
  UniqueFd s = fuzz::connect_unix(d.socket);
  bool open = true;
  if ((flags & 1) == 0) {
    static const std::vector<std::byte> hello = hello_frame();
    open = fuzz::send_all(s.get(), hello);
  }
  std::size_t at = 1;
  Handles handles;
  ipc::FrameDecoder answers(ipc::Limits::for_max_frame(1 << 24));
  while (open && at < size) {
    std::size_t len = size - at;
    std::vector<UniqueFd> owned;
    std::uint32_t nfds = 0;
    if (len >= ipc::kHeaderBytes && get_u32(data + at) == ipc::kFrameMagic) {
      const std::uint64_t payload = get_u32(data + at + 4);
      nfds = std::min<std::uint32_t>(get_u32(data + at + 8), 12);
      len = std::min<std::uint64_t>(len, ipc::kHeaderBytes + payload);
      const std::uint32_t kinds = get_u32(data + at + 12);
      for (std::uint32_t i = 0; i < nfds; ++i) owned.push_back(make_fd(kinds >> (2 * i)));
    }
    std::span<const std::byte> frame(reinterpret_cast<const std::byte*>(data + at), len);
    at += len;
    wire::Message::Which which = wire::Message::HELLO;
    std::uint64_t id = 0;
    std::vector<std::byte> rewritten = with_handles(d, frame, nfds, handles, which, id);
    if (!rewritten.empty()) frame = rewritten;
    std::vector<int> fds;
    for (auto& f : owned) fds.push_back(f.get());
    open = fuzz::send_all(s.get(), frame, fds);
    if (open && (which == wire::Message::REGISTER_HOST || which == wire::Message::COMM_INIT)) {
      open = collect(s.get(), answers, handles, id, std::chrono::milliseconds(1000));
    }
  }
  fuzz::drain_until_closed(s.get(), 10);
  return 0;
}

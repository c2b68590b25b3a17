// Fuzz target: client -> daemon frames through the real daemon: one client
// session of an in-process collectived per input (session dispatch, registry,
// memfd mapping, engine: rendezvous, collectives, send/recv, split, destroy).
//
// Input: byte 0 is flags (bit 0: skip the Hello this harness sends first;
// bits 1-7: which kinds of descriptors to attach); the rest is a stream of
// frames. Each frame is sent with as many descriptors as its header declares
// (sealed memfds, unsealed memfds, eventfds, pipes), in the same sendmsg as
// its first byte. Then the harness half-closes and waits for the daemon to
// close the session: a daemon that does not within 10 s is a finding, like a
// crash or a sanitizer report.
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <capnp/message.h>

#include <cstddef>
#include <cstdint>
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
  unsigned fd_kind = flags >> 1;
  while (open && at < size) {
    std::size_t len = size - at;
    std::vector<UniqueFd> owned;
    if (len >= ipc::kHeaderBytes && get_u32(data + at) == ipc::kFrameMagic) {
      const std::uint64_t payload = get_u32(data + at + 4);
      const std::uint32_t nfds = std::min<std::uint32_t>(get_u32(data + at + 8), 12);
      len = std::min<std::uint64_t>(len, ipc::kHeaderBytes + payload);
      for (std::uint32_t i = 0; i < nfds; ++i) owned.push_back(make_fd(fd_kind++));
    }
    std::vector<int> fds;
    for (auto& f : owned) fds.push_back(f.get());
    open = fuzz::send_all(s.get(), {reinterpret_cast<const std::byte*>(data + at), len}, fds);
    at += len;
  }
  fuzz::drain_until_closed(s.get(), 10);
  return 0;
}

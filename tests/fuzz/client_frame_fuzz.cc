// Fuzz target: client -> daemon frames as the daemon's reader sees them.
//
// Input: byte 0 picks how the stream is cut into reads and how many
// descriptors arrive with them; the rest is the byte stream. Every completed
// frame is read field by field (kj::str walks the whole message through the
// generated readers), as the daemon's dispatch would, under the daemon's own
// limits. The same bytes are also offered as one ring slot (decode_frame).
#include <fcntl.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <capnp/pretty-print.h>
#include <kj/exception.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "ipc/error.h"
#include "ipc/frame.h"

using namespace collectived;

namespace {

void read_all(ipc::IncomingFrame& frame) {
  try {
    ipc::with_protocol_checks("fuzz", [&] {
      auto m = frame.message();
      (void)m.getId();
      (void)m.which();
      // Walks every field, list and text through the generated readers, with
      // the frame's traversal and nesting limits.
      auto text = kj::str(m);
      (void)text;
    });
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t mode = data[0];
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), size - 1);

  // A ring slot holds exactly one frame.
  try {
    auto frame = ipc::decode_frame(bytes, ipc::Limits::for_max_frame(512));
    read_all(*frame);
  } catch (const Error&) {
  }

  // The socket reader: reads of 1..128 bytes (mode's low bits), descriptors
  // arriving with some reads (mode's high bits).
  ipc::FrameDecoder decoder(ipc::Limits::for_max_frame(1 << 16));
  const std::size_t step = (mode & 0x7f) + 1;
  const unsigned fds_per_read = mode >> 7;
  try {
    std::size_t at = 0;
    while (at < bytes.size()) {
      auto space = decoder.read_space();
      const std::size_t n = std::min({step, space.size(), bytes.size() - at});
      std::memcpy(space.data(), bytes.data() + at, n);
      at += n;
      decoder.commit(n);
      std::vector<UniqueFd> fds;
      static const int proto = ::eventfd(0, EFD_CLOEXEC);
      for (unsigned i = 0; i < fds_per_read; ++i) fds.emplace_back(::fcntl(proto, F_DUPFD_CLOEXEC, 0));
      decoder.add_fds(std::move(fds));
      while (auto frame = decoder.next()) read_all(*frame);
    }
  } catch (const Error&) {
    // The stream can no longer be trusted: the daemon closes the session.
  }
  return 0;
}

// Private to verbs/pair.cc and verbs/device.cc (through verbs/pair_impl.h):
// the wire formats of a pair: the header in front of every slot's payload,
// work request ids, credit immediates, and the connection parameters the two
// sides exchange.
#pragma once

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "engine/transport/verbs/devices.h"
#include "engine/transport/verbs/ibverbs_functions.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "engine/transport/verbs/memory.h"
#include "engine/transport/verbs/resources.h"
#include "ipc/error.h"

namespace collectived::engine::transport::verbs {
namespace detail {

// ---- Wire formats ---------------------------------------------------------------

// In front of every slot's payload. 64 bytes so that the payload starts on a
// cache line; written by the sender with the payload in one RDMA WRITE (two
// scatter-gather entries: header, then the source range).
struct SlotHeader {
  std::uint32_t magic;
  std::uint32_t length;  // payload bytes in this slot
  std::uint64_t tag;
  std::uint64_t offset;  // of the payload in the message
  std::uint64_t total;   // message size
  std::uint8_t pad[32];
};
static_assert(sizeof(SlotHeader) == 64);
constexpr std::uint32_t kSlotMagic = 0x534c4f54;  // "SLOT"
constexpr std::size_t kHeaderBytes = sizeof(SlotHeader);

// The immediate of a WRITE WITH IMMEDIATE: a data write names the slot it
// filled; a credit (bit 31) returns `count` slots from `first` to the writer.
constexpr std::uint32_t kCreditBit = 0x80000000u;
inline std::uint32_t credit_imm(std::uint32_t first, std::uint32_t count) {
  return kCreditBit | (count << 16) | first;
}

// Work request ids: [generation:12][kind:4][qp:8][value:40]. The generation
// tells completions of a connection torn down by rebuild() from current ones.
// A data write carries its operation's id, not the slot: the reader may give
// the slot back (and the writer reuse it) before the writer has polled the
// write's own completion, since acknowledgements and credits travel apart.
enum class WrKind : std::uint8_t { data = 1, credit = 2, probe = 3, recv = 4 };
constexpr std::uint64_t kGenerationMask = 0xfff;
constexpr std::uint64_t kValueMask = (1ull << 40) - 1;
inline std::uint64_t wr_id(std::uint64_t generation, WrKind kind, std::uint32_t qp, std::uint64_t value) {
  return ((generation & kGenerationMask) << 52) | (static_cast<std::uint64_t>(kind) << 48) |
         (static_cast<std::uint64_t>(qp & 0xff) << 40) | (value & kValueMask);
}
inline std::uint64_t wr_generation(std::uint64_t id) { return id >> 52; }
inline WrKind wr_kind(std::uint64_t id) { return static_cast<WrKind>((id >> 48) & 0xf); }
inline std::uint32_t wr_qp(std::uint64_t id) { return static_cast<std::uint32_t>((id >> 40) & 0xff); }
inline std::uint64_t wr_value(std::uint64_t id) { return id & kValueMask; }

// Queue-pair parameters exchanged over the channel (little-endian).
constexpr std::uint32_t kHelloMagic = 0x50515643;  // "CVQP"
constexpr std::uint32_t kReadyMagic = 0x44525643;  // "CVRD"
constexpr std::uint16_t kWireVersion = 1;
constexpr std::uint32_t kMaxQps = 128;

struct Endpoint {
  std::string node;
  std::uint16_t lid = 0;
  std::uint8_t gid[16]{};
  std::uint32_t mtu = 0;  // bytes
  std::vector<std::uint32_t> qpns;
  std::vector<std::uint32_t> psns;
  std::uint64_t slot_addr = 0;
  std::uint32_t slot_rkey = 0;
  std::uint32_t slot_count = 0;
  std::uint64_t slot_stride = 0;
  std::uint64_t slot_payload = 0;
};

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void u16(std::uint16_t v) { le(v, 2); }
  void u32(std::uint32_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<std::byte>& out() { return out_; }

 private:
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::byte>(v >> (8 * i)));
  }
  std::vector<std::byte> out_;
};

class Reader {
 public:
  Reader(const std::vector<std::byte>& in, std::string peer) : in_(in), peer_(std::move(peer)) {}
  std::uint64_t le(int n) {
    need(n);
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(in_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }
  std::uint8_t u8() { return static_cast<std::uint8_t>(le(1)); }
  std::uint16_t u16() { return static_cast<std::uint16_t>(le(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(le(4)); }
  std::uint64_t u64() { return le(8); }
  void bytes(void* p, std::size_t n) {
    need(n);
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
  }

 private:
  void need(std::size_t n) {
    if (pos_ + n > in_.size()) {
      throw Error(Code::protocol, "verbs connection parameters from " + peer_ + " are truncated (" +
                                      std::to_string(in_.size()) + " bytes)");
    }
  }
  const std::vector<std::byte>& in_;
  std::string peer_;
  std::size_t pos_ = 0;
};

inline std::vector<std::byte> encode(const Endpoint& e) {
  Writer w;
  w.u32(kHelloMagic);
  w.u16(kWireVersion);
  w.u16(static_cast<std::uint16_t>(e.node.size()));
  w.bytes(e.node.data(), e.node.size());
  w.u16(e.lid);
  w.bytes(e.gid, 16);
  w.u32(e.mtu);
  w.u32(static_cast<std::uint32_t>(e.qpns.size()));
  for (std::size_t i = 0; i < e.qpns.size(); ++i) {
    w.u32(e.qpns[i]);
    w.u32(e.psns[i]);
  }
  w.u64(e.slot_addr);
  w.u32(e.slot_rkey);
  w.u32(e.slot_count);
  w.u64(e.slot_stride);
  w.u64(e.slot_payload);
  return std::move(w.out());
}

inline Endpoint decode(const std::vector<std::byte>& in, const std::string& peer) {
  Reader r(in, peer);
  const std::uint32_t magic = r.u32();
  if (magic != kHelloMagic) {
    throw Error(Code::protocol,
                "expected verbs connection parameters from " + peer + ", got another message");
  }
  const std::uint16_t version = r.u16();
  if (version != kWireVersion) {
    throw Error(Code::protocol, "verbs connection parameters from " + peer + " have version " +
                                    std::to_string(version) + ", this node speaks " +
                                    std::to_string(kWireVersion));
  }
  Endpoint e;
  e.node.resize(r.u16());
  r.bytes(e.node.data(), e.node.size());
  e.lid = r.u16();
  r.bytes(e.gid, 16);
  e.mtu = r.u32();
  const std::uint32_t n = r.u32();
  if (n == 0 || n > kMaxQps) {
    throw Error(Code::protocol, "verbs connection parameters from " + peer + " name " +
                                    std::to_string(n) + " queue pairs (1.." +
                                    std::to_string(kMaxQps) + ")");
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    e.qpns.push_back(r.u32() & 0xffffff);
    e.psns.push_back(r.u32() & 0xffffff);
  }
  e.slot_addr = r.u64();
  e.slot_rkey = r.u32();
  e.slot_count = r.u32();
  e.slot_stride = r.u64();
  e.slot_payload = r.u64();
  if (e.slot_count == 0 || e.slot_count > 0x7fff || e.slot_payload == 0 ||
      e.slot_stride < e.slot_payload + kHeaderBytes) {
    throw Error(Code::protocol, "verbs connection parameters from " + peer +
                                    " have an invalid slot layout");
  }
  return e;
}

inline ibv_mtu mtu_enum(std::uint32_t bytes) {
  switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    default: return IBV_MTU_4096;
  }
}

inline std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

}  // namespace detail
}  // namespace collectived::engine::transport::verbs

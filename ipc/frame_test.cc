#include "ipc/frame.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>

using namespace collectived;
using namespace collectived::ipc;

namespace {

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
};

std::vector<std::byte> hello_frame(const std::string& name, std::uint64_t id = 7) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto h = m.initHello();
  h.setProtocolVersion(wire::PROTOCOL_VERSION);
  h.setClientName(name.c_str());
  return encode_frame(b);
}

// Reads from `fd` until the decoder yields a frame or the socket runs dry.
std::unique_ptr<IncomingFrame> read_frame(int fd, FrameDecoder& dec) {
  for (int i = 0; i < 1000; ++i) {
    if (auto f = dec.next()) return f;
    std::vector<UniqueFd> fds;
    auto space = dec.read_space();
    RecvResult r = recv_some(fd, space, fds);
    if (r.eof || r.would_block) return dec.next();
    dec.commit(r.bytes);
    dec.add_fds(std::move(fds));
  }
  return nullptr;
}

const auto kLater = std::chrono::steady_clock::now() + std::chrono::seconds(5);

}  // namespace

TEST_CASE("a frame with a descriptor round-trips over a socketpair") {
  SocketPair sp;
  UniqueFd memfd(::memfd_create("t", MFD_CLOEXEC));
  REQUIRE(memfd);
  REQUIRE(::ftruncate(memfd.get(), 4096) == 0);
  auto frame = hello_frame("rank 3");
  // Re-encode declaring one descriptor.
  frame[8] = std::byte{1};
  int fds[1] = {memfd.get()};
  send_frame(sp.a.get(), frame, fds, kLater);

  FrameDecoder dec(Limits::for_max_frame(1 << 20));
  auto in = read_frame(sp.b.get(), dec);
  REQUIRE(in);
  CHECK(in->message().getId() == 7);
  REQUIRE(in->message().isHello());
  CHECK(std::string(in->message().getHello().getClientName().cStr()) == "rank 3");
  REQUIRE(in->fds().size() == 1);
  struct stat st {};
  REQUIRE(::fstat(in->fds()[0].get(), &st) == 0);
  CHECK(st.st_size == 4096);
  CHECK_FALSE(dec.mid_frame());
}

TEST_CASE("frames fed one byte at a time and several per read are all decoded") {
  auto f1 = hello_frame("one", 1);
  auto f2 = hello_frame("two", 2);
  std::vector<std::byte> stream(f1);
  stream.insert(stream.end(), f2.begin(), f2.end());

  FrameDecoder dec(Limits::for_max_frame(1 << 20));
  std::vector<std::uint64_t> ids;
  for (std::byte b : stream) {
    auto space = dec.read_space();
    space[0] = b;
    dec.commit(1);
    while (auto f = dec.next()) ids.push_back(f->message().getId());
  }
  CHECK(ids == std::vector<std::uint64_t>{1, 2});

  FrameDecoder dec2(Limits::for_max_frame(1 << 20));
  auto space = dec2.read_space();
  REQUIRE(space.size() >= stream.size());
  std::memcpy(space.data(), stream.data(), stream.size());
  dec2.commit(stream.size());
  CHECK(dec2.next()->message().getId() == 1);
  CHECK(dec2.next()->message().getId() == 2);
  CHECK(dec2.next() == nullptr);
}

TEST_CASE("a frame larger than the limit is refused from its header") {
  FrameDecoder dec(Limits::for_max_frame(4096));
  auto f = hello_frame(std::string(8000, 'x'));
  auto space = dec.read_space();
  std::memcpy(space.data(), f.data(), kHeaderBytes);
  dec.commit(kHeaderBytes);
  CHECK_THROWS_WITH_AS(dec.next(), doctest::Contains("exceeds the limit of 4096"), Error);
}

TEST_CASE("bad magic, bad length and too many descriptors are protocol errors") {
  auto check_header = [](std::uint32_t magic, std::uint32_t len, std::uint32_t nfds,
                         const char* expect) {
    FrameDecoder dec(Limits::for_max_frame(1 << 20));
    auto space = dec.read_space();
    std::uint32_t words[4] = {magic, len, nfds, 0};
    std::memcpy(space.data(), words, sizeof words);
    dec.commit(sizeof words);
    try {
      dec.next();
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == Code::protocol);
      CHECK(std::string(e.what()).find(expect) != std::string::npos);
    }
  };
  check_header(0x20544547 /* "GET " */, 8, 0, "bad frame magic");
  check_header(kFrameMagic, 12, 0, "not a positive multiple of 8");
  check_header(kFrameMagic, 0, 0, "not a positive multiple of 8");
  check_header(kFrameMagic, 8, 99, "declares 99 descriptors");
}

TEST_CASE("a frame that declares a descriptor it does not carry is refused") {
  SocketPair sp;
  auto frame = hello_frame("x");
  frame[8] = std::byte{1};
  send_frame(sp.a.get(), frame, {}, kLater);
  FrameDecoder dec(Limits::for_max_frame(1 << 20));
  CHECK_THROWS_WITH_AS(read_frame(sp.b.get(), dec), doctest::Contains("declares 1 descriptors but 0"),
                       Error);
}

TEST_CASE("random payload in a well-formed header is a protocol error, not a crash") {
  std::mt19937_64 rng(42);
  int refused = 0;
  for (int round = 0; round < 500; ++round) {
    const std::uint32_t words = 1 + rng() % 64;
    std::vector<std::uint64_t> payload(words);
    for (auto& w : payload) w = rng();
    if (round % 2 == 0) payload[0] = 0;  // one segment, so the table is sometimes plausible
    FrameDecoder dec(Limits::for_max_frame(1 << 20));
    auto space = dec.read_space();
    std::uint32_t h[4] = {kFrameMagic, words * 8, 0, 0};
    std::memcpy(space.data(), h, sizeof h);
    std::memcpy(space.data() + sizeof h, payload.data(), words * 8);
    dec.commit(sizeof h + words * 8);
    try {
      with_protocol_checks("test", [&] {
        auto f = dec.next();
        REQUIRE(f);
        auto m = f->message();
        (void)m.getId();
        if (m.isHello()) (void)m.getHello().getClientName().size();
        return 0;
      });
    } catch (const Error& e) {
      CHECK(e.code() == Code::protocol);
      ++refused;
    }
  }
  CHECK(refused > 0);
}

TEST_CASE("the traversal limit bounds the work spent on one message") {
  auto f = hello_frame(std::string(32 * 1024, 'y'));
  Limits tight = Limits::for_max_frame(1 << 20);
  tight.traversal_limit_words = 64;
  FrameDecoder dec(tight);
  auto space = dec.read_space();
  REQUIRE(space.size() >= f.size());
  std::memcpy(space.data(), f.data(), f.size());
  dec.commit(f.size());
  auto in = dec.next();
  REQUIRE(in);
  CHECK_THROWS_AS(with_protocol_checks("hello", [&] {
                    return in->message().getHello().getClientName().size();
                  }),
                  Error);
}

TEST_CASE("nesting limit: a message nested deeper than allowed is refused") {
  // Build StatusReply -> clients list -> ClientInfo: depth 3 below the root.
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  auto s = m.initStatusReply();
  s.initClients(1)[0].setName("deep");
  auto frame = encode_frame(b);
  Limits shallow = Limits::for_max_frame(1 << 20);
  shallow.nesting_limit = 2;
  FrameDecoder dec(shallow);
  auto space = dec.read_space();
  std::memcpy(space.data(), frame.data(), frame.size());
  dec.commit(frame.size());
  auto in = dec.next();
  REQUIRE(in);
  CHECK_THROWS_AS(with_protocol_checks("status", [&] {
                    return in->message().getStatusReply().getClients()[0].getName().size();
                  }),
                  Error);
}

TEST_CASE("encode_error carries the code and the message") {
  auto f = encode_error(99, Code::not_found, "unknown handle 5");
  FrameDecoder dec(Limits::for_max_frame(1 << 20));
  auto space = dec.read_space();
  std::memcpy(space.data(), f.data(), f.size());
  dec.commit(f.size());
  auto in = dec.next();
  REQUIRE(in);
  CHECK(in->message().getId() == 99);
  REQUIRE(in->message().isError());
  CHECK(code_from_wire(static_cast<std::uint16_t>(in->message().getError().getCode())) ==
        Code::not_found);
  CHECK(std::string(in->message().getError().getMessage().cStr()) == "unknown handle 5");
}

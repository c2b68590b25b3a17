// Bad input on the client socket: each case gets a clear error, and the daemon
// keeps serving its other clients. Every case runs against a real collectived.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <sys/eventfd.h>

#include <cstring>
#include <random>
#include <span>
#include <thread>

#include "client/collective.h"
#include "ipc/frame.h"
#include "ipc/ring.h"

#include "tests/support/collective_check.h"
#include "tests/support/harness.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

// A second, well-behaved client process: connects with libcollective through
// the demo binary, registers, reads status. Proves the daemon still serves.
void check_daemon_serves_others(Daemon& d) {
  REQUIRE(d.alive());
  auto r = run_program({demo_binary(), d.socket()}, 20s);
  INFO(r.output);
  CHECK(r.exited);
  CHECK(r.code == 0);
}

std::vector<std::byte> header(std::uint32_t magic, std::uint32_t len, std::uint32_t nfds) {
  std::vector<std::byte> h(16);
  std::uint32_t w[4] = {magic, len, nfds, 0};
  std::memcpy(h.data(), w, 16);
  return h;
}

/// A raw client's shared-memory rings (ipc/ring.h): a sealed memfd mapped
/// here and a doorbell eventfd, initialized, not attached yet.
struct TestRing {
  UniqueFd mem{::memfd_create("ring", MFD_CLOEXEC | MFD_ALLOW_SEALING)};
  UniqueFd bell{::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
  void* p = MAP_FAILED;
  ipc::RingView ring;

  TestRing() {
    REQUIRE(::ftruncate(mem.get(), static_cast<off_t>(ipc::ring_bytes())) == 0);
    REQUIRE(::fcntl(mem.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    p = ::mmap(nullptr, ipc::ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
    REQUIRE(p != MAP_FAILED);
    ring = ipc::RingView(static_cast<std::byte*>(p));
    ring.init();
  }
  ~TestRing() {
    if (p != MAP_FAILED) ::munmap(p, ipc::ring_bytes());
  }
  TestRing(const TestRing&) = delete;
  TestRing& operator=(const TestRing&) = delete;

  ipc::RingHeader& header() const { return ring.header(); }
  /// AttachRing with request `id` and `doorbell`; true when the daemon took it.
  bool attach(RawClient& c, std::uint64_t id, int doorbell) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(id);
    m.initAttachRing().setBytes(ipc::ring_bytes());
    c.send(b, {mem.get(), doorbell});
    auto r = c.receive(5s);
    return r && r->message().isOk();
  }
  /// Pushes `frame` into the submission ring and rings the doorbell.
  void submit(std::span<const std::byte> frame) {
    auto& h = header();
    REQUIRE(ipc::RingView::push(h.sq_head, h.sq_tail, ring.sq_slot(h.sq_tail.load()), frame));
    const std::uint64_t one = 1;
    (void)!::write(bell.get(), &one, sizeof one);
  }
};

std::uint64_t registrations(RawClient& c) {
  auto s = c.status(4242);
  REQUIRE(s);
  REQUIRE(s->message().isStatusReply());
  return s->message().getStatusReply().getRegistrations();
}

}  // namespace

TEST_CASE("random bytes on the socket do not stop the daemon from serving a second client") {
  Daemon d;
  std::mt19937 rng(1234);
  for (int round = 0; round < 5; ++round) {
    RawClient junk(d.socket());
    std::vector<std::byte> bytes(4096);
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
    junk.send_bytes(bytes);
    auto reply = junk.receive(5s);
    REQUIRE(reply);
    CHECK(error_code(*reply) == Code::protocol);
    CHECK(error_message(*reply).find("bad frame magic") != std::string::npos);
    CHECK(junk.closed_by_peer(5s));
  }
  check_daemon_serves_others(d);
  CHECK(d.log().find("client_protocol_error") != std::string::npos);
}

TEST_CASE("an oversize frame is refused from its header and the session closed") {
  Daemon d({.overrides = {"client.max_frame_bytes=64KiB"}});
  RawClient c(d.socket());
  REQUIRE(c.hello());
  c.send_bytes(header(ipc::kFrameMagic, 1 << 30, 0));
  auto reply = c.receive(5s);
  REQUIRE(reply);
  CHECK(error_code(*reply) == Code::protocol);
  CHECK(error_message(*reply).find("exceeds the limit of 65536 bytes (client.max_frame_bytes)") !=
        std::string::npos);
  CHECK(c.closed_by_peer(5s));
  check_daemon_serves_others(d);
}

TEST_CASE("a malformed payload in a well-formed frame gets an error; the session goes on") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  // Segment table claims 1 segment of 1000 words, but only 3 words follow.
  std::vector<std::byte> f = header(ipc::kFrameMagic, 24, 0);
  std::uint32_t seg[6] = {0, 1000, 0, 0, 0, 0};
  // resize + memcpy, not insert: GCC 12 at -O3 sees a bogus out-of-bounds
  // copy in vector::insert (-Warray-bounds).
  const std::size_t at = f.size();
  f.resize(at + sizeof seg);
  std::memcpy(f.data() + at, seg, sizeof seg);
  c.send_bytes(f);
  auto reply = c.receive(5s);
  REQUIRE(reply);
  CHECK(error_code(*reply) == Code::protocol);
  CHECK(error_message(*reply).find("malformed message") != std::string::npos);
  // Same session still answers.
  auto s = c.status();
  REQUIRE(s);
  CHECK(s->message().isStatusReply());
  check_daemon_serves_others(d);
}

TEST_CASE("an unknown message type is answered with a protocol error naming it") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  // Find the union discriminant's byte by encoding two members, then set a
  // value no member has, as a client of a newer protocol would send.
  auto encode = [](bool ok) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(77);
    if (ok) m.setOk(); else m.initStatus();
    return ipc::encode_frame(b);
  };
  auto a = encode(true), b = encode(false);
  REQUIRE(a.size() == b.size());
  std::size_t at = 0;
  for (std::size_t i = ipc::kHeaderBytes; i < a.size(); ++i)
    if (a[i] != b[i]) { at = i; break; }
  REQUIRE(at != 0);
  a[at] = std::byte{99};
  c.send_bytes(a);
  auto reply = c.receive(5s);
  REQUIRE(reply);
  CHECK(reply->message().getId() == 77);
  CHECK(error_code(*reply) == Code::protocol);
  CHECK(error_message(*reply).find("unknown message type 99") != std::string::npos);
  CHECK(c.status());
}

TEST_CASE("a daemon-to-client message sent by a client is refused") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(5);
  m.initRegistered().setHandle(1);
  c.send(b);
  auto reply = c.receive(5s);
  REQUIRE(reply);
  CHECK(error_code(*reply) == Code::invalid_usage);
  CHECK(error_message(*reply).find("daemon-to-client") != std::string::npos);
}

TEST_CASE("requests before Hello, and a protocol version mismatch, are clear errors") {
  Daemon d;
  {
    RawClient c(d.socket());
    auto s = c.status(9);
    REQUIRE(s);
    CHECK(error_code(*s) == Code::invalid_usage);
    CHECK(error_message(*s).find("first message of a session must be Hello") != std::string::npos);
    CHECK(c.closed_by_peer(5s));
  }
  {
    RawClient c(d.socket());
    auto r = c.hello(wire::PROTOCOL_VERSION + 1);
    REQUIRE(r);
    CHECK(error_code(*r) == Code::protocol);
    const auto msg = error_message(*r);
    CHECK(msg.find("protocol version mismatch") != std::string::npos);
    CHECK(msg.find("speaks " + std::to_string(wire::PROTOCOL_VERSION + 1)) != std::string::npos);
    CHECK(c.closed_by_peer(5s));
    CHECK(d.wait_for_log("client_version_mismatch", 5s));
  }
  check_daemon_serves_others(d);
}

TEST_CASE("invalid, stale and foreign registration handles") {
  Daemon d;
  RawClient owner(d.socket()), other(d.socket());
  REQUIRE(owner.hello());
  REQUIRE(other.hello());
  UniqueFd mem = sealed_memfd(8192);
  auto r = owner.register_host(2, 8192, {mem.get()});
  REQUIRE(r);
  REQUIRE(r->message().isRegistered());
  const std::uint64_t handle = r->message().getRegistered().getHandle();

  auto foreign = other.deregister(3, handle);
  REQUIRE(foreign);
  CHECK(error_code(*foreign) == Code::permission_denied);
  CHECK(error_message(*foreign).find("belongs to another client") != std::string::npos);

  auto bogus = owner.deregister(4, 0xdeadbeef);
  REQUIRE(bogus);
  CHECK(error_code(*bogus) == Code::not_found);

  auto ok = owner.deregister(5, handle);
  REQUIRE(ok);
  CHECK(ok->message().isOk());
  auto stale = owner.deregister(6, handle);
  REQUIRE(stale);
  CHECK(error_code(*stale) == Code::not_found);
  CHECK(error_message(*stale).find("already deregistered") != std::string::npos);
}

TEST_CASE("missing, wrong and unexpected descriptors") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  auto reg = [&](std::uint64_t id, std::uint64_t size, std::vector<int> fds) {
    auto reply = c.register_host(id, size, std::move(fds));
    REQUIRE(reply);
    CHECK(reply->message().getId() == id);
    return std::make_pair(error_code(*reply), error_message(*reply));
  };
  auto [c1, m1] = reg(10, 4096, {});
  CHECK(c1 == Code::invalid_argument);
  CHECK(m1.find("exactly one memfd") != std::string::npos);

  int p[2];
  REQUIRE(::pipe(p) == 0);
  auto [c2, m2] = reg(11, 4096, {p[0]});
  CHECK(c2 == Code::invalid_argument);
  CHECK(m2.find("not a memfd") != std::string::npos);
  ::close(p[0]);
  ::close(p[1]);

  UniqueFd file(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  auto [c3, m3] = reg(12, 4096, {file.get()});
  CHECK(c3 == Code::invalid_argument);
  CHECK(m3.find("not a memfd") != std::string::npos);

  UniqueFd unsealed(::memfd_create("unsealed", MFD_CLOEXEC));
  REQUIRE(::ftruncate(unsealed.get(), 4096) == 0);
  auto [c4, m4] = reg(13, 4096, {unsealed.get()});
  CHECK(c4 == Code::invalid_argument);
  CHECK(m4.find("F_SEAL_SHRINK") != std::string::npos);

  UniqueFd small = sealed_memfd(4096);
  auto [c5, m5] = reg(14, 1 << 20, {small.get()});
  CHECK(c5 == Code::invalid_argument);
  CHECK(m5.find("fewer than") != std::string::npos);

  // A descriptor on a message that takes none is closed by the daemon.
  auto before = c.status(15);
  REQUIRE(before);
  const auto fds_before = before->message().getStatusReply().getOpenDescriptors();
  for (int i = 0; i < 5; ++i) {
    UniqueFd extra = sealed_memfd(4096);
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(20 + i);
    m.initStatus();
    c.send(b, {extra.get()});
    auto reply = c.receive(5s);
    REQUIRE(reply);
    CHECK(error_code(*reply) == Code::protocol);
    CHECK(error_message(*reply).find("takes none") != std::string::npos);
  }
  auto after = c.status(30);
  REQUIRE(after);
  CHECK(after->message().getStatusReply().getOpenDescriptors() == fds_before);
  CHECK(registrations(c) == 0);
  check_daemon_serves_others(d);
}

TEST_CASE("a frame that declares descriptors it does not carry closes the session") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(3);
  m.initRegisterHost().setSize(4096);
  c.send_bytes(ipc::encode_frame(b, 1));  // header says 1, none sent
  auto reply = c.receive(5s);
  REQUIRE(reply);
  CHECK(error_code(*reply) == Code::protocol);
  CHECK(error_message(*reply).find("declares 1 descriptors but 0 arrived") != std::string::npos);
  CHECK(c.closed_by_peer(5s));
  check_daemon_serves_others(d);
}

TEST_CASE("a client that disconnects mid-request is cleaned up") {
  Daemon d;
  {
    RawClient c(d.socket());
    REQUIRE(c.hello());
    UniqueFd mem = sealed_memfd(4096);
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(2);
    m.initRegisterHost().setSize(4096);
    auto frame = ipc::encode_frame(b, 1);
    frame.erase(frame.end() - 5, frame.end());  // half a frame, then gone (erase, not resize: GCC 12 -O1 with ASan warns that resize may grow by 2^64 - 6)
    c.send_bytes(frame, {mem.get()});
  }
  CHECK(d.wait_for_log("client_disconnected_mid_request", 5s));
  RawClient probe(d.socket());
  REQUIRE(probe.hello());
  CHECK(registrations(probe) == 0);
  auto s = probe.status();
  REQUIRE(s);
  CHECK(s->message().getStatusReply().getClients().size() == 1);
  check_daemon_serves_others(d);
}

TEST_CASE("a client that stalls mid-frame or never says Hello is dropped at the deadline") {
  Daemon d({.overrides = {"deadlines.client_request_ms=300"}});
  RawClient silent(d.socket());
  RawClient stalled(d.socket());
  REQUIRE(stalled.hello());
  stalled.send_bytes(header(ipc::kFrameMagic, 64, 0));
  auto r1 = stalled.receive(3s);
  REQUIRE(r1);
  CHECK(error_code(*r1) == Code::timeout);
  CHECK(error_message(*r1).find("deadlines.client_request_ms") != std::string::npos);
  CHECK(stalled.closed_by_peer(3s));
  auto r2 = silent.receive(3s);
  REQUIRE(r2);
  CHECK(error_code(*r2) == Code::timeout);
  CHECK(error_message(*r2).find("no Hello") != std::string::npos);
  check_daemon_serves_others(d);
}

TEST_CASE("a killed client's registrations are released") {
  Daemon d;
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  Child child([&] {
    RawClient c(d.socket());
    c.hello();
    for (int i = 0; i < 3; ++i) {
      UniqueFd mem = sealed_memfd(1 << 16);
      if (!c.register_host(10 + i, 1 << 16, {mem.get()})) return 1;
    }
    char x = 'r';
    if (::write(pipefd[1], &x, 1) != 1) return 1;
    ::pause();
    return 0;
  });
  char x = 0;
  REQUIRE(::read(pipefd[0], &x, 1) == 1);
  RawClient probe(d.socket());
  REQUIRE(probe.hello());
  CHECK(registrations(probe) == 3);
  child.kill(SIGKILL);
  child.wait(5s);
  CHECK(eventually([&] { return registrations(probe) == 0; }, 5s));
  ::close(pipefd[0]);
  ::close(pipefd[1]);
}

TEST_CASE("a client that corrupts its shared-memory ring is dropped; others are served") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  TestRing ring;
  {
    // A pipe is not an eventfd: refused.
    int pp[2];
    REQUIRE(::pipe(pp) == 0);
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(2);
    m.initAttachRing().setBytes(ipc::ring_bytes());
    c.send(b, {ring.mem.get(), pp[0]});
    auto r = c.receive(5s);
    REQUIRE(r);
    CHECK(error_code(*r) == Code::invalid_argument);
    CHECK(error_message(*r).find("not an eventfd") != std::string::npos);
    ::close(pp[0]);
    ::close(pp[1]);
  }
  REQUIRE(ring.attach(c, 3, ring.bell.get()));
  // A slot holding garbage: answered with an error in the completion ring.
  std::vector<std::byte> junk(64, std::byte{0x42});
  auto& h = ring.header();
  ring.submit(junk);
  // Then indices that claim more entries than the ring holds.
  REQUIRE(eventually([&] { return h.sq_head.load() == h.sq_tail.load(); }, 5s));
  h.sq_tail.store(h.sq_head.load() + 5000);
  const std::uint64_t one = 1;
  (void)!::write(ring.bell.get(), &one, sizeof one);
  // The garbage slot could not even be decoded, so its error has no request
  // id and comes by the socket; then the corrupt indices close the session.
  auto e1 = c.receive(5s);
  REQUIRE(e1);
  CHECK(error_code(*e1) == Code::protocol);
  CHECK(error_message(*e1).find("malformed frame in a ring slot") != std::string::npos);
  auto e2 = c.receive(5s);
  REQUIRE(e2);
  CHECK(error_code(*e2) == Code::protocol);
  CHECK(error_message(*e2).find("indices are corrupt") != std::string::npos);
  CHECK(c.closed_by_peer(5s));
  check_daemon_serves_others(d);
}

TEST_CASE("the daemon wakes a client asleep on its ring only for the completion it waits for") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  TestRing ring;
  REQUIRE(ring.attach(c, 2, ring.bell.get()));
  // A communicator of one rank (by the socket), then barriers by the ring.
  const auto comm = raw_comm_of_one(c, d.socket(), 3);
  auto barrier = [&](std::uint64_t id) {
    capnp::MallocMessageBuilder b;
    auto bm = b.initRoot<wire::Message>();
    bm.setId(ipc::kRingRequestBit | id);
    auto col = bm.initCollective();
    col.setComm(comm);
    col.setKind(wire::OpKind::BARRIER);
    ring.submit(ipc::encode_frame(b));
  };
  auto& h = ring.header();
  auto completed = [&](std::uint64_t n) {
    return eventually([&] { return h.cq_tail.load() == n; }, 5s);
  };
  // Asleep for request 11: the completion of 10 does not wake it, 11's does.
  h.wake_id.store(ipc::kRingRequestBit | 11);
  h.client_sleeping.store(1);
  barrier(10);
  REQUIRE(completed(1));
  std::this_thread::sleep_for(100ms);  // a wake-up would follow the completion at once
  CHECK(h.client_sleeping.load() == 1);
  barrier(11);
  REQUIRE(completed(2));
  CHECK(eventually([&] { return h.client_sleeping.load() == 0; }, 5s));
  // Asleep for any completion (0): the next one wakes it.
  h.wake_id.store(0);
  h.client_sleeping.store(1);
  barrier(12);
  REQUIRE(completed(3));
  CHECK(eventually([&] { return h.client_sleeping.load() == 0; }, 5s));
  check_daemon_serves_others(d);
}

TEST_CASE(
    "GPU requests staged by the client: refused for a send/recv group, and without a GPU; the "
    "session goes on") {
  Daemon d;
  RawClient c(d.socket());
  REQUIRE(c.hello());
  const auto [comm, handle] = raw_comm_with_memory(c, d.socket(), 3, 8192);
  {
    // A send/recv group never is (the daemon stages GPU send/recv itself).
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(5);
    auto g = m.initP2pGroup();
    g.setComm(comm);
    auto items = g.initItems(1);
    items[0].setIsSend(true);
    items[0].setPeer(0);
    items[0].setCount(4);
    items[0].setDtype(static_cast<std::uint8_t>(COLLECTIVE_INT32));
    items[0].getBuffer().setHandle(handle);
    g.initGpu().setClientStaged(true);
    c.send(b);
    auto r = c.receive(5s);
    REQUIRE(r);
    CHECK(error_code(*r) == Code::invalid_argument);
    CHECK(error_message(*r).find("cannot be staged by the client") != std::string::npos);
  }
  {
    // A collective on host staging with its stream hand-off: this daemon
    // has no GPU (CI), and says so.
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(6);
    auto col = m.initCollective();
    col.setComm(comm);
    col.setKind(wire::OpKind::ALL_REDUCE);
    col.setDtype(static_cast<std::uint8_t>(COLLECTIVE_INT32));
    col.setRedop(static_cast<std::uint8_t>(COLLECTIVE_SUM));
    col.setCount(4);
    col.getSend().setHandle(handle);
    col.getRecv().setHandle(handle);
    auto g = col.initGpu();
    g.setClientStaged(true);
    g.setReadyPieces(2);
    g.setPieceBytes(8);
    c.send(b);
    auto r = c.receive(5s);
    REQUIRE(r);
    CHECK(error_code(*r) != Code::ok);
    MESSAGE("client-staged collective without a GPU: " << error_message(*r));
  }
  auto gone = c.deregister(7, handle);
  REQUIRE(gone);
  CHECK(gone->message().isOk());
  check_daemon_serves_others(d);
  auto s = c.status(8);
  REQUIRE(s);
  CHECK(s->message().isStatusReply());
}

// The security model under test (docs/threat-model.md), against a real daemon.
//
// Covered elsewhere, not repeated here:
//   a uid outside client.allowed_uids/allowed_gids is refused, by uid and
//     by gid ........................... lifecycle_test "SO_PEERCRED: ..."
//   foreign, forged and stale handles in Deregister, descriptors that are
//     not sealed memfds (pipe, file, unsealed, too small) . bad_input_test
//   buffers outside registrations (client and daemon side) . collectives_test
//   a peer daemon with the wrong secret is refused and both sides log why
//     ................................. peers_test "a daemon with the wrong secret ..."
// Here: another client's communicators and buffers used in collectives,
// splits, destroys and aborts; forged and stale handles and overflowing
// ranges in collectives; the socket file's owner and mode; and the uid check
// per connection for a process that drops privileges.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "client/collective.h"
#include "tests/support/harness.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

constexpr std::uint8_t kFloat32 = 8;

struct Session {
  RawClient raw;
  std::uint64_t next_id = 10;
  explicit Session(const std::string& socket) : raw(socket) { REQUIRE(raw.hello()); }

  std::uint64_t register_host(std::size_t bytes, UniqueFd& mem) {
    mem = sealed_memfd(bytes);
    auto r = raw.register_host(next_id++, bytes, {mem.get()});
    REQUIRE(r);
    REQUIRE(r->message().isRegistered());
    return r->message().getRegistered().getHandle();
  }

  /// A one-rank communicator of this session.
  std::uint64_t comm(const std::string& rendezvous, std::uint8_t tag) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    const std::uint64_t id = next_id++;
    m.setId(id);
    auto ci = m.initCommInit();
    std::byte secret[16];
    std::memset(secret, tag, sizeof secret);
    ci.setSecret(kj::arrayPtr(reinterpret_cast<const capnp::byte*>(secret), sizeof secret));
    ci.setRendezvous(rendezvous.c_str());
    ci.setNranks(1);
    ci.setRank(0);
    raw.send(b);
    auto r = next_reply(id);
    REQUIRE(r);
    INFO(error_message(*r));
    REQUIRE(r->message().isCommReady());
    return r->message().getCommReady().getComm();
  }

  std::unique_ptr<ipc::IncomingFrame> next_reply(std::uint64_t id) {
    for (;;) {
      auto f = raw.receive(10s);
      if (!f || f->message().getId() == id) return f;
    }
  }

  /// An all-reduce of `count` floats from (send, soff) to (recv, roff) on `comm`; the answer.
  std::unique_ptr<ipc::IncomingFrame> all_reduce(std::uint64_t comm, std::uint64_t send,
                                                 std::uint64_t recv, std::uint64_t count,
                                                 std::uint64_t soff = 0, std::uint64_t roff = 0) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    const std::uint64_t id = next_id++;
    m.setId(id);
    auto c = m.initCollective();
    c.setComm(comm);
    c.setKind(wire::OpKind::ALL_REDUCE);
    c.setDtype(kFloat32);
    c.setRedop(0);
    c.setCount(count);
    c.getSend().setHandle(send);
    c.getSend().setOffset(soff);
    c.getRecv().setHandle(recv);
    c.getRecv().setOffset(roff);
    raw.send(b);
    return next_reply(id);
  }

  template <typename Init>
  std::unique_ptr<ipc::IncomingFrame> request(Init&& init) {
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    const std::uint64_t id = next_id++;
    m.setId(id);
    init(m);
    raw.send(b);
    return next_reply(id);
  }
};

std::string rendezvous_of(Daemon& d) {
  RawClient c(d.socket());
  auto h = c.hello();
  REQUIRE(h);
  return h->message().getHelloReply().getRendezvousAddress().cStr();
}

bool completed(ipc::IncomingFrame& f) { return f.message().isCompleted(); }

}  // namespace

TEST_CASE("a client cannot use another client's communicators") {
  Daemon d;
  const std::string rv = rendezvous_of(d);
  Session owner(d.socket()), intruder(d.socket());
  UniqueFd m1, m2;
  const std::uint64_t ob = owner.register_host(4096, m1);
  const std::uint64_t ib = intruder.register_host(4096, m2);
  const std::uint64_t comm = owner.comm(rv, 1);

  // Collective, split, destroy and abort on the owner's communicator.
  auto coll = intruder.all_reduce(comm, ib, ib, 16);
  REQUIRE(coll);
  CHECK(error_code(*coll) == Code::permission_denied);
  CHECK(error_message(*coll).find("belongs to another client") != std::string::npos);
  for (auto kind : {0, 1, 2}) {
    auto r = intruder.request([&](wire::Message::Builder m) {
      if (kind == 0) m.initCommSplit().setComm(comm);
      if (kind == 1) m.initCommDestroy().setComm(comm);
      if (kind == 2) m.initCommAbort().setComm(comm);
    });
    REQUIRE(r);
    CAPTURE(kind);
    CHECK(error_code(*r) == Code::permission_denied);
  }
  // The owner's communicator is untouched.
  auto ok = owner.all_reduce(comm, ob, ob, 16);
  REQUIRE(ok);
  INFO(error_message(*ok));
  CHECK(completed(*ok));
}

TEST_CASE("a client cannot read or write another client's buffers through a collective") {
  Daemon d;
  const std::string rv = rendezvous_of(d);
  Session victim(d.socket()), intruder(d.socket());
  UniqueFd vm, im;
  const std::uint64_t vb = victim.register_host(4096, vm);
  const std::uint64_t ib = intruder.register_host(4096, im);
  const std::uint64_t comm = intruder.comm(rv, 2);
  // The victim's memory, as the victim sees it.
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, vm.get(), 0);
  REQUIRE(p != MAP_FAILED);
  std::memset(p, 0x11, 4096);

  auto read_it = intruder.all_reduce(comm, vb, ib, 16);   // victim's buffer as input
  auto write_it = intruder.all_reduce(comm, ib, vb, 16);  // victim's buffer as output
  REQUIRE(read_it);
  REQUIRE(write_it);
  CHECK(error_code(*read_it) == Code::permission_denied);
  CHECK(error_code(*write_it) == Code::permission_denied);
  const auto* bytes = static_cast<const unsigned char*>(p);
  bool untouched = true;
  for (int i = 0; i < 4096; ++i) untouched = untouched && bytes[i] == 0x11;
  CHECK(untouched);
  ::munmap(p, 4096);
}

TEST_CASE("forged and stale handles and ranges outside a registration are refused in collectives") {
  Daemon d;
  const std::string rv = rendezvous_of(d);
  Session s(d.socket());
  UniqueFd m;
  const std::uint64_t b = s.register_host(4096, m);
  const std::uint64_t comm = s.comm(rv, 3);

  auto forged_buf = s.all_reduce(comm, 0x7fffffff12345ull, b, 16);
  REQUIRE(forged_buf);
  CHECK(error_code(*forged_buf) == Code::not_found);
  auto forged_comm = s.all_reduce(0x7fffffff12345ull, b, b, 16);
  REQUIRE(forged_comm);
  CHECK(error_code(*forged_comm) == Code::not_found);

  // Ranges: past the end, straddling it, and offsets that overflow 64 bits.
  for (auto [count, off] : std::initializer_list<std::pair<std::uint64_t, std::uint64_t>>{
           {1025, 0}, {16, 4096 - 32}, {1, 4096}, {16, ~std::uint64_t{0} - 7},
           {std::uint64_t{1} << 62, 0}, {2, (std::uint64_t{1} << 63)}}) {
    CAPTURE(count);
    CAPTURE(off);
    auto r = s.all_reduce(comm, b, b, count, off, 0);
    REQUIRE(r);
    CHECK(error_code(*r) == Code::invalid_argument);
    auto r2 = s.all_reduce(comm, b, b, count, 0, off);
    REQUIRE(r2);
    CHECK(error_code(*r2) == Code::invalid_argument);
  }
  // The exact fit works.
  auto fit = s.all_reduce(comm, b, b, 1024);
  REQUIRE(fit);
  INFO(error_message(*fit));
  CHECK(completed(*fit));

  // Stale: after deregistering, the handle is gone for collectives too.
  auto dr = s.raw.deregister(s.next_id++, b);
  REQUIRE(dr);
  REQUIRE(dr->message().isOk());
  auto stale = s.all_reduce(comm, b, b, 16);
  REQUIRE(stale);
  CHECK(error_code(*stale) == Code::not_found);
}

TEST_CASE("the socket file's owner and mode follow the profile") {
  for (const char* mode : {"0600", "0660", "0666"}) {
    CAPTURE(mode);
    Daemon d({.overrides = {std::string("client.socket_mode=\"") + mode + "\""}});
    struct stat st {};
    REQUIRE(::stat(d.socket().c_str(), &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK((st.st_mode & 07777) == std::stoul(mode, nullptr, 8));
    // Owned by the daemon's user (the profile has no owner key: systemd's
    // User=/Group= and RuntimeDirectory= decide it).
    CHECK(st.st_uid == ::geteuid());
  }
}

TEST_CASE("client.socket_group and client.allowed_groups: a member of the named group connects, by its gid or a supplementary group") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to change uid and groups (in a forked child)");
    return;
  }
  // Debian's "nogroup" (65534) stands in for the package's "collectived".
  Daemon d({.overrides = {"client.allowed_uids=[]", "client.allowed_gids=[]",
                          "client.socket_group=nogroup", "client.allowed_groups=[nogroup]"}});
  struct stat st {};
  REQUIRE(::stat(d.socket().c_str(), &st) == 0);
  CHECK(st.st_gid == 65534);
  // Only the socket's group may open it: 65533 outside the group, even with
  // a world-writable socket, is refused by the daemon.
  auto connect_as = [&](gid_t gid, std::vector<gid_t> extra) {
    return run_child(
        [&, gid, extra] {
          if (::setgroups(extra.size(), extra.data()) != 0 || ::setgid(gid) != 0 ||
              ::setuid(65533) != 0)
            return 4;
          collective_client_t* c = nullptr;
          const collective_result_t r = collective_connect(d.socket().c_str(), "member", &c);
          if (r == COLLECTIVE_OK) {
            collective_disconnect(c);
            return 0;
          }
          const std::string msg = collective_last_error();
          if (r == COLLECTIVE_PERMISSION_DENIED && msg.find("client.allowed_groups") != std::string::npos &&
              msg.find("group nogroup") != std::string::npos)
            return 10;
          return 5;
        },
        10s);
  };
  auto primary = connect_as(65534, {});
  CHECK(primary.exited);
  CHECK(primary.code == 0);
  auto supplementary = connect_as(65533, {65534});
  CHECK(supplementary.exited);
  CHECK(supplementary.code == 0);
  ::chmod(d.socket().c_str(), 0666);
  auto outsider = connect_as(65533, {});
  CHECK(outsider.exited);
  CHECK(outsider.code == 10);
}

TEST_CASE("a group named in the profile that the node lacks is a warning, and the daemon serves") {
  Daemon d({.overrides = {"client.socket_group=collectived-no-such-group",
                          "client.allowed_groups=[collectived-no-such-group]"}});
  CHECK(d.wait_for_log("event=groups_missing groups=collectived-no-such-group ", 5s));
  collective_client_t* c = nullptr;
  REQUIRE(collective_connect(d.socket().c_str(), "owner", &c) == COLLECTIVE_OK);
  collective_disconnect(c);
}

TEST_CASE("the daemon's own uid may connect; after dropping to a uid outside the list, a new connection is refused") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to change uid (setuid in a forked child)");
    return;
  }
  // Only uid 65534 is listed; root (the daemon's uid) is implicitly allowed.
  // SO_PEERCRED is read per connection, so a process that drops privileges
  // is judged by its new uid on its next connection.
  Daemon d({.overrides = {"client.allowed_uids=[65534]", "client.allowed_gids=[]"}});
  ::chmod(d.socket().c_str(), 0666);
  auto r = run_child(
      [&] {
        collective_client_t* c = nullptr;
        // The daemon's own uid (root) may always connect.
        if (collective_connect(d.socket().c_str(), "root", &c) != COLLECTIVE_OK) return 3;
        collective_disconnect(c);
        if (::setgid(65533) != 0 || ::setuid(65533) != 0) return 4;  // not allowed
        if (collective_connect(d.socket().c_str(), "nogroup", &c) != COLLECTIVE_PERMISSION_DENIED) return 5;
        const std::string msg = collective_last_error();
        if (msg.find("uid 65533") == std::string::npos) return 6;
        return 0;
      },
      10s);
  CHECK(r.exited);
  CHECK(r.code == 0);
  CHECK(d.wait_for_log("event=client_refused", 5s));
}

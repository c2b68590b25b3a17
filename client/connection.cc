#include "client/connection.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "ipc/version.h"

namespace collectived::client {

Connection::Connection(UniqueFd fd, std::string socket_path)
    : fd_(std::move(fd)),
      socket_path_(std::move(socket_path)),
      decoder_(ipc::Limits::for_max_frame(64 << 20)) {}

std::unique_ptr<Connection> Connection::open(const std::string& path, const std::string& name,
                                             std::chrono::milliseconds timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    throw Error(Code::invalid_argument, "socket path '" + path + "' is empty or longer than " +
                                            std::to_string(sizeof addr.sun_path - 1) + " bytes");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno("socket(AF_UNIX)");
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    const std::string hint =
        "; is collectived running? (systemctl status collectived; the socket comes from the "
        "argument, else $COLLECTIVED_SOCKET, else " "/run/collectived/collectived.sock" ")";
    if (err == ENOENT || err == ECONNREFUSED) {
      throw Error(Code::unavailable, "no collectived listening on " + path + " (" +
                                         std::strerror(err) + ")" + hint);
    }
    if (err == EACCES) {
      throw Error(Code::permission_denied,
                  "cannot connect to " + path +
                      ": permission denied (the socket's mode is client.socket_mode of the "
                      "node's profile)");
    }
    throw_errno("connect to " + path, err);
  }
  std::unique_ptr<Connection> c(new Connection(std::move(fd), path));
  capnp::MallocMessageBuilder b;
  auto h = b.initRoot<wire::Message>().initHello();
  h.setProtocolVersion(wire::PROTOCOL_VERSION);
  h.setClientName(name.c_str());
  h.setLibraryVersion(kVersion);
  auto reply = c->call(b, {}, Clock::now() + timeout);
  auto m = reply->message();
  if (!m.isHelloReply()) {
    throw Error(Code::protocol, "the daemon on " + path + " answered Hello with another message");
  }
  auto r = m.getHelloReply();
  if (r.getProtocolVersion() != wire::PROTOCOL_VERSION) {
    throw Error(Code::protocol, "protocol version mismatch: this libcollective (" +
                                    std::string(kVersion) + ") speaks " +
                                    std::to_string(wire::PROTOCOL_VERSION) + ", the daemon on " +
                                    path + " (collectived " + r.getDaemonVersion().cStr() +
                                    ") speaks " + std::to_string(r.getProtocolVersion()));
  }
  c->session_id_ = r.getSessionId();
  c->node_name_ = r.getNodeName().cStr();
  c->daemon_version_ = r.getDaemonVersion().cStr();
  c->rendezvous_address_ = r.getRendezvousAddress().cStr();
  c->operation_deadline_ = std::chrono::milliseconds(r.getOperationDeadlineMs());
  c->rendezvous_deadline_ = std::chrono::milliseconds(r.getRendezvousDeadlineMs());
  const char* no_ring = std::getenv("COLLECTIVE_NO_RING");
  if (no_ring == nullptr || std::string(no_ring) != "1") c->attach_ring();
  return c;
}

Connection::~Connection() {
  if (ring_base_ != nullptr) ::munmap(ring_base_, ipc::ring_bytes());
}

void Connection::attach_ring() {
  UniqueFd mem(::memfd_create("collective-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!mem || ::ftruncate(mem.get(), static_cast<off_t>(ipc::ring_bytes())) != 0 ||
      ::fcntl(mem.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return;
  }
  void* p = ::mmap(nullptr, ipc::ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
  if (p == MAP_FAILED) return;
  ring_base_ = p;
  ring_ = ipc::RingView(static_cast<std::byte*>(p));
  ring_.init();
  ring_doorbell_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!ring_doorbell_) return;
  capnp::MallocMessageBuilder b;
  b.initRoot<wire::Message>().initAttachRing().setBytes(ipc::ring_bytes());
  const int fds[2] = {mem.get(), ring_doorbell_.get()};
  try {
    call(b, fds, Clock::now() + std::chrono::seconds(10));
    ring_ok_ = true;
  } catch (const Error&) {
    // An older daemon, or one that refuses: the socket carries everything.
  }
}

namespace {
bool hot(wire::Message::Which w) {
  return w == wire::Message::COLLECTIVE || w == wire::Message::P2P_GROUP ||
         w == wire::Message::COMM_SPLIT || w == wire::Message::COMM_DESTROY ||
         w == wire::Message::COMM_ABORT;
}
}  // namespace

// One turn of waiting for room in the ring. A session the daemon ended
// (it is stopping, or dropped this client) fails with the daemon's reason
// rather than a timeout: a full ring is then never drained.
void Connection::wait_for_ring(Clock::time_point deadline) {
  {
    std::lock_guard lock(state_mutex_);
    if (broken_) throw *broken_;
  }
  pollfd p{fd_.get(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
    const Error closed(Code::unavailable, "collectived closed the connection on " + socket_path_ +
                                              " (the daemon stopped or dropped this client)");
    // Another thread may be the socket's reader: it records the daemon's
    // reason (sent just before the close) in a moment.
    const auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(500));
    for (;;) {
      Error e = session_error_or(closed);
      if (e.code() != Code::unavailable || Clock::now() >= until) throw e;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (Clock::now() >= deadline) {
    throw Error(Code::timeout, "the daemon did not take submissions from the ring");
  }
  sched_yield();
}

std::uint64_t Connection::send_request(capnp::MessageBuilder& request, std::span<const int> fds,
                                       Clock::time_point deadline) {
  {
    std::lock_guard lock(state_mutex_);
    if (broken_) throw *broken_;
  }
  auto root = request.getRoot<wire::Message>();
  if (ring_ok_ && fds.empty() && hot(root.which())) {
    const std::uint64_t id = next_id_.fetch_add(1) | ipc::kRingRequestBit;
    root.setId(id);
    auto frame = ipc::encode_frame(request);
    ipc::RingHeader& h = ring_.header();
    std::lock_guard lock(send_mutex_);
    if (frame.size() <= ipc::RingView::max_frame()) {
      // Operations of a communicator are ordered by arrival, so a full ring
      // is waited out, never bypassed through the socket.
      while (!ipc::RingView::push(h.sq_head, h.sq_tail, ring_.sq_slot(h.sq_tail.load()), frame)) {
        wait_for_ring(deadline);
      }
      if (h.daemon_sleeping.load(std::memory_order_seq_cst) != 0) {
        const std::uint64_t one = 1;
        (void)!::write(ring_doorbell_.get(), &one, sizeof one);
      }
      return id;
    }
    // Too large for a slot: let the ring empty first, so that this request
    // cannot overtake earlier ones; its reply still comes through the ring.
    while (h.sq_head.load(std::memory_order_acquire) != h.sq_tail.load()) wait_for_ring(deadline);
    root.setId(id & ~ipc::kRingRequestBit);
    frame = ipc::encode_frame(request);
    try {
      ipc::send_frame(fd_.get(), frame, fds, deadline);
    } catch (const Error& e) {
      throw session_error_or(e);
    }
    return id & ~ipc::kRingRequestBit;
  }
  const std::uint64_t id = next_id_.fetch_add(1);
  root.setId(id);
  auto frame = ipc::encode_frame(request, static_cast<std::uint32_t>(fds.size()));
  try {
    std::lock_guard lock(send_mutex_);
    ipc::send_frame(fd_.get(), frame, fds, deadline);
  } catch (const Error& e) {
    // The daemon may have said why it dropped us (refused, stopping) just
    // before closing: that reason is the useful error, not EPIPE.
    throw session_error_or(e);
  }
  return id;
}

void Connection::check(ipc::IncomingFrame& reply) {
  auto m = reply.message();
  if (m.isError()) {
    auto e = m.getError();
    throw Error(code_from_wire(static_cast<std::uint16_t>(e.getCode())),
                std::string("collectived: ") + e.getMessage().cStr());
  }
}

std::unique_ptr<ipc::IncomingFrame> Connection::call(capnp::MessageBuilder& request,
                                                     std::span<const int> fds,
                                                     Clock::time_point deadline) {
  const std::uint64_t id = send_request(request, fds, deadline);
  auto reply = wait_reply(id, deadline);
  if (!reply) {
    abandon(id);
    throw Error(Code::timeout, "no reply from collectived on " + socket_path_ +
                                   " within the deadline (request " + std::to_string(id) + ")");
  }
  check(*reply);
  return reply;
}

std::unique_ptr<ipc::IncomingFrame> Connection::wait_reply(std::uint64_t id,
                                                           Clock::time_point deadline) {
  std::unique_lock lock(state_mutex_);
  // Counted in waiters_ while here.
  struct Waiting {
    explicit Waiting(std::atomic<int>& w) : n(w), others(w.fetch_add(1)) {}
    ~Waiting() { n.fetch_sub(1); }
    std::atomic<int>& n;
    int others;
  } waiting(waiters_);
  if (waiting.others > 0 && ring_ok_) {
    // A reader may sleep waiting for its own id only: from now on any
    // completion wakes it. A completion published before this store did not
    // wake it, and the drain below (after the fence) finds it.
    ring_.header().wake_id.store(0, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  for (;;) {
    drain_ring_locked();
    if (auto it = arrived_.find(id); it != arrived_.end()) {
      auto frame = std::move(it->second);
      arrived_.erase(it);
      return frame;
    }
    if (broken_) throw *broken_;
    if (Clock::now() >= deadline) return nullptr;
    if (!reader_active_) {
      // Become the reader until something arrives, then let waiters look.
      read_as_reader(lock, [&] {
        if ((id & ipc::kRingRequestBit) != 0 && ring_ok_) {
          wait_ring(deadline, id);
        } else {
          read_once(deadline);
        }
      });
    } else {
      arrived_cv_.wait_until(lock, deadline);
    }
  }
}

void Connection::read_as_reader(std::unique_lock<std::mutex>& lock,
                                const std::function<void()>& read) {
  reader_active_ = true;
  lock.unlock();
  std::optional<Error> failed;
  try {
    read();
  } catch (const Error& e) {
    failed = e;
  }
  lock.lock();
  reader_active_ = false;
  if (failed && !broken_) broken_ = *failed;
  arrived_cv_.notify_all();
}

std::unique_ptr<ipc::IncomingFrame> Connection::try_reply(std::uint64_t id) {
  std::unique_lock lock(state_mutex_);
  drain_ring_locked();
  if (auto it = arrived_.find(id); it == arrived_.end() && !broken_ && !reader_active_) {
    read_as_reader(lock, [&] { read_once(Clock::now()); });
  }
  if (auto it = arrived_.find(id); it != arrived_.end()) {
    auto frame = std::move(it->second);
    arrived_.erase(it);
    return frame;
  }
  if (broken_) throw *broken_;
  return nullptr;
}

void Connection::drain_ring_locked() {
  if (!ring_ok_) return;
  ipc::RingHeader& h = ring_.header();
  bool corrupt = false;
  while (ipc::RingView::pop(h.cq_head, h.cq_tail, ring_.cq_slot(h.cq_head.load()), ring_scratch_,
                            corrupt)) {
    std::unique_ptr<ipc::IncomingFrame> frame;
    std::uint64_t id = 0;
    try {
      frame = ipc::decode_frame(ring_scratch_, decoder_.limits());
      id = frame->message().getId();
    } catch (const std::exception& e) {
      broken_ = Error(Code::protocol, std::string("malformed completion in the ring: ") + e.what());
      return;
    }
    if (abandoned_.erase(id) > 0) continue;
    arrived_[id] = std::move(frame);
  }
  // Completions waiting in the daemon for the room just made: wake its poller.
  if (h.cq_overflow.load(std::memory_order_seq_cst) != 0 &&
      h.daemon_sleeping.load(std::memory_order_seq_cst) != 0) {
    const std::uint64_t one = 1;
    (void)!::write(ring_doorbell_.get(), &one, sizeof one);
  }
}

void Connection::wait_ring(Clock::time_point deadline, std::uint64_t id) {
  ipc::RingHeader& h = ring_.header();
  auto ready = [&] {
    return h.cq_tail.load(std::memory_order_acquire) != h.cq_head.load(std::memory_order_relaxed);
  };
  // Spin first: a small collective completes in tens of microseconds, less
  // than a sleep and wake-up cost here. sched_yield lets the other ranks and
  // the daemon run when there are more of them than cores. Not when the
  // recent waits were long (large operations): the spin would only take a
  // core from the daemons doing the work (4 clients spinning 100 us per
  // 1 MiB operation across 4 daemons on 2 cores was ~10 % of the CPU).
  const auto start = Clock::now();
  const bool spin = recent_wait_us_.load(std::memory_order_relaxed) < 2 * kSpinMicros;
  const auto spin_until =
      std::min(deadline, start + std::chrono::microseconds(spin ? kSpinMicros : 0));
  auto note = [&] {
    // Moving average of this connection's ring waits (weight 1/4).
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
    const std::int64_t old = recent_wait_us_.load(std::memory_order_relaxed);
    recent_wait_us_.store(old + (static_cast<std::int64_t>(us) - old) / 4, std::memory_order_relaxed);
  };
  while (Clock::now() < spin_until) {
    if (ready()) {
      note();
      return;
    }
    sched_yield();
  }
  for (;;) {
    // Woken for this id's completion only, while no other thread waits; the
    // others' completions stay in the ring until this one comes. Stored
    // first, then the waiters counted: a thread that starts waiting in
    // between stores 0 after it counted itself (wait_reply), so the last
    // store is 0 either way.
    h.wake_id.store(id, std::memory_order_seq_cst);
    if (waiters_.load(std::memory_order_seq_cst) > 1) h.wake_id.store(0, std::memory_order_seq_cst);
    h.client_sleeping.store(1, std::memory_order_seq_cst);
    if (ready()) {
      h.client_sleeping.store(0);
      note();
      return;
    }
    // Short slices, so that a daemon that died (the socket closes) is noticed.
    const auto now = Clock::now();
    if (now >= deadline) return;
    const auto slice = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(20));
    timespec ts{};
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    ts.tv_sec = ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
    ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&h.client_sleeping), FUTEX_WAIT, 1, &ts,
              nullptr, 0);
    h.client_sleeping.store(0);
    if (ready()) {
      note();
      return;
    }
    // EOF or an error from the daemon ends the wait; so does any reply that
    // came by the socket (the caller looks for its id).
    read_once(Clock::now());
    return;
  }
}

void Connection::abandon(std::uint64_t id) {
  std::lock_guard lock(state_mutex_);
  if (arrived_.erase(id) == 0) abandoned_.insert(id);
}

Error Connection::session_error_or(const Error& fallback) {
  std::unique_lock lock(state_mutex_);
  if (!broken_ && !reader_active_) {
    // Whatever is still queued on the socket; the daemon already closed it.
    read_as_reader(lock, [&] {
      for (int i = 0; i < 64; ++i) read_once(Clock::now());
    });
  }
  if (broken_ && broken_->code() != Code::unavailable) return *broken_;
  if (broken_ && fallback.code() == Code::unavailable) return *broken_;
  return fallback;
}

void Connection::read_once(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  pollfd p{fd_.get(), POLLIN, 0};
  const int rc = ::poll(&p, 1, static_cast<int>(std::clamp<long long>(left, 0, 1 << 30)));
  if (rc < 0 && errno != EINTR) throw_errno("poll on the collectived socket");
  if (rc <= 0) return;  // timeout or signal: the caller re-checks its deadline
  std::vector<UniqueFd> fds;
  const ipc::RecvResult r = ipc::recv_some(fd_.get(), decoder_.read_space(), fds);
  if (r.would_block) return;
  if (r.eof) {
    throw Error(Code::unavailable, "collectived closed the connection on " + socket_path_ +
                                       " (the daemon stopped or dropped this client)");
  }
  decoder_.commit(r.bytes);
  decoder_.add_fds(std::move(fds));
  std::lock_guard lock(state_mutex_);
  while (auto frame = decoder_.next()) {
    const std::uint64_t id = frame->message().getId();
    if (id == 0) {
      // About the whole session (refused, stopping, protocol violation).
      if (frame->message().isError()) {
        auto e = frame->message().getError();
        broken_ = Error(code_from_wire(static_cast<std::uint16_t>(e.getCode())),
                        std::string("collectived: ") + e.getMessage().cStr());
      }
      continue;
    }
    if (abandoned_.erase(id) > 0) continue;
    arrived_[id] = std::move(frame);
  }
}

}  // namespace collectived::client

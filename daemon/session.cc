#include "daemon/session.h"

#include <boost/asio/buffer.hpp>
#include <boost/asio/write.hpp>
#include <climits>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "daemon/ring_poller.h"
#include "engine/host_mapping.h"
#include "ipc/version.h"

namespace collectived::daemon {

namespace asio = boost::asio;
using config::LogLevel;
using engine::Field;

namespace {
// A client that stops reading its replies must not make the daemon buffer
// without bound.
constexpr std::size_t kMaxOutboxFrames = 4096;

const char* message_name(wire::Message::Which w) {
  switch (w) {
    case wire::Message::HELLO: return "Hello";
    case wire::Message::HELLO_REPLY: return "HelloReply";
    case wire::Message::ERROR: return "Error";
    case wire::Message::OK: return "Ok";
    case wire::Message::REGISTER_HOST: return "RegisterHost";
    case wire::Message::REGISTERED: return "Registered";
    case wire::Message::DEREGISTER: return "Deregister";
    case wire::Message::STATUS: return "Status";
    case wire::Message::STATUS_REPLY: return "StatusReply";
    case wire::Message::COMM_INIT: return "CommInit";
    case wire::Message::COMM_READY: return "CommReady";
    case wire::Message::COMM_SPLIT: return "CommSplit";
    case wire::Message::COMM_DESTROY: return "CommDestroy";
    case wire::Message::COMM_ABORT: return "CommAbort";
    case wire::Message::COLLECTIVE: return "Collective";
    case wire::Message::P2P_GROUP: return "P2PGroup";
    case wire::Message::COMPLETED: return "Completed";
    case wire::Message::PEER_PING: return "PeerPing";
    case wire::Message::PEER_PONG: return "PeerPong";
    case wire::Message::ATTACH_RING: return "AttachRing";
    case wire::Message::REGISTER_GPU: return "RegisterGpu";
    case wire::Message::ATTACH_GPU: return "AttachGpu";
    case wire::Message::ATTACHED_GPU: return "AttachedGpu";
    case wire::Message::DIRECT_JOIN: return "DirectJoin";
    case wire::Message::DIRECT_JOINED: return "DirectJoined";
  }
  return "unknown";
}
// Hands engine results (from any thread) to the session.
class SessionSink final : public engine::CompletionSink {
 public:
  explicit SessionSink(std::weak_ptr<ClientSession> session) : session_(std::move(session)) {}
  void complete(std::uint64_t request_id, engine::Result result) override {
    // deliver() is thread-safe: the reply is written from this thread when
    // the socket is idle, which saves a hop through the event loop.
    if (auto session = session_.lock()) session->deliver(request_id, std::move(result));
  }

 private:
  std::weak_ptr<ClientSession> session_;
};


engine::OpKind to_engine(wire::OpKind k) {
  switch (k) {
    case wire::OpKind::ALL_REDUCE: return engine::OpKind::all_reduce;
    case wire::OpKind::ALL_GATHER: return engine::OpKind::all_gather;
    case wire::OpKind::REDUCE_SCATTER: return engine::OpKind::reduce_scatter;
    case wire::OpKind::BROADCAST: return engine::OpKind::broadcast;
    case wire::OpKind::REDUCE: return engine::OpKind::reduce;
    case wire::OpKind::ALL_TO_ALL: return engine::OpKind::all_to_all;
    case wire::OpKind::BARRIER: return engine::OpKind::barrier;
  }
  throw Error(Code::invalid_argument,
              "unknown operation kind " + std::to_string(static_cast<int>(k)));
}

}  // namespace

ClientSession::ClientSession(SessionHost& host, Socket socket, std::uint64_t id,
                             PeerCredentials cred)
    : host_(host),
      socket_(std::move(socket)),
      id_(id),
      cred_(cred),
      connected_at_(std::chrono::steady_clock::now()),
      decoder_(ipc::Limits::for_max_frame(host.profile().client.max_frame_bytes)),
      frame_timer_(socket_.get_executor()),
      close_timer_(socket_.get_executor()) {}

std::string ClientSession::who() const {
  std::string s = "session " + std::to_string(id_) + " (pid " + std::to_string(cred_.pid) +
                  ", uid " + std::to_string(cred_.uid);
  if (!name_.empty()) s += ", \"" + name_ + "\"";
  return s + ")";
}

engine::ClientRef ClientSession::client_ref(bool from_worker) {
  return engine::ClientRef{id_, cred_.pid, sink_, from_worker};
}

void ClientSession::deliver(std::uint64_t id, engine::Result result) {
  if (closed_) return;
  if (result.code != Code::ok) {
    send_reply(id, ipc::encode_error(id, result.code, result.message));
    return;
  }
  capnp::MallocMessageBuilder b(ipc::kSmallMessageWords);
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  if (result.comm) {
    auto r = m.initCommReady();
    r.setComm(result.comm->handle);
    r.setRank(result.comm->rank);
    r.setNranks(result.comm->nranks);
    r.setName(result.comm->name.c_str());
    r.setNodes(result.comm->nodes);
    r.setNode(result.comm->node);
    r.setNextNodeFirstRank(result.comm->next_node_first_rank);
  } else {
    m.initCompleted().setSeq(result.seq);
  }
  send_reply(id, ipc::encode_frame(b));
}

void ClientSession::send_reply(std::uint64_t id, std::vector<std::byte> frame) {
  if ((id & ipc::kRingRequestBit) != 0 && ring_attached_ &&
      frame.size() <= ipc::RingView::max_frame()) {
    ipc::RingHeader& h = ring_.header();
    bool pushed = false;
    {
      std::lock_guard lock(cq_mutex_);
      if (cq_overflow_.empty()) {
        pushed = ipc::RingView::push(h.cq_head, h.cq_tail, ring_.cq_slot(h.cq_tail.load()), frame);
      }
      if (!pushed) {
        // The client has not drained the ring yet: keep the order, and let
        // the poller move these in as room appears.
        if (cq_overflow_.size() >= kMaxOutboxFrames * 16) {
          asio::post(socket_.get_executor(), [self = shared_from_this()] {
            self->close("not reading its completion ring");
          });
          return;
        }
        cq_overflow_.push_back(std::move(frame));
        h.cq_overflow.store(1, std::memory_order_seq_cst);
        return;
      }
    }
    wake_client(id);
    return;
  }
  send(std::move(frame));
}

void ClientSession::wake_client(std::uint64_t id) {
  ipc::RingHeader& h = ring_.header();
  // The client sleeps on this futex word only after announcing it and the id
  // it waits for (ipc/ring.h); the completion was published (seq_cst) before
  // these loads, so a client that checked the ring before it slept saw it.
  // wake_id is the client's own memory: a wrong value only delays its own
  // wake-up (it sleeps in slices).
  if (h.client_sleeping.load(std::memory_order_seq_cst) == 0) return;
  const std::uint64_t want = h.wake_id.load(std::memory_order_seq_cst);
  if (id != 0 && want != 0 && want != id) return;
  if (h.client_sleeping.exchange(0, std::memory_order_seq_cst) != 0) {
    ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&h.client_sleeping), FUTEX_WAKE,
              INT32_MAX, nullptr, nullptr, 0);
  }
}

bool ClientSession::flush_ring_overflow() {
  ipc::RingHeader& h = ring_.header();
  bool moved = false;
  {
    std::lock_guard lock(cq_mutex_);
    while (!cq_overflow_.empty() &&
           ipc::RingView::push(h.cq_head, h.cq_tail, ring_.cq_slot(h.cq_tail.load()),
                               cq_overflow_.front())) {
      cq_overflow_.pop_front();
      moved = true;
    }
    if (cq_overflow_.empty()) h.cq_overflow.store(0, std::memory_order_seq_cst);
  }
  if (moved) wake_client(0);
  return moved;
}

void ClientSession::handle_attach_ring(std::uint64_t id, wire::AttachRing::Reader req,
                                       std::vector<UniqueFd>& fds) {
  if (ring_attached_) throw Error(Code::invalid_usage, "a ring is already attached");
  if (fds.size() != 2) {
    throw Error(Code::invalid_argument,
                "expects two descriptors (the ring memfd and a doorbell eventfd), got " +
                    std::to_string(fds.size()));
  }
  if (req.getBytes() != ipc::ring_bytes()) {
    throw Error(Code::invalid_argument, "ring of " + std::to_string(req.getBytes()) +
                                            " bytes; this daemon uses " +
                                            std::to_string(ipc::ring_bytes()));
  }
  char link[64] = {};
  const std::string proc = "/proc/self/fd/" + std::to_string(fds[1].get());
  if (::readlink(proc.c_str(), link, sizeof link - 1) < 0 ||
      std::string(link) != "anon_inode:[eventfd]") {
    throw Error(Code::invalid_argument, "the doorbell descriptor is not an eventfd");
  }
  ring_mapping_ = engine::HostMapping::map_memfd(std::move(fds[0]), ipc::ring_bytes());
  ring_ = ipc::RingView(ring_mapping_.data());
  if (!ring_.valid()) throw Error(Code::invalid_argument, "the ring header is not initialized");
  ring_doorbell_ = std::move(fds[1]);
  ring_attached_ = true;
  host_.ring_poller().attach(shared_from_this(), ring_doorbell_.get());
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.setOk();
  send(ipc::encode_frame(b));
}

bool ClientSession::ring_sleep(bool sleeping) {
  if (!ring_attached_) return false;
  ipc::RingHeader& h = ring_.header();
  h.daemon_sleeping.store(sleeping ? 1 : 0, std::memory_order_seq_cst);
  bool overflow_movable;
  {
    std::lock_guard lock(cq_mutex_);
    overflow_movable = !cq_overflow_.empty() &&
                       h.cq_tail.load() - h.cq_head.load(std::memory_order_seq_cst) < ipc::kRingSlots;
  }
  return overflow_movable ||
         h.sq_tail.load(std::memory_order_seq_cst) != h.sq_head.load(std::memory_order_relaxed);
}

bool ClientSession::poll_ring() {
  if (!ring_attached_ || ring_broken_ || closed_) return false;
  ipc::RingHeader& h = ring_.header();
  bool any = flush_ring_overflow();
  // Bounded per round, so one busy client cannot starve the others.
  for (int i = 0; i < 64; ++i) {
    bool corrupt = false;
    if (!ipc::RingView::pop(h.sq_head, h.sq_tail, ring_.sq_slot(h.sq_head.load()), ring_frame_,
                            corrupt)) {
      if (corrupt && !ring_broken_.exchange(true)) {
        asio::post(socket_.get_executor(), [self = shared_from_this()] {
          self->fail_and_close(Code::protocol, "the submission ring's indices are corrupt");
        });
      }
      break;
    }
    any = true;
    std::uint64_t id = 0;
    try {
      auto frame = ipc::decode_frame(ring_frame_, decoder_.limits());
      ipc::with_protocol_checks("ring", [&] {
        auto m = frame->message();
        id = m.getId();
        if ((id & ipc::kRingRequestBit) == 0) {
          throw Error(Code::protocol, "a ring request id must have the ring bit set");
        }
        dispatch_hot(id, m, /*from_worker=*/true);
      });
    } catch (const Error& e) {
      host_.logger().warn("request_failed", {{"session", id_},
                                             {"pid", cred_.pid},
                                             {"client", name_},
                                             {"request", id},
                                             {"via", "ring"},
                                             {"error", e.what()}});
      send_reply(id, ipc::encode_error(id, e.code(), e.what()));
    }
  }
  return any;
}

void ClientSession::dispatch_hot(std::uint64_t id, wire::Message::Reader m, bool from_worker) {
  switch (m.which()) {
    case wire::Message::COLLECTIVE:
      handle_collective(id, m.getCollective(), from_worker);
      break;
    case wire::Message::P2P_GROUP:
      handle_p2p(id, m.getP2pGroup(), from_worker);
      break;
    case wire::Message::COMM_SPLIT: {
      auto r = m.getCommSplit();
      host_.engine().comm_split(client_ref(), id, r.getComm(), r.getColor(), r.getKey());
      break;
    }
    case wire::Message::COMM_DESTROY: {
      const std::uint64_t handle = m.getCommDestroy().getComm();
      if (const auto shape = host_.engine().comm_shape(id_, handle)) {
        host_.direct_broker().comm_gone(shape->id);
      }
      {
        std::lock_guard lock(direct_decided_mu_);
        direct_decided_.erase(handle);
      }
      host_.engine().comm_destroy(client_ref(), id, handle);
      break;
    }
    case wire::Message::COMM_ABORT:
      host_.engine().comm_abort(client_ref(), id, m.getCommAbort().getComm());
      break;
    default:
      throw Error(Code::protocol,
                  std::string(message_name(m.which())) + " cannot travel through the ring");
  }
}

void ClientSession::handle_collective(std::uint64_t id, wire::Collective::Reader req,
                                      bool from_worker) {
  engine::CollectiveArgs a;
  a.kind = to_engine(req.getKind());
  a.dtype = req.getDtype();
  a.redop = req.getRedop();
  a.count = req.getCount();
  a.root = req.getRoot();
  a.send = {req.getSend().getHandle(), req.getSend().getOffset()};
  a.recv = {req.getRecv().getHandle(), req.getRecv().getOffset()};
  a.deadline = engine::deadline_from_wire(req.getDeadlineMs());
  // Across nodes, above the profile's gpu.stage_chunk_bytes: cut in chunks
  // (host and GPU ranks alike; daemon/session_gpu.cc).
  if (submit_chunked(id, req, from_worker)) return;
  if (req.hasGpu()) {
    a.gpu = gpu_sync(req.getGpu());
  } else {
    note_host_collective(req.getComm());
  }
  host_.engine().collective(client_ref(from_worker), id, req.getComm(), a);
}

void ClientSession::note_host_collective(std::uint64_t comm) {
  {
    std::lock_guard lock(direct_decided_mu_);
    if (direct_decided_.count(comm) != 0) return;  // the broker is done with it
  }
  const auto shape = host_.engine().comm_shape(id_, comm);
  if (shape) {
    host_.direct_broker().host_collective(shape->id, shape->rank, shape->next_seq, cred_.pid);
  }
}

void ClientSession::handle_p2p(std::uint64_t id, wire::P2PGroup::Reader req, bool from_worker) {
  std::vector<engine::P2PArgs> items;
  const auto list = req.getItems();
  if (list.size() > 65536) throw Error(Code::invalid_argument, "more than 65536 items in a group");
  items.reserve(list.size());
  for (auto it : list) {
    engine::P2PArgs a;
    a.is_send = it.getIsSend();
    a.peer = it.getPeer();
    a.buffer = {it.getBuffer().getHandle(), it.getBuffer().getOffset()};
    a.count = it.getCount();
    a.dtype = it.getDtype();
    a.buffer_id = it.getBufferId();
    items.push_back(a);
  }
  std::shared_ptr<engine::gpu::RankSync> gpu;
  if (req.hasGpu()) {
    if (req.getGpu().getClientStaged()) {
      throw Error(Code::invalid_argument, "a send/recv group cannot be staged by the client");
    }
    gpu = gpu_sync(req.getGpu());  // daemon/session_gpu.cc
  }
  host_.engine().p2p_group(client_ref(from_worker), id, req.getComm(), items, std::move(gpu),
                           engine::deadline_from_wire(req.getDeadlineMs()));
}

void ClientSession::start() {
  sink_ = std::make_shared<SessionSink>(weak_from_this());
  // A client must say Hello within the request deadline, or it only holds a slot.
  frame_timer_armed_ = true;
  frame_timer_.expires_after(host_.profile().deadlines.client_request);
  frame_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    self->frame_timer_armed_ = false;
    if (ec || self->closed_ || self->hello_done_) return;
    self->fail_and_close(Code::timeout,
                         "no Hello within " +
                             std::to_string(self->host_.profile().deadlines.client_request.count()) +
                             " ms of connecting (deadlines.client_request_ms)");
  });
  wait_readable();
}

void ClientSession::wait_readable() {
  socket_.async_wait(Socket::wait_read, [self = shared_from_this()](boost::system::error_code ec) {
    if (self->closed_ || self->close_after_flush_) return;
    if (ec) {
      self->close("socket error: " + ec.message());
      return;
    }
    self->on_readable();
  });
}

void ClientSession::on_readable() {
  auto self = shared_from_this();
  bool completed_frame = false;
  try {
    // Bounded number of reads per wake-up, so one busy client cannot starve
    // the others sharing the event loop.
    for (int round = 0; round < 16; ++round) {
      std::vector<UniqueFd> fds;
      ipc::RecvResult r = ipc::recv_some(socket_.native_handle(), decoder_.read_space(), fds);
      if (r.would_block) break;
      if (r.eof) {
        if (decoder_.mid_frame()) {
          host_.logger().warn("client_disconnected_mid_request",
                              {{"session", id_}, {"pid", cred_.pid}, {"client", name_},
                               {"partial_bytes", decoder_.buffered_bytes()}});
          close("disconnected in the middle of a request (" +
                std::to_string(decoder_.buffered_bytes()) + " bytes of an incomplete frame)");
        } else {
          close("disconnected");
        }
        return;
      }
      decoder_.commit(r.bytes);
      decoder_.add_fds(std::move(fds));
      while (auto frame = decoder_.next()) {
        completed_frame = true;
        dispatch(*frame);
        if (closed_ || close_after_flush_) return;
      }
    }
  } catch (const Error& e) {
    // The stream itself is untrustworthy (framing, descriptors): say why, then drop it.
    host_.logger().warn("client_protocol_error",
                        {{"session", id_}, {"pid", cred_.pid}, {"client", name_},
                         {"error", e.what()}});
    fail_and_close(e.code(), e.what());
    return;
  }
  if (completed_frame && frame_timer_armed_ && hello_done_) {
    frame_timer_.cancel();
    frame_timer_armed_ = false;
  }
  update_frame_timer();
  wait_readable();
}

void ClientSession::update_frame_timer() {
  if (!decoder_.mid_frame() || frame_timer_armed_) return;
  frame_timer_armed_ = true;
  frame_timer_.expires_after(host_.profile().deadlines.client_request);
  frame_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    self->frame_timer_armed_ = false;
    if (ec || self->closed_ || !self->decoder_.mid_frame()) return;
    self->fail_and_close(
        Code::timeout,
        "sent " + std::to_string(self->decoder_.buffered_bytes()) +
            " bytes of a frame and nothing more for " +
            std::to_string(self->host_.profile().deadlines.client_request.count()) +
            " ms (deadlines.client_request_ms)");
  });
}

void ClientSession::dispatch(ipc::IncomingFrame& frame) {
  std::uint64_t request_id = 0;
  const char* what = "message";
  try {
    ipc::with_protocol_checks("", [&] {
      auto m = frame.message();
      request_id = m.getId();
      const auto which = m.which();
      what = message_name(which);
      if (!hello_done_ && which != wire::Message::HELLO) {
        fail_and_close(Code::invalid_usage,
                       std::string("the first message of a session must be Hello, not ") + what);
        return;
      }
      if (which != wire::Message::REGISTER_HOST && which != wire::Message::ATTACH_RING &&
          which != wire::Message::REGISTER_GPU && which != wire::Message::ATTACH_GPU &&
          !frame.fds().empty()) {
        throw Error(Code::protocol, std::string(what) + " carries " +
                                        std::to_string(frame.fds().size()) +
                                        " descriptors; it takes none (they were closed)");
      }
      switch (which) {
        case wire::Message::HELLO:
          handle_hello(request_id, m.getHello());
          break;
        case wire::Message::REGISTER_HOST:
          handle_register_host(request_id, m.getRegisterHost(), frame.fds());
          break;
        case wire::Message::DEREGISTER:
          handle_deregister(request_id, m.getDeregister());
          break;
        case wire::Message::STATUS:
          handle_status(request_id);
          break;
        case wire::Message::PEER_PING:
          handle_peer_ping(request_id, m.getPeerPing());
          break;
        case wire::Message::COMM_INIT: {
          auto r = m.getCommInit();
          const auto secret = r.getSecret();
          host_.engine().comm_init(
              client_ref(), request_id,
              std::string(reinterpret_cast<const char*>(secret.begin()), secret.size()),
              r.getRendezvous().cStr(), r.getNranks(), r.getRank());
          break;
        }
        case wire::Message::COMM_SPLIT:
        case wire::Message::COMM_DESTROY:
        case wire::Message::COMM_ABORT:
        case wire::Message::COLLECTIVE:
        case wire::Message::P2P_GROUP:
          if ((request_id & ipc::kRingRequestBit) != 0) {
            throw Error(Code::protocol, "a request id with the ring bit came on the socket");
          }
          dispatch_hot(request_id, m, /*from_worker=*/false);
          break;
        case wire::Message::ATTACH_RING:
          handle_attach_ring(request_id, m.getAttachRing(), frame.fds());
          break;
        case wire::Message::REGISTER_GPU:  // daemon/session_gpu.cc
          handle_register_gpu(request_id, m.getRegisterGpu(), frame.fds());
          break;
        case wire::Message::ATTACH_GPU:
          handle_attach_gpu(request_id, m.getAttachGpu(), frame.fds());
          break;
        case wire::Message::DIRECT_JOIN:
          handle_direct_join(request_id, m.getDirectJoin());
          break;
        case wire::Message::COMM_READY:
        case wire::Message::COMPLETED:
        case wire::Message::HELLO_REPLY:
        case wire::Message::ERROR:
        case wire::Message::OK:
        case wire::Message::REGISTERED:
        case wire::Message::STATUS_REPLY:
        case wire::Message::PEER_PONG:
        case wire::Message::ATTACHED_GPU:
        case wire::Message::DIRECT_JOINED:
          throw Error(Code::invalid_usage,
                      std::string(what) + " is a daemon-to-client message; a client cannot send it");
        default:
          throw Error(Code::protocol,
                      "unknown message type " + std::to_string(static_cast<int>(which)) +
                          " (this daemon speaks protocol " +
                          std::to_string(wire::PROTOCOL_VERSION) + ")");
      }
    });
  } catch (const Error& e) {
    host_.logger().warn("request_failed", {{"session", id_},
                                           {"pid", cred_.pid},
                                           {"client", name_},
                                           {"request", request_id},
                                           {"message", what},
                                           {"code", to_string(e.code())},
                                           {"error", e.what()}});
    reply_error(request_id, e.code(), std::string(what) + ": " + e.what());
  }
}

void ClientSession::handle_hello(std::uint64_t id, wire::Hello::Reader hello) {
  if (hello_done_) throw Error(Code::invalid_usage, "Hello was already sent on this session");
  const std::uint32_t theirs = hello.getProtocolVersion();
  name_ = std::string(hello.getClientName().cStr()).substr(0, 128);
  if (theirs != wire::PROTOCOL_VERSION) {
    const std::string why = "protocol version mismatch: the client (libcollective " +
                            std::string(hello.getLibraryVersion().cStr()) + ") speaks " +
                            std::to_string(theirs) + ", this daemon (collectived " +
                            kVersion + ") speaks " + std::to_string(wire::PROTOCOL_VERSION) +
                            "; use a libcollective that matches the node's daemon";
    host_.logger().warn("client_version_mismatch",
                        {{"session", id_}, {"pid", cred_.pid}, {"client_protocol", theirs},
                         {"daemon_protocol", wire::PROTOCOL_VERSION}});
    reply_error(id, Code::protocol, why);
    close_after_flush_ = true;
    close_timer_.expires_after(std::chrono::seconds(1));
    close_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close("version mismatch");
    });
    return;
  }
  hello_done_ = true;
  if (frame_timer_armed_) {
    frame_timer_.cancel();
    frame_timer_armed_ = false;
  }
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto r = m.initHelloReply();
  r.setProtocolVersion(wire::PROTOCOL_VERSION);
  r.setDaemonVersion(kVersion);
  r.setNodeName(host_.profile().node.name.c_str());
  r.setSessionId(id_);
  r.setMaxFrameBytes(host_.profile().client.max_frame_bytes);
  r.setRendezvousAddress(host_.rendezvous_address().c_str());
  r.setOperationDeadlineMs(static_cast<std::uint64_t>(host_.profile().deadlines.operation.count()));
  r.setRendezvousDeadlineMs(
      static_cast<std::uint64_t>(host_.profile().deadlines.rendezvous.count()));
  send(ipc::encode_frame(b));
  host_.logger().info("client_hello", {{"session", id_},
                                       {"pid", cred_.pid},
                                       {"uid", cred_.uid},
                                       {"client", name_},
                                       {"library", hello.getLibraryVersion().cStr()}});
}

void ClientSession::handle_register_host(std::uint64_t id, wire::RegisterHost::Reader req,
                                         std::vector<UniqueFd>& fds) {
  if (fds.size() != 1) {
    throw Error(Code::invalid_argument,
                "expects exactly one memfd descriptor, got " + std::to_string(fds.size()));
  }
  const std::uint64_t size = req.getSize();
  auto mapping = engine::HostMapping::map_memfd(std::move(fds[0]), size);
  const std::uint64_t handle = host_.registry().add(id_, std::move(mapping));
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto r = m.initRegistered();
  r.setHandle(handle);
  r.setSize(size);
  send(ipc::encode_frame(b));
  host_.logger().debug("registered", {{"session", id_}, {"handle", handle}, {"bytes", size}});
}

void ClientSession::handle_deregister(std::uint64_t id, wire::Deregister::Reader req) {
  host_.registry().remove(id_, req.getHandle());
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.setOk();
  send(ipc::encode_frame(b));
}

void ClientSession::handle_status(std::uint64_t id) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  host_.fill_status(m.initStatusReply());
  send(ipc::encode_frame(b));
}

void ClientSession::reply_error(std::uint64_t id, Code code, const std::string& message) {
  send(ipc::encode_error(id, code, message));
}

void ClientSession::send(std::vector<std::byte> frame) {
  std::unique_lock lock(write_mutex_);
  if (closed_) return;
  if (!writing_ && outbox_.empty()) {
    // Fast path, from any thread (workers answer here directly): the socket
    // is idle, so write now instead of handing the frame to the event loop,
    // which would cost a thread wake-up per completion.
    const ssize_t n = ::send(socket_.native_handle(), frame.data(), frame.size(),
                             MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(frame.size())) return;
    if (n > 0) frame.erase(frame.begin(), frame.begin() + n);
    // EAGAIN or a short write: the event loop finishes it. Errors show up
    // there too (as a failed write or a read of EOF).
  }
  if (outbox_.size() >= kMaxOutboxFrames) {
    lock.unlock();
    asio::post(socket_.get_executor(), [self = shared_from_this(), n = outbox_.size()] {
      self->close("not reading its replies (" + std::to_string(n) + " frames queued)");
    });
    return;
  }
  outbox_.push_back(std::move(frame));
  if (!writing_) {
    writing_ = true;
    asio::post(socket_.get_executor(), [self = shared_from_this()] { self->write_next(); });
  }
}

void ClientSession::write_next() {
  std::unique_lock lock(write_mutex_);
  if (closed_) return;
  if (outbox_.empty()) {
    writing_ = false;
    const bool close_now = close_after_flush_;
    lock.unlock();
    if (close_now) close("closed by the daemon after an error");
    return;
  }
  // A deque's front stays in place while others are pushed behind it.
  std::vector<std::byte>& front = outbox_.front();
  lock.unlock();
  asio::async_write(socket_, asio::buffer(front),
                    [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                      if (ec) {
                        self->close("write failed: " + ec.message());
                        return;
                      }
                      {
                        std::lock_guard relock(self->write_mutex_);
                        if (self->closed_) return;
                        self->outbox_.pop_front();
                      }
                      self->write_next();
                    });
}

void ClientSession::fail_and_close(Code code, const std::string& why) {
  if (closed_ || close_after_flush_) return;
  close_after_flush_ = true;
  send(ipc::encode_error(0, code, why));
  // A client that does not read must not keep the session: close regardless.
  close_timer_.expires_after(std::chrono::seconds(1));
  close_timer_.async_wait([self = shared_from_this(), why](boost::system::error_code ec) {
    if (!ec) self->close(why);
  });
  bool idle;
  {
    std::lock_guard lock(write_mutex_);
    idle = !writing_ && outbox_.empty();
  }
  if (idle) close(why);
}

void ClientSession::close(std::string_view reason) {
  if (closed_) return;
  auto self = shared_from_this();  // the host drops its reference below
  if (ring_attached_.exchange(false)) host_.ring_poller().detach(this);
  boost::system::error_code ignored;
  {
    // Under the write lock: a worker must never write to a descriptor number
    // that is being closed (and may be reused by the next accept).
    std::lock_guard lock(write_mutex_);
    closed_ = true;
    socket_.shutdown(Socket::shutdown_both, ignored);
    socket_.close(ignored);
  }
  frame_timer_.cancel();
  close_timer_.cancel();
  // The engine first: its ranks of this client are dead, its peers are told.
  host_.engine().client_gone(id_);
  // The GPU executor next: it lets the daemon's streams past this client's
  // inputs still queued there before its registrations go.
  host_.gpu().client_gone(id_);
  const std::size_t released = host_.registry().remove_all(id_);
  host_.logger().info("client_closed", {{"session", id_},
                                        {"pid", cred_.pid},
                                        {"client", name_},
                                        {"reason", reason},
                                        {"registrations_released", released}});
  host_.session_closed(id_);
}

}  // namespace collectived::daemon

#include "daemon/server.h"

#include <sched.h>

#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "config/profile_diff.h"
#include "daemon/comm_status.h"
#include "daemon/groups.h"
#include "engine/transport/transport.h"
#include "ipc/error.h"
#include "ipc/version.h"

namespace collectived::daemon {

namespace asio = boost::asio;
using stream = asio::local::stream_protocol;

namespace {

std::string address_of(const config::Profile& p) {
  // Without a peer listener no other daemon can reach this one, and several
  // such daemons on a host would all be "127.0.0.1:0": name this one by its
  // pid and node instead (short enough for a unique id), so that a unique id
  // taken to another daemon is refused with a clear error rather than
  // rendezvousing apart.
  if (p.peer.port == 0) return "local:" + std::to_string(::getpid()) + "@" + p.node.name;
  // IPv6 literals are bracketed so that the port stays unambiguous.
  const bool v6 = p.peer.listen_address.find(':') != std::string::npos;
  return (v6 ? "[" + p.peer.listen_address + "]" : p.peer.listen_address) + ":" +
         std::to_string(p.peer.port);
}

engine::EngineOptions engine_options(const config::Profile& p, engine::EngineObserver* observer) {
  engine::EngineOptions o;
  o.observer = observer;
  o.node_name = p.node.name;
  o.rendezvous_address = address_of(p);
  o.operation_deadline = p.deadlines.operation;
  o.rendezvous_deadline = p.deadlines.rendezvous;
  o.worker_threads = p.workers.threads;
  o.max_unreceived_bytes = p.memory.max_unreceived_bytes;
  return o;
}

}  // namespace

engine::gpu::GpuOptions gpu_options(const config::Profile& p, const TestHooks& hooks) {
  engine::gpu::GpuOptions o;
  o.mps = p.gpu.mps;
  o.stage_chunk_bytes = p.gpu.stage_chunk_bytes;
  o.copy_engine_min_bytes = p.gpu.copy_engine_min_bytes;
  o.two_step_min_gpus = p.gpu.two_step_min_gpus;
  o.one_shot_bytes = hooks.gpu_one_shot_bytes;
  o.debug_sync = hooks.gpu_debug_sync;
  return o;
}

engine::NodeAlgorithmOptions node_algorithms(const config::Profile& p) {
  engine::NodeAlgorithmOptions o;
  // The profile accepts only the names the engine parses (kAlgorithms).
  o.algorithm = engine::parse_algorithm_override(p.collectives.algorithm)
                    .value_or(engine::AlgorithmOverride::automatic);
  o.direct_max_bytes = p.collectives.direct_max_bytes;
  o.pairwise_max_nodes = static_cast<int>(p.collectives.pairwise_max_nodes);
  o.input_poll = p.workers.event_loop_spin;
  // A transfer chunk and its engine header must travel as one TCP chunk: a
  // message one header over tcp.chunk_bytes would go as two and be
  // reassembled (a zero-fill and a copy more) on the other side. From
  // kPlaceMinBytes of payload the header (a few hundred bytes) travels in
  // the chunk's frame and only the payload counts (tcp/pair.cc, protocol
  // 3), so the chunk is tcp.chunk_bytes itself: a 1 MiB segment goes as one
  // chunk, not 1020 + 4 KiB. Smaller chunks keep room for the header.
  o.chunk_bytes = p.tcp.chunk_bytes >= engine::kPlaceMinBytes ? p.tcp.chunk_bytes
                  : p.tcp.chunk_bytes > 8192                  ? p.tcp.chunk_bytes - 4096
                                                              : p.tcp.chunk_bytes / 2;
  return o;
}

namespace {

engine::RegistryLimits registry_limits(const config::Profile& p) {
  return {.max_total_bytes = p.memory.max_registered_bytes,
          .max_per_owner = p.client.max_registrations_per_client};
}

std::uint64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

std::uint32_t open_descriptors() {
  std::uint32_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    ::closedir(d);
    if (n > 0) --n;  // the directory stream's own descriptor
  }
  return n;
}

// The transports' options from the profile, and the test hooks
// (collectived --test-hook; tests only).
tcp::PeerOptions peer_options(const config::Profile& profile, const TestHooks& hooks) {
  tcp::PeerOptions o = tcp::peer_options(profile, kVersion);
  if (hooks.peer_version != 0) o.local.protocol_version = hooks.peer_version;
  return o;
}
verbs::Options verbs_options(const config::Profile& profile, const TestHooks& hooks) {
  verbs::Options o = verbs::Options::from_profile(profile);
  o.ibverbs_soname = hooks.ibverbs_soname;
  o.qp_error_after = hooks.verbs_qp_error_after;
  return o;
}

// Keys that SIGHUP applies without a restart.
bool live_key(const std::string& key) {
  return key == "log.level" || key.rfind("deadlines.", 0) == 0 ||
         key == "memory.max_registered_bytes" || key == "client.max_registrations_per_client" ||
         key == "client.allowed_uids" || key == "client.allowed_gids" ||
         key == "client.allowed_groups" ||
         key == "client.max_clients" || key.rfind("collectives.", 0) == 0 ||
         key == "workers.event_loop_spin_us";
}

}  // namespace

Server::Server(config::Profile profile, ProfileSource source, engine::Logger& logger,
               TestHooks hooks)
    : profile_(std::move(profile)),
      source_(std::move(source)),
      test_hooks_(std::move(hooks)),
      log_(logger),
      registry_(registry_limits(profile_)),
      engine_(engine_options(profile_, &metrics_), registry_, log_),
      gpu_(engine::gpu::make_gpu_executor(log_, gpu_options(profile_, test_hooks_))),
      // An idle poller keeps polling this long before it sleeps: a little
      // longer than a small collective's round trip through the clients.
      ring_poller_(std::chrono::microseconds(200)),
      acceptor_(io_),
      signals_(io_, SIGTERM, SIGINT, SIGHUP),
      watchdog_timer_(io_),
      shutdown_timer_(io_),
      sweep_timer_(io_),
      peers_(io_, peer_options(profile_, test_hooks_), log_),
      metrics_server_(io_, log_,
                      [this] {
                        capnp::MallocMessageBuilder b;
                        auto status = b.initRoot<wire::StatusReply>();
                        fill_status(status);
                        return metrics_.render(status.asReader());
                      }),
      started_(std::chrono::steady_clock::now()) {
  engine_.set_node_algorithms(node_algorithms(profile_));
  engine_.set_gpu_executor(gpu_.get());
  // Operations between nodes run on the event loop that reads the peer
  // sockets (as fibers): no thread hand-off per message.
  engine_.set_node_runner([this](std::function<void()> f) { boost::asio::post(io_, std::move(f)); });
}

Server::~Server() {
  // The engine outlives the peer manager (member order): cut it loose first.
  engine_.set_node_transport(nullptr);
  if (socket_bound_) ::unlink(profile_.client.socket.c_str());
}

void Server::listen() {
  // Peers first: once the client socket answers, the daemon is fully up.
  peers_.listen();  // peer.listen_address:peer.port, unless peer.port is 0
  if (peers_.listening()) {
    transport_ = std::make_unique<transport::SelectingTransport>(
        profile_, verbs_options(profile_, test_hooks_), address_of(profile_), peers_, engine_, log_);
    transport_->start();
    engine_.set_node_transport(transport_.get());
  }
  const std::string& path = profile_.client.socket;
  namespace fs = std::filesystem;
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::exists(parent, ec)) {
    // Started by hand rather than by systemd (which creates RuntimeDirectory=).
    fs::create_directories(parent, ec);
    if (ec) {
      throw Error(Code::system, "cannot create the socket directory " + parent.string() + ": " +
                                    ec.message());
    }
    ::chmod(parent.c_str(), 0755);
  }
  // A socket file left by a daemon that died is removed; one that answers
  // belongs to a live daemon, and two daemons on one socket would steal each
  // other's clients.
  if (fs::exists(path, ec)) {
    stream::socket probe(io_);
    boost::system::error_code connect_ec;
    probe.connect(stream::endpoint(path), connect_ec);
    if (!connect_ec) {
      throw Error(Code::unavailable, "another collectived is already listening on " + path +
                                         "; stop it or choose another client.socket");
    }
    ::unlink(path.c_str());
  }
  boost::system::error_code bec;
  acceptor_.open(stream(), bec);
  if (!bec) acceptor_.bind(stream::endpoint(path), bec);
  if (bec) {
    throw Error(Code::system, "cannot bind the client socket " + path + ": " + bec.message());
  }
  socket_bound_ = true;
  if (::chmod(path.c_str(), profile_.client.socket_mode) != 0) {
    throw_errno("chmod of the client socket " + path);
  }
  std::vector<std::string> missing;
  give_socket_group(path, missing);
  resolve_client_groups(missing);
  acceptor_.listen(asio::socket_base::max_listen_connections, bec);
  if (bec) throw Error(Code::system, "listen on " + path + ": " + bec.message());
  if (!profile_.metrics.listen.empty()) {
    metrics_server_.listen(profile_.metrics.listen, profile_.client.socket_mode);
  }
}

std::string Server::rendezvous_address() const { return address_of(profile_); }

void Server::arm_deadline_sweep() {
  // Deadlines are checked at a twentieth of the operation deadline (10-100 ms):
  // an expired operation is answered within 5% of its deadline.
  const auto interval = std::clamp<std::chrono::milliseconds>(
      profile_.deadlines.operation / 20, std::chrono::milliseconds(10),
      std::chrono::milliseconds(100));
  sweep_timer_.expires_after(interval);
  sweep_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_) return;
    engine_.check_deadlines();
    direct_broker_.check_deadlines(profile_.deadlines.operation);
    arm_deadline_sweep();
  });
}

void Server::run_event_loop() {
  // Between nodes, an operation's messages come in one after the other: a
  // chunk, the next node's ready, a completion. Sleeping in epoll between
  // them costs a wake-up each (an interrupt, a context switch; tens of
  // microseconds on a loaded host), which NCCL's proxy and Open MPI avoid
  // by polling. So after a handler ran, the loop keeps polling, yielding the
  // CPU between polls (other daemons, clients and workers may need it), for
  // workers.event_loop_spin_us before it sleeps. An idle daemon polls only
  // after its heartbeats. Polling roughly halved an 8-byte all-reduce on 4
  // daemons and 2 cores; spinning 400 us was no better than 100.
  using Clock = std::chrono::steady_clock;
  auto busy_at = Clock::now();
  while (!io_.stopped()) {
    if (io_.poll() != 0) {  // ready handlers, and the sockets (epoll, no wait)
      busy_at = Clock::now();
      continue;
    }
    if (Clock::now() - busy_at < profile_.workers.event_loop_spin) {
      sched_yield();
      continue;
    }
    if (io_.run_one() == 0) break;  // sleeps until the next handler
    busy_at = Clock::now();
  }
}

int Server::run() {
  accept_next();
  wait_signal();
  arm_watchdog();
  arm_deadline_sweep();
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", profile_.client.socket_mode);
  log_.info("listening", {{"socket", profile_.client.socket},
                          {"mode", mode},
                          {"node", profile_.node.name},
                          {"version", kVersion},
                          {"pid", static_cast<long>(::getpid())},
                          {"metrics", metrics_server_.address()},
                          {"profile", source_.file.empty() ? "<embedded default>" : source_.file}});
  notifier_.ready();
  run_event_loop();
  log_.info("stopped", {{"uptime_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::steady_clock::now() - started_)
                                          .count()}});
  return 0;
}

void Server::accept_next() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream::socket socket) {
    if (stopping_) return;
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      // EMFILE and friends: say so and keep accepting; the backlog waits.
      log_.error("accept_failed", {{"error", ec.message()}});
    } else {
      on_accept(std::move(socket));
    }
    accept_next();
  });
}

void Server::give_socket_group(const std::string& path, std::vector<std::string>& missing) {
  const std::string& name = profile_.client.socket_group;
  if (name.empty()) return;
  const auto gid = group_id(name);
  if (!gid) {
    missing.push_back(name);
    return;
  }
  if (::chown(path.c_str(), static_cast<uid_t>(-1), *gid) != 0) {
    throw_errno("chown of the client socket " + path + " to group " + name);
  }
}

void Server::resolve_client_groups(std::vector<std::string> missing) {
  client_gids_ =
      resolve_allowed_gids(profile_.client.allowed_gids, profile_.client.allowed_groups, missing);
  if (missing.empty()) return;
  std::string names;
  for (const auto& m : missing) names += (names.empty() ? "" : " ") + m;
  // One line, also for the embedded default on a node without the package.
  log_.warn("groups_missing",
            {{"groups", names},
             {"why", "client.socket_group / client.allowed_groups name groups this node does not "
                     "have: the socket keeps the daemon's group and no one connects through them "
                     "(the Debian package creates group collectived; else addgroup --system NAME)"}});
}

bool Server::allowed(const PeerCredentials& cred, int fd, std::string& why) const {
  const auto& c = profile_.client;
  if (cred.uid == ::geteuid()) return true;
  if (std::find(c.allowed_uids.begin(), c.allowed_uids.end(), cred.uid) != c.allowed_uids.end())
    return true;
  auto allowed_gid = [&](gid_t g) {
    return std::binary_search(client_gids_.begin(), client_gids_.end(), g);
  };
  if (allowed_gid(cred.gid)) return true;
  // Supplementary groups count too (SO_PEERGROUPS, Linux 4.13+).
  gid_t groups[256];
  socklen_t len = sizeof groups;
  if (!client_gids_.empty() && ::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
    for (socklen_t i = 0; i < len / sizeof(gid_t); ++i) {
      if (allowed_gid(groups[i])) return true;
    }
  }
  why = "uid " + std::to_string(cred.uid) + " / gid " + std::to_string(cred.gid) + " (pid " +
        std::to_string(cred.pid) +
        ") is not allowed by this node's profile (client.allowed_uids, client.allowed_gids, "
        "client.allowed_groups); ask the node's administrator to add it";
  if (!c.allowed_groups.empty()) {
    why += " (or to add this user to group";
    for (const auto& g : c.allowed_groups) why += " " + g;
    why += ", then log in again)";
  }
  return false;
}

void Server::on_accept(stream::socket socket) {
  ucred uc{};
  socklen_t len = sizeof uc;
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0) {
    log_.error("peercred_failed", {{"error", std::strerror(errno)}});
    return;
  }
  const PeerCredentials cred{uc.pid, uc.uid, uc.gid};
  auto refuse = [&](Code code, const std::string& why, const char* event) {
    log_.warn(event, {{"pid", cred.pid}, {"uid", cred.uid}, {"gid", cred.gid}, {"why", why}});
    // Best effort: the refused client learns why instead of seeing a bare EOF.
    auto frame = ipc::encode_error(0, code, why);
    boost::system::error_code ignored;
    socket.non_blocking(true, ignored);
    ::send(socket.native_handle(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    socket.close(ignored);
  };
  std::string why;
  if (!allowed(cred, socket.native_handle(), why)) {
    metrics_.client_refused();
    refuse(Code::permission_denied, why, "client_refused");
    return;
  }
  if (sessions_.size() >= profile_.client.max_clients) {
    metrics_.client_refused();
    refuse(Code::resource_exhausted,
           "the daemon already serves " + std::to_string(sessions_.size()) +
               " clients (client.max_clients)",
           "client_refused");
    return;
  }
  metrics_.client_accepted();
  const std::uint64_t id = next_session_id_++;
  auto session = std::make_shared<ClientSession>(*this, std::move(socket), id, cred);
  sessions_.emplace(id, session);
  log_.debug("client_connected", {{"session", id}, {"pid", cred.pid}, {"uid", cred.uid}});
  session->start();
}

void Server::session_closed(std::uint64_t session_id) {
  direct_broker_.session_gone(session_id);
  // Deferred: the session may still be on the stack of its own handler.
  asio::post(io_, [this, session_id] {
    sessions_.erase(session_id);
    if (stopping_ && sessions_.empty()) io_.stop();
  });
}

void Server::fill_status(wire::StatusReply::Builder s) {
  const auto now = std::chrono::steady_clock::now();
  s.setDaemonVersion(kVersion);
  s.setProtocolVersion(wire::PROTOCOL_VERSION);
  s.setNodeName(profile_.node.name.c_str());
  s.setPid(::getpid());
  s.setUptimeMs(std::chrono::duration_cast<std::chrono::milliseconds>(now - started_).count());
  std::vector<std::shared_ptr<ClientSession>> live;
  for (auto& [id, sess] : sessions_) {
    if (!sess->closed()) live.push_back(sess);
  }
  auto clients = s.initClients(static_cast<unsigned>(live.size()));
  for (unsigned i = 0; i < live.size(); ++i) {
    const auto& sess = live[i];
    auto c = clients[i];
    c.setSessionId(sess->id());
    c.setPid(sess->credentials().pid);
    c.setUid(sess->credentials().uid);
    c.setGid(sess->credentials().gid);
    c.setName(sess->name().c_str());
    const auto t = registry_.totals_of(sess->id());
    c.setRegistrations(static_cast<std::uint32_t>(t.count));
    c.setRegisteredBytes(t.bytes);
    c.setConnectedMs(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - sess->connected_at()).count());
  }
  const auto totals = registry_.totals();
  s.setRegistrations(static_cast<std::uint32_t>(totals.count));
  s.setRegisteredBytes(totals.bytes);
  s.setPoolBytes(0);  // the daemon allocates its pools with the transports that use them
  s.setResidentBytes(resident_bytes());
  s.setOpenDescriptors(open_descriptors());
  const auto es = engine_.stats();
  s.setWorkerThreads(es.worker_threads);
  s.setCommunicators(es.communicators);
  s.setOperationsInFlight(es.in_flight);
  s.setOperationsCompleted(es.completed);
  s.setLogLevel(std::string(config::to_string(log_.level())).c_str());
  tcp::fill_peer_status(peers_, s);
  if (transport_) {
    transport_->fill_status(s);
  } else {
    auto v = s.initVerbs();
    v.setEnabled(false);
    v.setReason("no peer listener (peer.port is 0): this daemon serves its own node only");
  }
  const auto g = gpu_->status();
  auto gs = s.initGpu();
  gs.setAvailable(g.available);
  gs.setReason(g.reason.c_str());
  auto devs = gs.initDevices(static_cast<unsigned>(g.devices.size()));
  for (unsigned i = 0; i < g.devices.size(); ++i) devs.set(i, g.devices[i].c_str());
  gs.setMps(g.mps.c_str());
  gs.setMpsReason(g.mps_reason.c_str());
  gs.setMappings(g.mappings);
  gs.setMappedBytes(g.mapped_bytes);
  fill_comm_status(engine_.snapshot(), s);
  s.setMetricsAddress(metrics_server_.address().c_str());
  s.setClientSocket(profile_.client.socket.c_str());
}

void Server::wait_signal() {
  signals_.async_wait([this](boost::system::error_code ec, int signo) {
    if (ec) return;
    if (signo == SIGHUP) {
      reload();
    } else {
      begin_shutdown(signo == SIGTERM ? "SIGTERM" : "SIGINT");
    }
    wait_signal();
  });
}

void Server::reload() {
  notifier_.reloading();
  config::Profile next;
  try {
    next = config::load_profile(source_.file, source_.overrides);
  } catch (const std::exception& e) {
    log_.error("reload_failed", {{"error", e.what()}, {"action", "kept the running profile"}});
    notifier_.ready();
    return;
  }
  std::size_t applied = 0, ignored = 0;
  config::Profile merged = profile_;
  for (const auto& change : config::diff(profile_, next)) {
    if (live_key(change.key)) {
      ++applied;
      log_.info("reload_changed",
                {{"key", change.key}, {"from", change.before}, {"to", change.after}});
    } else {
      ++ignored;
      log_.warn("reload_needs_restart", {{"key", change.key},
                                         {"running", change.before},
                                         {"file", change.after},
                                         {"action", "restart collectived to apply"}});
    }
  }
  merged.log = next.log;
  merged.deadlines = next.deadlines;
  merged.memory.max_registered_bytes = next.memory.max_registered_bytes;
  merged.client.max_registrations_per_client = next.client.max_registrations_per_client;
  merged.client.allowed_uids = next.client.allowed_uids;
  merged.client.allowed_gids = next.client.allowed_gids;
  merged.client.allowed_groups = next.client.allowed_groups;
  merged.client.max_clients = next.client.max_clients;
  merged.collectives = next.collectives;
  merged.workers.event_loop_spin = next.workers.event_loop_spin;
  profile_ = std::move(merged);
  resolve_client_groups({});
  engine_.set_node_algorithms(node_algorithms(profile_));
  log_.set_level(profile_.log.level);
  registry_.set_limits(registry_limits(profile_));
  engine_.set_deadlines(profile_.deadlines.operation, profile_.deadlines.rendezvous);
  peers_.set_deadlines(profile_.deadlines.connect, profile_.deadlines.heartbeat);
  log_.info("reloaded", {{"applied", applied}, {"needs_restart", ignored}});
  notifier_.ready();
}

void Server::begin_shutdown(const std::string& reason) {
  if (stopping_) return;
  stopping_ = true;
  notifier_.stopping();
  log_.info("stopping", {{"signal", reason},
                         {"clients", sessions_.size()},
                         {"deadline_ms", profile_.deadlines.shutdown.count()}});
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  if (socket_bound_) {
    ::unlink(profile_.client.socket.c_str());
    socket_bound_ = false;
  }
  watchdog_timer_.cancel();
  sweep_timer_.cancel();
  metrics_server_.close();
  // Every client learns why its session ends; work in flight fails with it.
  engine_.shutdown("collectived on node " + profile_.node.name + " is stopping (" + reason + ")");
  if (transport_) transport_->shutdown();
  peers_.shutdown("collectived on node " + profile_.node.name + " is stopping (" + reason + ")");
  const std::string why = "collectived on node " + profile_.node.name + " is stopping (" +
                          reason + "); in-flight operations were aborted";
  auto sessions = sessions_;
  for (auto& [id, sess] : sessions) sess->fail_and_close(Code::aborted, why);
  if (sessions_.empty()) {
    io_.stop();
    return;
  }
  shutdown_timer_.expires_after(profile_.deadlines.shutdown);
  shutdown_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    log_.warn("shutdown_deadline", {{"clients_left", sessions_.size()}});
    for (auto& [id, sess] : std::map(sessions_)) sess->close("daemon stopping: deadline passed");
    io_.stop();
  });
}

void Server::arm_watchdog() {
  const auto interval = notifier_.watchdog_interval();
  if (!interval) return;
  notifier_.watchdog();
  // Half the interval, as sd_watchdog_enabled(3) recommends. The ping comes
  // from the event loop itself, so a stuck loop stops the pings and systemd
  // restarts the daemon.
  watchdog_timer_.expires_after(*interval / 2);
  watchdog_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec && !stopping_) arm_watchdog();
  });
}

}  // namespace collectived::daemon

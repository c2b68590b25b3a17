#include "client/ctl/status_model.h"

#include <cstdlib>

#include "client/collective.h"
#include "client/connection.h"
#include "ipc/frame.h"

namespace collectived::client::ctl {

namespace {

std::string state_name(wire::PeerLinkState s) {
  switch (s) {
    case wire::PeerLinkState::CONNECTING: return "connecting";
    case wire::PeerLinkState::READY: return "ready";
    case wire::PeerLinkState::DEAD: return "dead";
  }
  return "unknown";
}

DaemonStatus from_wire(wire::StatusReply::Reader s) {
  DaemonStatus d;
  d.version = s.getDaemonVersion();
  d.protocol = s.getProtocolVersion();
  d.node = s.getNodeName();
  d.pid = s.getPid();
  d.uptime_ms = s.getUptimeMs();
  for (auto c : s.getClients()) {
    d.clients.push_back({c.getSessionId(), c.getPid(), c.getUid(), c.getGid(), c.getName(),
                         c.getRegistrations(), c.getRegisteredBytes(), c.getConnectedMs()});
  }
  d.registrations = s.getRegistrations();
  d.registered_bytes = s.getRegisteredBytes();
  d.pool_bytes = s.getPoolBytes();
  d.resident_bytes = s.getResidentBytes();
  d.open_fds = s.getOpenDescriptors();
  d.worker_threads = s.getWorkerThreads();
  d.log_level = s.getLogLevel();
  d.communicators = s.getCommunicators();
  d.in_flight = s.getOperationsInFlight();
  d.completed = s.getOperationsCompleted();
  for (auto p : s.getPeers()) {
    PeerRow r;
    r.address = p.getAddress();
    r.node = p.getNode();
    r.state = state_name(p.getState());
    r.outbound = p.getOutbound();
    r.streams = p.getStreams();
    r.congestion_control = p.getCongestionControl();
    r.bytes_sent = p.getBytesSent();
    r.bytes_received = p.getBytesReceived();
    r.rtt_us = p.getRttUs();
    r.skew_ms = p.getClockSkewMs();
    r.errors = p.getErrors();
    r.connections = p.getConnections();
    r.connected_ms = p.getConnectedMs();
    r.last_error = p.getLastError();
    r.transport = p.getTransport();
    r.transport_reason = p.getTransportReason();
    if (p.hasVerbs()) {
      auto v = p.getVerbs();
      r.has_verbs = true;
      r.verbs_healthy = v.getHealthy();
      r.verbs_queue_pairs = v.getQueuePairs();
      r.verbs_pairs = v.getPairs();
      r.verbs_error = v.getError();
      r.verbs_in_place_messages = v.getInPlaceMessages();
      r.verbs_in_place_bytes = v.getInPlaceBytes();
      r.verbs_staged_bytes = v.getStagedBytes();
      r.verbs_in_place_error = v.getInPlaceError();
    }
    d.peers.push_back(std::move(r));
  }
  if (s.hasVerbs()) {
    auto v = s.getVerbs();
    d.verbs_enabled = v.getEnabled();
    d.verbs_reason = v.getReason();
    d.verbs_device = v.getDevice();
    d.gpudirect = v.getGpuDirect();
    d.gpudirect_reason = v.getGpuDirectReason();
    d.verbs_pool_bytes = v.getPoolBytes();
    d.verbs_pool_in_use = v.getPoolInUse();
    d.mr_cache_entries = v.getMrCacheEntries();
    d.mr_cache_hits = v.getMrCacheHits();
    d.mr_cache_misses = v.getMrCacheMisses();
  }
  if (s.hasGpu()) {
    auto g = s.getGpu();
    d.gpu_available = g.getAvailable();
    d.gpu_reason = g.getReason();
    for (auto dev : g.getDevices()) d.gpu_devices.emplace_back(dev);
    d.mps = g.getMps();
    d.mps_reason = g.getMpsReason();
    d.gpu_mappings = g.getMappings();
    d.gpu_mapped_bytes = g.getMappedBytes();
  }
  d.peer_address = s.getPeerAddress();
  for (auto c : s.getComms()) {
    CommRow row;
    row.name = c.getName();
    row.nranks = c.getNranks();
    row.broken = c.getBroken();
    for (auto r : c.getRanks()) {
      row.ranks.push_back({r.getRank(), r.getPid(), r.getSessionId(), r.getNode(), r.getActive(),
                           r.getNextSeq(), r.getRemote()});
    }
    for (auto o : c.getOperations()) {
      OpRow op;
      op.seq = o.getSeq();
      op.op = o.getOp();
      op.age_ms = o.getAgeMs();
      op.started = o.getStarted();
      op.rank = o.getRank();
      for (auto m : o.getMissingRanks()) op.missing.push_back(m);
      row.ops.push_back(std::move(op));
    }
    d.comms.push_back(std::move(row));
  }
  d.metrics_address = s.getMetricsAddress();
  d.client_socket = s.getClientSocket();
  return d;
}

}  // namespace

std::string CommRow::describe_missing(const OpRow& op) const {
  std::string out;
  for (std::uint32_t m : op.missing) {
    if (!out.empty()) out += ", ";
    out += "rank " + std::to_string(m);
    for (const RankRow& r : ranks) {
      if (r.rank != m) continue;
      out += " (pid " + std::to_string(r.pid) + " on " + r.node + (r.active ? "" : ", gone") + ")";
    }
  }
  return out;
}

std::string resolve_socket(const std::string& flag, const std::string& profile_socket) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("COLLECTIVED_SOCKET"); env != nullptr && env[0] != '\0') {
    return env;
  }
  if (!profile_socket.empty()) return profile_socket;
  return COLLECTIVE_DEFAULT_SOCKET;
}

DaemonStatus fetch_status(const std::string& socket, std::chrono::milliseconds timeout) {
  auto conn = client::Connection::open(socket, "collectivectl", timeout);
  capnp::MallocMessageBuilder b;
  b.initRoot<wire::Message>().initStatus();
  auto reply = conn->call(b, {}, client::Clock::now() + timeout);
  if (!reply->message().isStatusReply()) {
    throw Error(Code::protocol, "the daemon at " + socket + " answered Status with another message");
  }
  return from_wire(reply->message().getStatusReply());
}

PingResult ping_peer(const std::string& socket, const std::string& address) {
  PingResult r;
  collective_client_t* c = nullptr;
  if (collective_connect(socket.c_str(), "collectivectl doctor", &c) != COLLECTIVE_OK) {
    r.error = collective_last_error();
    return r;
  }
  collective_peer_ping_t pong{};
  if (collective_peer_ping(c, address.c_str(), &pong) == COLLECTIVE_OK) {
    r.ok = true;
    r.node = pong.node_name;
    r.rtt_us = pong.rtt_us;
    r.skew_ms = pong.skew_ms;
  } else {
    r.error = collective_last_error();
  }
  collective_disconnect(c);
  return r;
}

}  // namespace collectived::client::ctl

// The daemon's status as collectivectl prints it: plain structs filled from
// the wire's StatusReply (ipc/protocol.capnp), so printers and tests need no
// Cap'n Proto.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace collectived::client::ctl {

struct ClientRow {
  std::uint64_t session = 0;
  pid_t pid = 0;
  std::uint32_t uid = 0, gid = 0;
  std::string name;
  std::uint32_t registrations = 0;
  std::uint64_t registered_bytes = 0;
  std::uint64_t connected_ms = 0;
};

struct PeerRow {
  std::string address, node, state;  ///< state: connecting, ready, dead
  bool outbound = false;
  std::uint32_t streams = 0;
  std::string congestion_control;
  std::uint64_t bytes_sent = 0, bytes_received = 0, rtt_us = 0;
  double skew_ms = 0;
  std::uint64_t errors = 0;
  std::uint32_t connections = 0;
  std::uint64_t connected_ms = 0;
  std::string last_error;
  std::string transport;         ///< "verbs", "tcp" or "" (nothing sent yet)
  std::string transport_reason;  ///< why (a fallback's reason)
  bool has_verbs = false;        ///< a verbs connection was made or tried
  bool verbs_healthy = false;
  std::string verbs_queue_pairs;  ///< device, QP numbers, MTU, slots
  std::uint32_t verbs_pairs = 0;  ///< built since start (1 + rebuilds)
  std::string verbs_error;
  std::uint64_t verbs_in_place_messages = 0;  ///< payloads written from client memory
  std::uint64_t verbs_in_place_bytes = 0;
  std::uint64_t verbs_staged_bytes = 0;       ///< copied into the pool first
  std::string verbs_in_place_error;           ///< why client memory could not be registered
};

struct RankRow {
  std::uint32_t rank = 0;
  pid_t pid = 0;
  std::uint64_t session = 0;
  std::string node;
  bool active = true;
  std::uint64_t next_seq = 0;
  bool remote = false;  ///< on another node
};

struct OpRow {
  std::uint64_t seq = 0;
  std::string op;
  std::uint64_t age_ms = 0;
  bool started = false;
  int rank = -1;  ///< send/recv group: its rank; -1: collective
  std::vector<std::uint32_t> missing;
};

struct CommRow {
  std::string name;
  std::uint32_t nranks = 0;
  std::vector<RankRow> ranks;
  std::vector<OpRow> ops;
  std::string broken;
  /// "rank 3 (pid 4242 on node-a)" for each missing rank of `op`.
  std::string describe_missing(const OpRow& op) const;
};

struct DaemonStatus {
  std::string version, node, log_level, peer_address, metrics_address, client_socket;
  std::uint32_t protocol = 0;
  pid_t pid = 0;
  std::uint64_t uptime_ms = 0;
  std::vector<ClientRow> clients;
  std::uint32_t registrations = 0;
  std::uint64_t registered_bytes = 0, pool_bytes = 0, resident_bytes = 0;
  std::uint32_t open_fds = 0, worker_threads = 0, communicators = 0, in_flight = 0;
  std::uint64_t completed = 0;
  std::vector<PeerRow> peers;
  bool verbs_enabled = false;
  std::string verbs_reason, verbs_device, gpudirect, gpudirect_reason;
  std::uint64_t verbs_pool_bytes = 0, verbs_pool_in_use = 0;
  std::uint64_t mr_cache_entries = 0, mr_cache_hits = 0, mr_cache_misses = 0;
  /// The daemon's GPUs: whether it can run on them (and why not), the MPS
  /// mode in force and why, client allocations it has open.
  bool gpu_available = false;
  std::string gpu_reason, mps, mps_reason;
  std::vector<std::string> gpu_devices;
  std::uint32_t gpu_mappings = 0;
  std::uint64_t gpu_mapped_bytes = 0;
  std::vector<CommRow> comms;
};

/// The socket to use: `flag` (--socket), else $COLLECTIVED_SOCKET, else
/// `profile_socket` (from --profile), else the default.
std::string resolve_socket(const std::string& flag, const std::string& profile_socket);

/// Connects to the daemon and reads its status. Throws Error (unavailable:
/// not running; permission_denied: not allowed by the profile) whose message
/// names the socket.
DaemonStatus fetch_status(const std::string& socket, std::chrono::milliseconds timeout);

/// One round trip from the local daemon to a peer daemon (collective_peer_ping).
struct PingResult {
  bool ok = false;
  std::string node, error;
  std::uint64_t rtt_us = 0;
  double skew_ms = 0;
};
PingResult ping_peer(const std::string& socket, const std::string& address);

}  // namespace collectived::client::ctl

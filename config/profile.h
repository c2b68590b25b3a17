// Node profiles: the YAML file that describes one node's daemon, parsed into
// validated typed structs.
//
// A profile is loaded in layers: the embedded default (systemd/collectived.yaml,
// compiled in, which sets every key), then the node's file, then each
// `--set KEY.PATH=VALUE` from the command line. Every layer is validated on its
// own, so an error names the layer it came from: `file:line:column: key.path: why`.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace collectived::config {

/// Thrown for any invalid profile input. what() is the full one-line message,
/// `source:line:column: key.path: reason`.
class ProfileError : public std::runtime_error {
 public:
  ProfileError(std::string source, int line, int column, std::string key_path,
               std::string reason);
  const std::string& source() const { return source_; }
  int line() const { return line_; }  ///< 1-based; 0 when unknown
  int column() const { return column_; }  ///< 1-based; 0 when unknown
  const std::string& key_path() const { return key_path_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string source_;
  int line_;
  int column_;
  std::string key_path_;
  std::string reason_;
};

enum class LogLevel { trace, debug, info, warn, error };
enum class TransportKind { local, tcp, verbs };

std::string_view to_string(LogLevel level);
std::string_view to_string(TransportKind kind);

using Millis = std::chrono::milliseconds;

struct NodeSection {
  std::string name;  ///< node name in logs and status; empty in YAML means the host name
};

struct ClientSection {
  std::string socket;              ///< Unix socket path for local clients
  std::uint32_t socket_mode = 0;   ///< permission bits of the socket file (e.g. 0660)
  std::string socket_group;        ///< group of the socket file, by name; empty: the daemon's
  std::vector<std::uint32_t> allowed_uids;  ///< SO_PEERCRED uid allow-list
  std::vector<std::uint32_t> allowed_gids;  ///< SO_PEERCRED gid allow-list
  /// Group names allowed as allowed_gids are; the daemon resolves them when
  /// it loads the profile (a package creates its group at install time, with
  /// a gid no profile can know in advance).
  std::vector<std::string> allowed_groups;
  std::uint64_t max_frame_bytes = 0;        ///< largest accepted control frame
  std::uint32_t max_clients = 0;            ///< concurrent client sessions
  std::uint32_t max_registrations_per_client = 0;
};

struct PeerSection {
  std::string listen_address;  ///< IPv4/IPv6 address the peer listener binds
  std::uint16_t port = 0;      ///< TCP port for daemon-to-daemon connections
  std::string secret_file;     ///< cluster secret (never sent on the wire)
  std::vector<std::string> peers;  ///< "host:port" of peer daemons known up front
};

struct DeadlineSection {
  Millis operation{0};   ///< one collective, submission to completion
  Millis connect{0};     ///< opening a peer connection
  Millis rendezvous{0};  ///< all ranks of a communicator arriving at init
  Millis heartbeat{0};   ///< interval of peer heartbeats (dead after 3 missed)
  Millis shutdown{0};    ///< SIGTERM to exit
  Millis client_request{0};  ///< a client's partially sent frame must complete within this
};

struct WorkerSection {
  std::uint32_t threads = 0;  ///< 0 = one per online CPU
  /// How long the event loop keeps polling (sched_yield between polls) after
  /// its last handler before it sleeps in epoll; 0 = sleep at once.
  std::chrono::microseconds event_loop_spin{100};
};

struct MemorySection {
  std::uint64_t host_pool_bytes = 0;       ///< daemon-owned staging pool
  std::uint64_t max_registered_bytes = 0;  ///< all clients' registrations together
  /// Data from other nodes that no operation here has taken yet (eager sends,
  /// a node running ahead), all communicators together; 0 = unlimited.
  std::uint64_t max_unreceived_bytes = 0;
};

struct TcpSection {
  /// 0 = auto (tcp::effective_streams: 4 with copy threads, else 1).
  std::uint32_t streams_per_peer = 0;
  std::uint64_t chunk_bytes = 0;
  /// Threads per direction that copy chunks of 64 KiB and more to and from
  /// the peer sockets; 0 = the event loop copies them.
  std::uint32_t io_threads = 0;
  /// TCP congestion control of the peer streams (TCP_CONGESTION); empty =
  /// the system's default (net.ipv4.tcp_congestion_control).
  std::string congestion_control;
};

/// How collectives between nodes are done (engine/node_algorithms.h).
struct CollectivesSection {
  std::string algorithm;              ///< "auto", "ring", "pairwise", "direct" or "tree"
  std::uint64_t direct_max_bytes = 0;  ///< auto: direct exchange up to this size
  std::uint32_t pairwise_max_nodes = 0;  ///< auto: pairwise above it on up to this many nodes
};

struct VerbsHca {
  std::string name;     ///< e.g. mlx5_0
  std::uint32_t port;   ///< 1-based port number
};

struct VerbsSection {
  std::vector<VerbsHca> hcas;  ///< empty = discover
  int gid_index = -1;          ///< -1 = discover (RoCE v2 preferred)
  std::uint32_t mtu = 0;       ///< 0 = port's active MTU; else 256..4096
  std::uint32_t qps_per_connection = 0;
  std::uint32_t retry_count = 0;  ///< 0..7
  std::uint32_t timeout = 0;      ///< 0..31, 4.096 us * 2^timeout
  std::uint64_t slot_bytes = 0;   ///< receive slot size (RDMA WRITE target unit)
  std::uint32_t slots_per_peer = 0;     ///< receive slots (= credits) per connection
  std::uint32_t mr_cache_entries = 0;   ///< user-buffer registrations kept
  /// Client-memory pieces at least this large are written in place (registered
  /// with the HCA) instead of copied into the pool; 0 = never.
  std::uint64_t in_place_min_bytes = 0;
};

struct LogSection {
  LogLevel level = LogLevel::info;
};

struct GpuSection {
  std::string mps = "off";  ///< managed | external | off (engine/gpu/mps.h)
  /// Collectives across nodes above this many bytes per rank are cut into
  /// chunks of it (GPU ranks: pipelined staging); 0 = never cut. Every
  /// daemon of a cluster must use the same value.
  std::uint64_t stage_chunk_bytes = 0;
  /// Copies between two GPUs of at least this many bytes (broadcast,
  /// all-gather, all-to-all, send/recv over NVLink) run on the GPUs' copy
  /// engines instead of a copy kernel; 0 = always a kernel.
  std::uint64_t copy_engine_min_bytes = 16 * 1024 * 1024;
  /// Collectives of a communicator whose ranks each own one GPU of this node
  /// run as kernels the client library launches on the caller's stream
  /// (client/direct.cc): on, auto (only where MPS is not in force), or off.
  std::string client_kernels = "on";
  /// Largest rank buffer (bytes) those kernels take; larger operations go to
  /// the daemon. Each rank holds 2 x ranks x this in GPU scratch.
  std::uint64_t client_kernel_max_bytes = 16 * 1024 * 1024;
  /// All-reduce and broadcast over at least this many GPUs take two steps
  /// (each GPU's links carry 2 (n - 1) / n of the bytes instead of n - 1
  /// times them): the client's kernels from two_step_bytes per rank, the
  /// daemon's broadcast wherever it splits the work over the GPUs.
  int two_step_min_gpus = 3;
  /// Bytes per rank from which the client's kernels take two steps (with at
  /// least two_step_min_gpus ranks); 0 = never.
  std::uint64_t two_step_bytes = 512 * 1024;
  /// Across nodes, rank buffers up to this many bytes (count x element size)
  /// are staged by the client library on the caller's stream (copies to and
  /// from host memory it shares with the daemon); larger ones by the daemon
  /// (pipelined with the exchange). 0 = the daemon always. Capped at
  /// stage_chunk_bytes where that is set (a staged-by-client operation is
  /// never cut).
  std::uint64_t client_stage_max_bytes = 4 * 1024 * 1024;
};

struct MetricsSection {
  /// Prometheus endpoint: "" (off), "host:port" ("[v6]:port") or an absolute
  /// Unix socket path.
  std::string listen;
};

/// The whole node profile.
struct Profile {
  NodeSection node;
  ClientSection client;
  PeerSection peer;
  DeadlineSection deadlines;
  WorkerSection workers;
  MemorySection memory;
  std::vector<TransportKind> transports;  ///< order of preference
  TcpSection tcp;
  CollectivesSection collectives;
  VerbsSection verbs;
  LogSection log;
  GpuSection gpu;
  MetricsSection metrics;
};

/// The embedded default profile's text (the annotated systemd/collectived.yaml).
std::string_view default_profile_text();

/// Parses the embedded default. Never throws for the shipped file (a test checks).
Profile default_profile();

/// Loads a profile: the embedded default, then `file` (when not empty), then each
/// override "key.path=value" (value in YAML flow syntax, e.g. `[tcp,local]`).
/// Throws ProfileError naming the layer, line, column and key path.
Profile load_profile(const std::string& file, const std::vector<std::string>& overrides);

/// Same as load_profile but the file's text is given (tests, SIGHUP diffing).
Profile load_profile_text(std::string_view source_name, std::string_view text,
                          const std::vector<std::string>& overrides);

/// Every key path the schema knows, in schema order ("client.socket", ...).
std::vector<std::string> known_keys();

/// Renders the profile back as YAML (status, --print-effective-profile).
std::string to_yaml(const Profile& profile);

}  // namespace collectived::config

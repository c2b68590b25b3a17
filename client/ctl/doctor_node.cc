// doctor: the profile, the daemon, its socket, the memlock limit, the peers.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "client/ctl/doctor.h"
#include "client/ctl/table.h"
#include "ipc/error.h"
#include "ipc/version.h"

namespace collectived::client::ctl {

namespace {

constexpr const char* kSystemProfile = "/etc/collectived/collectived.yaml";

std::string octal(std::uint32_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04o", mode);
  return buf;
}

// "Max locked memory  65536  65536  bytes" from /proc/PID/limits: the soft limit.
std::optional<std::string> memlock_from_limits(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Max locked memory", 0) != 0) continue;
    std::istringstream fields(line.substr(17));
    std::string soft;
    fields >> soft;
    return soft;
  }
  return std::nullopt;
}

}  // namespace

void check_profile(DoctorContext& ctx, Report& r) {
  std::string file = ctx.options.profile_file;
  if (file.empty() && ::access(kSystemProfile, F_OK) == 0) file = kSystemProfile;
  ctx.profile_source = file.empty() ? "<embedded default>" : file;
  try {
    ctx.profile = config::load_profile(file, {});
  } catch (const std::exception& e) {
    r.add("profile", Verdict::fail, e.what(),
          "correct the key named above (collectivectl profile check " +
              (file.empty() ? std::string("FILE") : file) +
              "; collectived --print-default-profile documents every key)");
  }
  if (ctx.options.socket.empty()) {
    ctx.options.socket = resolve_socket("", ctx.profile ? ctx.profile->client.socket : "");
  }
  if (!ctx.profile) return;
  const config::Profile& p = *ctx.profile;
  std::string transports;
  for (auto t : p.transports) {
    if (!transports.empty()) transports += ',';  // appended: GCC 12's false -Wrestrict
    transports += config::to_string(t);
  }
  r.add("profile", Verdict::pass,
        ctx.profile_source + " is valid: node " + p.node.name + ", socket " + p.client.socket +
            ", transports [" + transports + "]" +
            (p.peer.port ? ", peers on " + p.peer.listen_address + ":" + std::to_string(p.peer.port)
                         : ", no peer listener"));
  if (p.peer.port != 0 || !p.peer.peers.empty()) {
    struct stat st {};
    if (::stat(p.peer.secret_file.c_str(), &st) != 0) {
      r.add("secret", Verdict::fail,
            "peer.secret_file " + p.peer.secret_file + ": " + std::strerror(errno),
            "create it with the same bytes on every node: openssl rand -hex 32 > " +
                p.peer.secret_file + " && chmod 0600 " + p.peer.secret_file);
    } else if ((st.st_mode & 077) != 0) {
      r.add("secret", Verdict::warn,
            "peer.secret_file " + p.peer.secret_file + " has mode " + octal(st.st_mode & 0777) +
                ": others on this node may read the cluster secret",
            "chmod 0600 " + p.peer.secret_file);
    } else {
      r.add("secret", Verdict::pass,
            "peer.secret_file " + p.peer.secret_file + " exists, mode " + octal(st.st_mode & 0777));
    }
  }
}

void check_daemon(DoctorContext& ctx, Report& r) {
  const std::string& socket = ctx.options.socket;
  try {
    ctx.daemon = fetch_status(socket, ctx.options.timeout);
  } catch (const Error& e) {
    ctx.daemon_error = e.what();
    if (e.code() == Code::resource_exhausted) {
      r.add("daemon", Verdict::fail, std::string("running but refused this client: ") + e.what(),
            "raise client.max_clients in the profile (live on SIGHUP), or find the clients "
            "that hold the connections (collectivectl status once one frees)");
    } else if (e.code() == Code::timeout) {
      r.add("daemon", Verdict::fail,
            std::string("not answering within ") + std::to_string(ctx.options.timeout.count()) +
                " ms: " + e.what(),
            "its event loop is stuck or the machine is overloaded: journalctl -u collectived; "
            "systemctl restart collectived (the watchdog restarts a wedged loop by itself)");
    } else if (e.code() == Code::permission_denied) {
      r.add("daemon", Verdict::fail, std::string("refused: ") + e.what(),
            "ask the node's administrator to add uid " + std::to_string(::getuid()) +
                " or one of your groups to client.allowed_uids / client.allowed_gids, or to add "
                "you to a group of client.allowed_groups (the package's: adduser $USER "
                "collectived)");
    } else {
      r.add("daemon", Verdict::fail, std::string("not running: ") + e.what(),
            "start it (systemctl start collectived; journalctl -u collectived says why it "
            "stopped), or point --socket / COLLECTIVED_SOCKET at the daemon's client.socket");
    }
    return;
  }
  const DaemonStatus& d = *ctx.daemon;
  r.add("daemon", Verdict::pass,
        "collectived " + d.version + " on " + d.node + " (pid " + std::to_string(d.pid) + "), up " +
            human_duration_ms(d.uptime_ms) + ": " + std::to_string(d.clients.size()) +
            " clients, " + std::to_string(d.communicators) + " communicators, " +
            std::to_string(d.in_flight) + " operations in flight");
  if (d.version != kVersion) {
    r.add("version", Verdict::warn,
          "collectivectl is " + std::string(kVersion) + " but the daemon is " + d.version,
          "install matching versions (client and daemon ship together)");
  }
  // Hang forensics: an operation older than half its deadline is probably stuck.
  const std::uint64_t deadline_ms =
      ctx.profile ? static_cast<std::uint64_t>(ctx.profile->deadlines.operation.count()) : 30000;
  for (const auto& c : d.comms) {
    for (const auto& op : c.ops) {
      if (op.age_ms * 2 < deadline_ms || op.started) continue;
      const std::string missing = c.describe_missing(op);
      r.add("stuck " + c.name, Verdict::warn,
            op.op + " seq " + std::to_string(op.seq) + " waiting " +
                human_duration_ms(op.age_ms) + (missing.empty() ? " behind an earlier operation"
                                                                : " for " + missing),
            "look at the ranks named (py-spy dump --pid PID, gdb -p PID): they have not "
            "submitted this operation; collectivectl status shows every in-flight operation");
    }
  }
}

void check_socket(DoctorContext& ctx, Report& r) {
  const std::string& path = ctx.options.socket;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    r.add("socket", ctx.daemon ? Verdict::fail : Verdict::skip,
          path + ": " + std::strerror(errno) + (ctx.daemon ? "" : " (the daemon is not running)"),
          ctx.daemon ? "the daemon answers but its socket file is gone; restart collectived" : "");
    return;
  }
  if (!S_ISSOCK(st.st_mode)) {
    r.add("socket", Verdict::fail, path + " exists but is not a socket",
          "remove it and restart collectived, or set client.socket to another path");
    return;
  }
  const std::uint32_t mode = st.st_mode & 0777;
  std::string detail = path + ": owner " + std::to_string(st.st_uid) + ":" +
                       std::to_string(st.st_gid) + ", mode " + octal(mode);
  if (::access(path.c_str(), W_OK) != 0) {
    r.add("socket", Verdict::fail, detail + "; uid " + std::to_string(::getuid()) + " may not connect",
          "join the socket's group (the package's: adduser $USER collectived, then log in "
          "again), or make client.socket_mode group-writable (0660), set client.socket_group "
          "and add that group to client.allowed_groups");
    return;
  }
  if (ctx.profile && ctx.profile->client.socket == path && ctx.profile->client.socket_mode != mode) {
    r.add("socket", Verdict::warn,
          detail + ", but " + ctx.profile_source + " says client.socket_mode " +
              octal(ctx.profile->client.socket_mode),
          "restart collectived to apply the profile's mode (or pass --profile with the file the "
          "daemon runs on)");
    return;
  }
  r.add("socket", Verdict::pass, detail);
}

void check_memlock(DoctorContext& ctx, Report& r) {
  std::string whose = "this process (the daemon is not running)";
  std::optional<std::string> soft;
  if (ctx.daemon) {
    soft = memlock_from_limits(ctx.options.proc_root + "/" + std::to_string(ctx.daemon->pid) +
                               "/limits");
    whose = "the daemon (pid " + std::to_string(ctx.daemon->pid) + ")";
  }
  if (!soft) {
    rlimit rl{};
    ::getrlimit(RLIMIT_MEMLOCK, &rl);
    soft = rl.rlim_cur == RLIM_INFINITY ? "unlimited" : std::to_string(rl.rlim_cur);
    if (ctx.daemon) whose = "this process (the daemon's /proc limits are not readable)";
  }
  if (*soft == "unlimited") {
    r.add("memlock", Verdict::pass, "RLIMIT_MEMLOCK of " + whose + " is unlimited");
    return;
  }
  const std::uint64_t bytes = std::strtoull(soft->c_str(), nullptr, 10);
  const std::string detail = "RLIMIT_MEMLOCK of " + whose + " is " + human_bytes(bytes);
  if (!ctx.uses_verbs()) {
    r.add("memlock", Verdict::pass, detail + " (enough: verbs is not in transports)");
    return;
  }
  r.add("memlock", Verdict::warn,
        detail + ": RDMA registration pins memory, and registering more than this fails",
        "LimitMEMLOCK=infinity in collectived.service (systemd/collectived.service has it); "
        "in a container, raise the runtime's memlock limit (docs/kubernetes/README.md)");
}

void check_peers(DoctorContext& ctx, Report& r) {
  if (!ctx.profile || ctx.profile->peer.peers.empty()) {
    r.add("peers", Verdict::skip,
          "no peer daemons in " + ctx.profile_source +
              " (peer.peers; launchers may supply peers at rendezvous)");
    return;
  }
  if (!ctx.daemon) {
    r.add("peers", Verdict::skip, "cannot ping the peers in peer.peers: the local daemon is not running");
    return;
  }
  for (const std::string& address : ctx.profile->peer.peers) {
    const PingResult p = ping_peer(ctx.options.socket, address);
    if (!p.ok) {
      std::string fix = "start collectived on that node with peer.port set, and open the port in "
                        "its firewall";
      if (p.error.find("secret") != std::string::npos ||
          p.error.find("authenticat") != std::string::npos) {
        fix = "put the same bytes in peer.secret_file on every node";
      } else if (p.error.find("version") != std::string::npos) {
        fix = "run the same collectived version on every node";
      }
      r.add("peer " + address, Verdict::fail, p.error, fix);
      continue;
    }
    char detail[256];
    std::snprintf(detail, sizeof detail,
                  "node %s: reachable and authenticated, round trip %llu us, clock skew %+.1f ms",
                  p.node.c_str(), static_cast<unsigned long long>(p.rtt_us), p.skew_ms);
    if (std::fabs(p.skew_ms) > 1000) {
      r.add("peer " + address, Verdict::warn, detail,
            "synchronize the clocks (chrony or systemd-timesyncd): logs of the two nodes "
            "disagree on when things happened");
    } else {
      r.add("peer " + address, Verdict::pass, detail);
    }
  }
}

}  // namespace collectived::client::ctl

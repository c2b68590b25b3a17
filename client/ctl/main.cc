// collectivectl: look at a running collectived and check a node.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/collective.h"
#include "client/ctl/doctor.h"
#include "client/ctl/json.h"
#include "client/ctl/status_print.h"
#include "config/profile.h"
#include "ipc/error.h"
#include "ipc/version.h"

namespace collectived::client::ctl {
int cuda_ipc_export_main();  // doctor_gpu.cc
}

using namespace collectived;
using namespace collectived::client::ctl;

namespace {

constexpr const char* kUsage = R"(usage: collectivectl [OPTIONS] COMMAND

Looks at the node's collectived and checks the node.

commands:
  status               version, uptime, clients, communicators, in-flight operations
                       (age, sequence number, the ranks not arrived with pid and node),
                       peers, memory
  comms                communicators: ranks, pids, nodes, next sequence numbers, in flight
  peers                other nodes' daemons: state, transport, RTT, clock skew, bytes, errors
  doctor               checks the node (daemon, socket, profile, memlock, libibverbs, HCAs,
                       GID table, CUDA, GPU peer access, CUDA IPC, GPUDirect RDMA, GPU
                       Direct Storage, peer daemons); one PASS/WARN/FAIL/SKIP line each,
                       with the fix; works when the daemon is not running
  profile check FILE   validates a profile (as collectived would load it)
  unique-id            a new communicator id hosted by this node's daemon, as the 256 hex
                       characters collective_unique_id_from_string() reads: hand it to every
                       rank in an environment variable or a file (no MPI needed)
  version              collectivectl's version

options:
  --socket PATH        the daemon's socket (default: $COLLECTIVED_SOCKET, else the
                       profile's client.socket, else /run/collectived/collectived.sock)
  --profile FILE       the node's profile (doctor; default /etc/collectived/collectived.yaml
                       when present, else the embedded default)
  --set KEY=VALUE      profile override (profile check), as collectived --set
  --json               machine-readable output (one JSON document) for every command
  --timeout-ms N       bound on each request to the daemon (default 3000)
  -h, --help           this text

exit codes:
  0   success; doctor: every check passed or was skipped as not applicable
  1   doctor: at least one WARN (degraded or slower, e.g. no GPU or no HCA), no FAIL
  2   failure: the daemon cannot be reached (status, comms, peers), the profile is invalid
      (profile check), or doctor found at least one FAIL (e.g. the daemon is not running)
  64  bad command line
)";

struct Args {
  std::string socket, profile;
  std::vector<std::string> overrides;
  bool json = false;
  long timeout_ms = 3000;
  std::vector<std::string> words;
};

int usage_error(const std::string& why) {
  std::fprintf(stderr, "collectivectl: %s\n(collectivectl --help lists commands and options)\n",
               why.c_str());
  return kExitUsage;
}

int query(const Args& a, std::string (*print)(const DaemonStatus&, bool)) {
  std::string profile_socket;
  if (!a.profile.empty()) {
    try {
      profile_socket = config::load_profile(a.profile, {}).client.socket;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "collectivectl: %s\n", e.what());
      return kExitFailures;
    }
  }
  const std::string socket = resolve_socket(a.socket, profile_socket);
  try {
    const DaemonStatus s = fetch_status(socket, std::chrono::milliseconds(a.timeout_ms));
    std::fputs(print(s, a.json).c_str(), stdout);
    return kExitOk;
  } catch (const std::exception& e) {
    if (a.json) {
      Json j;
      j.begin_object().field("error", std::string(e.what())).field("socket", socket).end_object();
      std::fputs(j.str().c_str(), stdout);
    }
    std::fprintf(stderr, "collectivectl: %s\n", e.what());
    return kExitFailures;
  }
}

int unique_id(const Args& a) {
  const std::string socket = resolve_socket(a.socket, "");
  collective_client_t* c = nullptr;
  collective_unique_id_t id;
  char text[2 * COLLECTIVE_UNIQUE_ID_BYTES + 1];
  if (collective_connect(socket.c_str(), "collectivectl unique-id", &c) != COLLECTIVE_OK ||
      collective_get_unique_id(c, &id) != COLLECTIVE_OK ||
      collective_unique_id_to_string(&id, text, sizeof text) != COLLECTIVE_OK) {
    std::fprintf(stderr, "collectivectl: %s\n", collective_last_error());
    collective_disconnect(c);
    return kExitFailures;
  }
  collective_disconnect(c);
  if (a.json) {
    Json j;
    j.begin_object().field("unique_id", std::string(text)).end_object();
    std::fputs(j.str().c_str(), stdout);
  } else {
    std::printf("%s\n", text);
  }
  return kExitOk;
}

int profile_check(const Args& a) {
  if (a.words.size() != 3) return usage_error("profile check takes one FILE");
  const std::string& file = a.words[2];
  try {
    const config::Profile p = config::load_profile(file, a.overrides);
    if (a.json) {
      Json j;
      j.begin_object().field("file", file).field("valid", true).field("node", p.node.name);
      j.field("socket", p.client.socket).end_object();
      std::fputs(j.str().c_str(), stdout);
    } else {
      std::printf("%s: valid (node %s, socket %s)\n", file.c_str(), p.node.name.c_str(),
                  p.client.socket.c_str());
    }
    return kExitOk;
  } catch (const config::ProfileError& e) {
    if (a.json) {
      Json j;
      j.begin_object()
          .field("file", file)
          .field("valid", false)
          .field("error", std::string(e.what()))
          .field("source", e.source())
          .field("line", e.line())
          .field("column", e.column())
          .field("key", e.key_path())
          .field("reason", e.reason())
          .end_object();
      std::fputs(j.str().c_str(), stdout);
    } else {
      std::printf("%s\n", e.what());
    }
    return kExitFailures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) return nullptr;
      (void)name;
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    } else if (arg == "--json") {
      a.json = true;
    } else if (arg == "--socket" || arg == "--profile" || arg == "--set" || arg == "--timeout-ms") {
      const char* v = value(arg.c_str());
      if (v == nullptr) return usage_error(arg + " needs a value");
      if (arg == "--socket") a.socket = v;
      if (arg == "--profile") a.profile = v;
      if (arg == "--set") a.overrides.push_back(v);
      if (arg == "--timeout-ms") {
        char* end = nullptr;
        a.timeout_ms = std::strtol(v, &end, 10);
        if (*end != '\0' || a.timeout_ms <= 0) return usage_error("--timeout-ms needs a positive number");
      }
    } else if (arg.rfind("--socket=", 0) == 0) {
      a.socket = arg.substr(9);
    } else if (arg.rfind("--profile=", 0) == 0) {
      a.profile = arg.substr(10);
    } else if (arg == "__cuda-ipc-export") {
      return cuda_ipc_export_main();  // doctor's second process
    } else if (!arg.empty() && arg[0] == '-') {
      return usage_error("unknown option " + arg);
    } else {
      a.words.push_back(arg);
    }
  }
  if (a.words.empty()) return usage_error("which command? status, comms, peers, doctor, profile check");
  const std::string& cmd = a.words[0];
  if (cmd == "status" && a.words.size() == 1) return query(a, print_status);
  if (cmd == "comms" && a.words.size() == 1) return query(a, print_comms);
  if (cmd == "peers" && a.words.size() == 1) return query(a, print_peers);
  if (cmd == "profile" && a.words.size() >= 2 && a.words[1] == "check") return profile_check(a);
  if (cmd == "unique-id" && a.words.size() == 1) return unique_id(a);
  if (cmd == "version") {
    if (a.json) {
      Json j;
      j.begin_object().field("version", std::string(kVersion)).end_object();
      std::fputs(j.str().c_str(), stdout);
    } else {
      std::printf("collectivectl %s\n", kVersion);
    }
    return kExitOk;
  }
  if (cmd == "doctor" && a.words.size() == 1) {
    DoctorOptions o;
    o.socket = a.socket.empty() ? "" : a.socket;
    if (const char* env = std::getenv("COLLECTIVED_SOCKET"); o.socket.empty() && env && *env) {
      o.socket = env;
    }
    o.profile_file = a.profile;
    o.timeout = std::chrono::milliseconds(a.timeout_ms);
    const Report r = run_doctor(o);
    std::fputs((a.json ? r.json() : r.text()).c_str(), stdout);
    return r.exit_code();
  }
  return usage_error("unknown command '" + cmd + "'");
}

// NCCL's environment variables: the few that mean something here are read,
// every other NCCL_* one is reported once as ignored, with the profile key of
// the node's daemon that does its job (the daemon owns transports, HCAs and
// deadlines, so a job's environment cannot change them).
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "client/nccl/shim.h"

extern char** environ;

namespace collectived::client::nccl {

namespace {

struct Replacement {
  const char* variable;
  const char* instead;
};
// The daemon's profile keys (systemd/collectived.yaml) standing for NCCL's knobs.
constexpr Replacement kReplacements[] = {
    {"NCCL_IB_HCA", "the profile's verbs.hcas"},
    {"NCCL_IB_GID_INDEX", "the profile's verbs.gid_index"},
    {"NCCL_IB_TIMEOUT", "the profile's verbs.timeout"},
    {"NCCL_IB_RETRY_CNT", "the profile's verbs.retry_count"},
    {"NCCL_IB_QPS_PER_CONNECTION", "the profile's verbs.qps_per_connection"},
    {"NCCL_IB_DISABLE", "the profile's transports list"},
    {"NCCL_NET", "the profile's transports list"},
    {"NCCL_SOCKET_IFNAME", "the profile's peer.listen_address"},
    {"NCCL_SOCKET_NTHREADS", "the profile's tcp.io_threads"},
    {"NCCL_NSOCKS_PERTHREAD", "the profile's tcp.streams_per_peer"},
    {"NCCL_ALGO", "the profile's collectives.algorithm"},
    {"NCCL_BUFFSIZE", "the profile's tcp.chunk_bytes and verbs.slot_bytes"},
    {"NCCL_P2P_DISABLE", "the profile's gpu.client_kernels"},
};
// Read by this library.
constexpr const char* kRead[] = {"NCCL_DEBUG", "NCCL_COMM_BLOCKING"};
// Not settings: NVIDIA's container images describe themselves with it, so
// it is not reported.
constexpr const char* kNotSettings[] = {"NCCL_VERSION"};

Debug parse_debug() {
  const char* v = std::getenv("NCCL_DEBUG");
  if (v == nullptr || v[0] == '\0') return Debug::none;
  if (strcasecmp(v, "VERSION") == 0) return Debug::version;
  if (strcasecmp(v, "WARN") == 0) return Debug::warn;
  if (strcasecmp(v, "INFO") == 0) return Debug::info;
  if (strcasecmp(v, "TRACE") == 0) return Debug::trace;
  return Debug::none;
}

std::string host_name() {
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  if (char* dot = std::strchr(host, '.')) *dot = '\0';
  return host;
}

void report_ignored() {
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* entry = *e;
    if (std::strncmp(entry, "NCCL_", 5) != 0) continue;
    const char* eq = std::strchr(entry, '=');
    const std::string name(entry, eq ? static_cast<std::size_t>(eq - entry) : std::strlen(entry));
    bool read = false;
    for (const char* r : kRead) read = read || name == r;
    for (const char* r : kNotSettings) read = read || name == r;
    if (read) continue;
    const char* instead = nullptr;
    for (const auto& r : kReplacements) {
      if (name == r.variable) instead = r.instead;
    }
    log_line("WARN", -1,
             std::string(entry) + " is ignored by collectived's libnccl" +
                 (instead ? std::string("; ") + instead + " replaces it" : std::string()));
  }
}

}  // namespace

Debug debug_level() {
  static const Debug level = parse_debug();
  return level;
}

void log_line(const char* level, int device, const std::string& text) {
  static const std::string host = host_name();
  std::fprintf(stderr, "%s:%d:%ld [%d] NCCL %s %s\n", host.c_str(), static_cast<int>(::getpid()),
               static_cast<long>(::syscall(SYS_gettid)), device < 0 ? 0 : device, level,
               text.c_str());
}

void note_environment(const std::string& socket) {
  static std::once_flag once;
  std::call_once(once, [&] {
    const Debug d = debug_level();
    if (d >= Debug::version) {
      log_line("INFO", -1,
               std::string("collectived libnccl ") + std::to_string(NCCL_MAJOR) + "." +
                   std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH) +
                   " (libcollective " + collective_version() + ") over daemon " + socket);
    }
    if (d != Debug::version) report_ignored();
  });
}

int env_blocking() {
  const char* v = std::getenv("NCCL_COMM_BLOCKING");
  if (v == nullptr) return -1;
  if (std::strcmp(v, "0") == 0) return 0;
  if (std::strcmp(v, "1") == 0) return 1;
  return -1;
}

bool host_only() {
  const char* v = std::getenv("COLLECTIVED_NCCL_HOST_ONLY");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace collectived::client::nccl

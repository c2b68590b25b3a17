// collectivectl doctor: checks the node for the failures that cost GPU
// clusters days (unresolvable ibverbs symbols, GPUDirect RDMA silently off,
// GPU Direct Storage libraries that do not load, memlock limits, sockets and
// profiles that do not match, unreachable peers) and says how to fix each.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/ctl/status_model.h"
#include "config/profile.h"

namespace collectived::engine::transport::verbs {
class IbverbsLibrary;
}

namespace collectived::client::ctl {

namespace verbs = engine::transport::verbs;

/// PASS: fine. WARN: works, but slower or degraded, or something to look at.
/// FAIL: broken; collectived or jobs will fail. SKIP: not applicable here
/// (does not change the exit code).
enum class Verdict { pass, warn, fail, skip };

std::string_view to_string(Verdict v);  // "PASS", "WARN", "FAIL", "SKIP"

struct Finding {
  std::string check;   ///< short id: "daemon", "ibverbs", "hca mlx5_0:1", ...
  Verdict verdict = Verdict::pass;
  std::string detail;  ///< what was found
  std::string fix;     ///< what to do ("" for PASS and SKIP)
};

/// Documented exit codes (docs/operations.md, `collectivectl --help`).
inline constexpr int kExitOk = 0;        ///< every check passed (or was skipped)
inline constexpr int kExitWarnings = 1;  ///< at least one WARN, no FAIL
inline constexpr int kExitFailures = 2;  ///< at least one FAIL
inline constexpr int kExitUsage = 64;    ///< bad command line

class Report {
 public:
  void add(std::string check, Verdict v, std::string detail, std::string fix = {});
  const std::vector<Finding>& findings() const { return findings_; }
  int exit_code() const;
  std::string text() const;  ///< one line per finding, "FIX:" lines under WARN and FAIL
  std::string json() const;

 private:
  std::vector<Finding> findings_;
};

/// Where doctor looks; tests point the roots at a fake tree.
struct DoctorOptions {
  std::string socket;            ///< resolved daemon socket
  std::string profile_file;      ///< "" = /etc/collectived/collectived.yaml if present, else default
  std::string sysfs_root = "/sys";
  std::string proc_root = "/proc";
  std::string dev_root = "/dev";
  std::chrono::milliseconds timeout{3000};  ///< daemon requests
};

/// What the checks share: the profile and, when reachable, the daemon's status.
struct DoctorContext {
  DoctorOptions options;
  std::string profile_source;  ///< the file read, or "<embedded default>"
  std::optional<config::Profile> profile;  ///< nullopt when invalid
  std::optional<DaemonStatus> daemon;       ///< nullopt when not reachable
  std::string daemon_error;
  bool uses_verbs() const;
  bool has_gpu = false;        ///< set by check_cuda
  bool has_hca = false;        ///< set by check_hcas
  bool dmabuf_in_verbs = false;  ///< ibv_reg_dmabuf_mr resolvable
  std::optional<bool> cuda_dmabuf;  ///< GPUs export dma-bufs (set by check_cuda)
  /// The daemon's own libibverbs loader (engine/transport/verbs), when it loads.
  std::shared_ptr<const verbs::IbverbsLibrary> verbs;
};

/// Runs every check, in order; finishes in seconds (each daemon request is
/// bounded by options.timeout).
Report run_doctor(const DoctorOptions& options);

// The checks, one area per file (doctor_node.cc, doctor_rdma.cc, doctor_gpu.cc).
void check_profile(DoctorContext& ctx, Report& r);
void check_daemon(DoctorContext& ctx, Report& r);
void check_socket(DoctorContext& ctx, Report& r);
void check_memlock(DoctorContext& ctx, Report& r);
void check_ibverbs(DoctorContext& ctx, Report& r);
void check_hcas(DoctorContext& ctx, Report& r);
void check_cuda(DoctorContext& ctx, Report& r);
void check_gpudirect_rdma(DoctorContext& ctx, Report& r);
void check_gds(DoctorContext& ctx, Report& r);
void check_peers(DoctorContext& ctx, Report& r);

/// First line of a file without its newline; nullopt when unreadable.
std::optional<std::string> read_line(const std::string& path);
/// Entries of a directory (no "." and ".."), sorted; empty when absent.
std::vector<std::string> list_dir(const std::string& path);

}  // namespace collectived::client::ctl

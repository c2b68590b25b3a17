// Command line of the collectived executable.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace collectived::daemon {

/// Test hooks, set by `--test-hook NAME=VALUE`: for the project's tests only,
/// never for production (not in --help). Each stands for what a test cannot
/// arrange from outside the daemon; the transports take them as options
/// (tcp::PeerOptions, verbs::Options), and nothing reads the environment.
struct TestHooks {
  /// peer_version=N: announce peer protocol version N instead of ours (the
  /// version check, without a second build). 0: ours.
  std::uint32_t peer_version = 0;
  /// ibverbs_soname=FILE: load FILE instead of libibverbs.so.1 (a machine
  /// without libibverbs). Empty: the real one.
  std::string ibverbs_soname;
  /// verbs_qp_error_after=N: move a verbs pair's QPs to the error state
  /// after N messages. 0: never.
  std::uint64_t verbs_qp_error_after = 0;
  /// gpu_one_shot_bytes=N: one GPU runs an operation inside the node up to N
  /// bytes per rank, every GPU its share above (engine/gpu/local_path.h).
  /// 0: the built-in limits.
  std::uint64_t gpu_one_shot_bytes = 0;
  /// gpu_debug_sync=1: synchronize after each step of a GPU operation and
  /// name the step that failed (diagnosis; it blocks).
  bool gpu_debug_sync = false;
};

struct Options {
  enum class Mode { run, check_profile, print_default_profile, print_profile, version, help };
  Mode mode = Mode::run;
  std::string profile_file;            ///< --profile / --check-profile FILE; empty = embedded
  std::vector<std::string> overrides;  ///< --set KEY.PATH=VALUE, in order
  TestHooks test_hooks;                ///< --test-hook NAME=VALUE (tests only)
};

/// Thrown for a malformed command line; what() says what to fix.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Parses argv (without argv[0]). Throws UsageError.
Options parse_options(const std::vector<std::string>& args);

/// The --help text.
const char* usage_text();

}  // namespace collectived::daemon

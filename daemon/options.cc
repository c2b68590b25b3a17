#include "daemon/options.h"

#include <cstdlib>

namespace collectived::daemon {
namespace {

std::uint64_t hook_number(const std::string& name, const std::string& value) {
  char* end = nullptr;
  const std::uint64_t n = std::strtoull(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0') {
    throw UsageError("--test-hook " + name + "=" + value + ": expected a number");
  }
  return n;
}

// One --test-hook NAME=VALUE (TestHooks; tests only).
void set_test_hook(TestHooks& hooks, const std::string& hook) {
  const auto eq = hook.find('=');
  if (eq == std::string::npos) throw UsageError("--test-hook " + hook + ": expected NAME=VALUE");
  const std::string name = hook.substr(0, eq);
  const std::string value = hook.substr(eq + 1);
  if (name == "peer_version") {
    hooks.peer_version = static_cast<std::uint32_t>(hook_number(name, value));
  } else if (name == "ibverbs_soname") {
    hooks.ibverbs_soname = value;
  } else if (name == "verbs_qp_error_after") {
    hooks.verbs_qp_error_after = hook_number(name, value);
  } else if (name == "gpu_one_shot_bytes") {
    hooks.gpu_one_shot_bytes = hook_number(name, value);
  } else if (name == "gpu_debug_sync") {
    hooks.gpu_debug_sync = hook_number(name, value) != 0;
  } else {
    throw UsageError("--test-hook " + hook + ": unknown hook '" + name +
                     "' (peer_version, ibverbs_soname, verbs_qp_error_after, gpu_one_shot_bytes, "
                     "gpu_debug_sync)");
  }
}

}  // namespace

const char* usage_text() {
  return "usage: collectived [--profile FILE] [--set KEY.PATH=VALUE]...\n"
         "       collectived --check-profile FILE [--set KEY.PATH=VALUE]...\n"
         "       collectived --print-default-profile\n"
         "       collectived --print-profile [--profile FILE] [--set ...]\n"
         "       collectived --version | --help\n"
         "\n"
         "  --profile FILE           node profile (YAML); without it the embedded default\n"
         "                           profile is used (collectived --print-default-profile)\n"
         "  --set KEY.PATH=VALUE     override one profile key, validated like the file,\n"
         "                           e.g. --set client.socket=/tmp/cd.sock --set log.level=debug\n"
         "  --check-profile FILE     validate FILE (and overrides); exit 0, or print the\n"
         "                           error as FILE:LINE:COLUMN: KEY: REASON and exit 1\n"
         "  --print-default-profile  print the embedded, annotated default profile\n"
         "  --print-profile          print the effective profile after all layers\n"
         "\n"
         "Signals: SIGTERM stops (in-flight work fails with an error, exit 0);\n"
         "SIGHUP reloads the live keys (log.level, deadlines.*, limits) from the profile.\n";
}

Options parse_options(const std::vector<std::string>& args) {
  Options o;
  bool mode_set = false;
  auto set_mode = [&](Options::Mode m, const std::string& flag) {
    if (mode_set && o.mode != m) throw UsageError(flag + " cannot be combined with another mode");
    o.mode = m;
    mode_set = true;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& flag) -> std::string {
      const auto eq = a.find('=');
      if (eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= args.size()) throw UsageError(flag + " needs a value");
      return args[++i];
    };
    auto is = [&](const char* flag) {
      return a == flag || a.rfind(std::string(flag) + "=", 0) == 0;
    };
    if (is("--profile")) {
      if (!o.profile_file.empty()) throw UsageError("--profile given twice");
      o.profile_file = value("--profile");
    } else if (is("--check-profile")) {
      set_mode(Options::Mode::check_profile, "--check-profile");
      if (!o.profile_file.empty()) throw UsageError("--check-profile given with --profile");
      o.profile_file = value("--check-profile");
    } else if (a == "--set") {
      if (i + 1 >= args.size()) throw UsageError("--set needs KEY.PATH=VALUE");
      o.overrides.push_back(args[++i]);
    } else if (a.rfind("--set=", 0) == 0) {
      o.overrides.push_back(a.substr(6));
    } else if (is("--test-hook")) {
      set_test_hook(o.test_hooks, value("--test-hook"));
    } else if (a == "--print-default-profile") {
      set_mode(Options::Mode::print_default_profile, a);
    } else if (a == "--print-profile") {
      set_mode(Options::Mode::print_profile, a);
    } else if (a == "--version") {
      set_mode(Options::Mode::version, a);
    } else if (a == "--help" || a == "-h") {
      set_mode(Options::Mode::help, a);
    } else {
      throw UsageError("unknown argument '" + a + "' (see collectived --help)");
    }
  }
  for (const auto& ov : o.overrides) {
    if (ov.find('=') == std::string::npos) {
      throw UsageError("--set " + ov + ": expected KEY.PATH=VALUE");
    }
  }
  return o;
}

}  // namespace collectived::daemon

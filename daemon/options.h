// Command line of the collectived executable.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace collectived::daemon {

struct Options {
  enum class Mode { run, check_profile, print_default_profile, print_profile, version, help };
  Mode mode = Mode::run;
  std::string profile_file;            ///< --profile / --check-profile FILE; empty = embedded
  std::vector<std::string> overrides;  ///< --set KEY.PATH=VALUE, in order
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

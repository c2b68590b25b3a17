// The one error vocabulary of collectived: codes on the wire and in the C API,
// an exception type inside components.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace collectived {

/// Result codes. Values are stable: they are the wire's `Code` enum and the C
/// API's `collective_result_t` (client/collective.h), in the same order.
enum class Code : std::uint16_t {
  ok = 0,
  invalid_argument = 1,   ///< a value is out of range or malformed; the call had no effect
  invalid_usage = 2,      ///< the call is not allowed in this state
  system = 3,             ///< an operating-system call failed (errno text in the message)
  remote = 4,             ///< another rank, client or daemon failed
  timeout = 5,            ///< a deadline expired
  aborted = 6,            ///< the operation or communicator was aborted / the daemon is stopping
  mismatch = 7,           ///< ranks submitted different operations for one sequence number
  not_found = 8,          ///< unknown handle, communicator or request
  permission_denied = 9,  ///< the caller may not do this (SO_PEERCRED, foreign handle)
  protocol = 10,          ///< malformed or unexpected message, version mismatch
  unavailable = 11,       ///< the daemon or a peer cannot be reached
  internal = 12,          ///< a bug in collectived
  resource_exhausted = 13,  ///< a limit from the profile was reached
};

/// Stable lower-case name of a code ("timeout").
std::string_view to_string(Code code);

/// Maps a wire value that may come from a newer peer; unknown values become internal.
Code code_from_wire(std::uint16_t value);

/// Exception carrying a code and a message that says what failed, who and where.
class Error : public std::runtime_error {
 public:
  Error(Code code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  Code code() const { return code_; }

 private:
  Code code_;
};

/// Throws Error(Code::system) with `what` and the text of errno, e.g.
/// "mmap of registration 7 (4096 bytes): Cannot allocate memory".
[[noreturn]] void throw_errno(std::string_view what);
[[noreturn]] void throw_errno(std::string_view what, int err);

}  // namespace collectived

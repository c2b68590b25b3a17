#include "ipc/error.h"

#include <cerrno>
#include <cstring>

namespace collectived {

std::string_view to_string(Code code) {
  switch (code) {
    case Code::ok: return "ok";
    case Code::invalid_argument: return "invalid argument";
    case Code::invalid_usage: return "invalid usage";
    case Code::system: return "system error";
    case Code::remote: return "remote error";
    case Code::timeout: return "timeout";
    case Code::aborted: return "aborted";
    case Code::mismatch: return "mismatch";
    case Code::not_found: return "not found";
    case Code::permission_denied: return "permission denied";
    case Code::protocol: return "protocol error";
    case Code::unavailable: return "unavailable";
    case Code::internal: return "internal error";
    case Code::resource_exhausted: return "resource exhausted";
  }
  return "unknown error";
}

Code code_from_wire(std::uint16_t value) {
  if (value <= static_cast<std::uint16_t>(Code::resource_exhausted)) return static_cast<Code>(value);
  return Code::internal;
}

void throw_errno(std::string_view what) { throw_errno(what, errno); }

void throw_errno(std::string_view what, int err) {
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  throw Error(Code::system, std::move(msg));
}

}  // namespace collectived

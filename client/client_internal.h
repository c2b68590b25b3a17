// Private to libcollective: state shared by the C API's translation units.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "client/collective.h"
#include "client/connection.h"
#include "ipc/error.h"

namespace collectived::client {

// Control requests (registration, status) answer in microseconds; this bounds
// a daemon that stopped answering.
inline constexpr std::chrono::seconds kControlTimeout{30};
// Waited beyond the daemon's own deadline, which always answers first.
inline constexpr std::chrono::seconds kDeadlineMargin{10};

struct HostBuffer {
  std::uint64_t handle;
  std::size_t bytes;  // mapped length (page-rounded)
};

/// Sets this thread's last error and returns the code as a C result.
collective_result_t fail(Code code, std::string message);

template <typename Fn>
collective_result_t guarded(const char* what, Fn&& fn) {
  try {
    fn();
    return COLLECTIVE_OK;
  } catch (const Error& e) {
    return fail(e.code(), std::string(what) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(Code::resource_exhausted, std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return fail(Code::internal, std::string(what) + ": " + e.what());
  }
}

inline void copy_text(char* dst, std::size_t cap, const char* src) {
  std::strncpy(dst, src, cap - 1);
  dst[cap - 1] = '\0';
}

}  // namespace collectived::client

struct collective_client {
  std::unique_ptr<collectived::client::Connection> conn;
  std::mutex buffers_mutex;
  std::map<std::uintptr_t, collectived::client::HostBuffer> buffers;  // by base address

  /// Handle and offset of `ptr` inside a buffer from collective_host_alloc
  /// holding at least `bytes` from it. Throws Error(invalid_argument).
  std::pair<std::uint64_t, std::uint64_t> locate(const void* ptr, std::uint64_t bytes,
                                                 const char* which);
};

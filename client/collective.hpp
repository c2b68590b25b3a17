// Thin C++ wrapper of libcollective's C API (client/collective.h): RAII and
// exceptions instead of result codes.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "client/collective.h"

namespace collective {

/// A failed libcollective call: the result code and the library's message.
class Error : public std::runtime_error {
 public:
  Error(collective_result_t code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  collective_result_t code() const { return code_; }

 private:
  collective_result_t code_;
};

inline void check(collective_result_t r) {
  if (r != COLLECTIVE_OK) throw Error(r, collective_last_error());
}

/// A connection to the node's daemon. Move-only; disconnects on destruction.
class Client {
 public:
  explicit Client(const char* socket_path = nullptr, const char* name = nullptr) {
    check(collective_connect(socket_path, name, &client_));
  }
  Client(Client&& other) noexcept : client_(std::exchange(other.client_, nullptr)) {}
  Client& operator=(Client&& other) noexcept {
    std::swap(client_, other.client_);
    return *this;
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() {
    if (client_ != nullptr) collective_disconnect(client_);
  }

  /// Host memory shared with the daemon; free with host_free or at disconnect.
  void* host_alloc(size_t bytes) {
    void* p = nullptr;
    check(collective_host_alloc(client_, bytes, &p));
    return p;
  }
  void host_free(void* p) { check(collective_host_free(client_, p)); }

  collective_status_t status() {
    collective_status_t s{};
    check(collective_status(client_, &s));
    return s;
  }

  collective_client_t* get() const { return client_; }

 private:
  collective_client_t* client_ = nullptr;
};

}  // namespace collective

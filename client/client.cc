// libcollective's C API over Connection.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "client/collective.h"
#include "client/connection.h"
#include "ipc/version.h"

using namespace collectived;

#include "client/client_internal.h"

using namespace collectived::client;

namespace collectived::client {

namespace {
thread_local std::string t_last_error;
}

collective_result_t fail(Code code, std::string message) {
  t_last_error = std::move(message);
  return static_cast<collective_result_t>(code);
}

}  // namespace collectived::client

std::pair<std::uint64_t, std::uint64_t> collective_client::locate(const void* ptr,
                                                                  std::uint64_t bytes,
                                                                  const char* which) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard lock(buffers_mutex);
  auto it = buffers.upper_bound(addr);
  if (ptr != nullptr && it != buffers.begin()) {
    --it;
    if (addr < it->first + it->second.bytes) {
      const std::uint64_t offset = addr - it->first;
      if (bytes > it->second.bytes - offset) {
        throw Error(Code::invalid_argument,
                    std::string(which) + " buffer: " + std::to_string(bytes) +
                        " bytes from offset " + std::to_string(offset) +
                        " run past the end of its " + std::to_string(it->second.bytes) +
                        "-byte collective_host_alloc buffer");
      }
      return {it->second.handle, offset};
    }
  }
  char text[32];
  std::snprintf(text, sizeof text, "%p", ptr);
  throw Error(Code::invalid_argument, std::string(which) + " buffer " + text +
                                          " is not inside memory from collective_host_alloc");
}

extern "C" {

const char* collective_result_string(collective_result_t result) {
  return to_string(code_from_wire(static_cast<std::uint16_t>(result))).data();
}

const char* collective_last_error(void) { return collectived::client::t_last_error.c_str(); }

const char* collective_version(void) { return kVersion; }

collective_result_t collective_connect(const char* socket_path, const char* client_name,
                                       collective_client_t** out) {
  if (out == nullptr) return fail(Code::invalid_argument, "collective_connect: out is NULL");
  *out = nullptr;
  std::string path;
  if (socket_path != nullptr && socket_path[0] != '\0') {
    path = socket_path;
  } else if (const char* env = std::getenv("COLLECTIVED_SOCKET"); env != nullptr && env[0]) {
    path = env;
  } else {
    path = COLLECTIVE_DEFAULT_SOCKET;
  }
  return guarded("collective_connect", [&] {
    auto c = std::make_unique<collective_client>();
    c->conn = Connection::open(path, client_name ? client_name : "", kControlTimeout);
    *out = c.release();
  });
}

void collective_disconnect(collective_client_t* client) {
  if (client == nullptr) return;
  // Closing the socket is the deregistration: the daemon releases everything
  // this session registered when it sees the disconnect.
  for (auto& [base, buf] : client->buffers) ::munmap(reinterpret_cast<void*>(base), buf.bytes);
  delete client;
}

collective_result_t collective_host_alloc(collective_client_t* client, size_t bytes, void** ptr) {
  if (client == nullptr || ptr == nullptr || bytes == 0) {
    return fail(Code::invalid_argument, "collective_host_alloc: client and ptr must be set and "
                                        "bytes must be positive");
  }
  *ptr = nullptr;
  return guarded("collective_host_alloc", [&] {
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t len = (bytes + page - 1) / page * page;
    UniqueFd fd(::memfd_create("collective-host", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!fd) throw_errno("memfd_create");
    if (::ftruncate(fd.get(), static_cast<off_t>(len)) != 0) {
      throw_errno("ftruncate of a " + std::to_string(len) + "-byte memfd");
    }
    // Sealed against resizing so that the daemon's mapping can never be cut
    // short (the daemon refuses unsealed memfds).
    if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      throw_errno("sealing the memfd");
    }
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) throw_errno("mmap of " + std::to_string(len) + " bytes");
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initRegisterHost().setSize(len);
    const int fds[1] = {fd.get()};
    std::unique_ptr<ipc::IncomingFrame> reply;
    try {
      reply = client->conn->call(b, fds, Clock::now() + kControlTimeout);
    } catch (...) {
      ::munmap(p, len);
      throw;
    }
    const std::uint64_t handle = reply->message().getRegistered().getHandle();
    {
      std::lock_guard lock(client->buffers_mutex);
      client->buffers[reinterpret_cast<std::uintptr_t>(p)] = {handle, len};
    }
    *ptr = p;
  });
}

collective_result_t collective_host_free(collective_client_t* client, void* ptr) {
  if (client == nullptr || ptr == nullptr) {
    return fail(Code::invalid_argument, "collective_host_free: client and ptr must be set");
  }
  HostBuffer buf{};
  {
    std::lock_guard lock(client->buffers_mutex);
    auto it = client->buffers.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == client->buffers.end()) {
      return fail(Code::not_found,
                  "collective_host_free: pointer was not returned by collective_host_alloc");
    }
    buf = it->second;
    client->buffers.erase(it);
  }
  return guarded("collective_host_free", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initDeregister().setHandle(buf.handle);
    // Unmap whatever the daemon says: the application gave the buffer up.
    struct Unmap {
      void* p;
      std::size_t n;
      ~Unmap() { ::munmap(p, n); }
    } unmap{ptr, buf.bytes};
    client->conn->call(b, {}, Clock::now() + kControlTimeout);
  });
}

collective_result_t collective_host_lookup(collective_client_t* client, const void* ptr,
                                           uint64_t* handle, uint64_t* offset) {
  if (client == nullptr || ptr == nullptr || handle == nullptr || offset == nullptr) {
    return fail(Code::invalid_argument, "collective_host_lookup: all arguments must be set");
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard lock(client->buffers_mutex);
  auto it = client->buffers.upper_bound(addr);
  if (it != client->buffers.begin()) {
    --it;
    if (addr < it->first + it->second.bytes) {
      *handle = it->second.handle;
      *offset = addr - it->first;
      return COLLECTIVE_OK;
    }
  }
  return fail(Code::not_found, "collective_host_lookup: pointer is not inside a buffer from "
                               "collective_host_alloc");
}

collective_result_t collective_status(collective_client_t* client, collective_status_t* out) {
  if (client == nullptr || out == nullptr) {
    return fail(Code::invalid_argument, "collective_status: client and out must be set");
  }
  return guarded("collective_status", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initStatus();
    auto reply = client->conn->call(b, {}, Clock::now() + kControlTimeout);
    auto s = reply->message().getStatusReply();
    *out = collective_status_t{};
    copy_text(out->daemon_version, sizeof out->daemon_version, s.getDaemonVersion().cStr());
    copy_text(out->node_name, sizeof out->node_name, s.getNodeName().cStr());
    out->protocol_version = s.getProtocolVersion();
    out->daemon_pid = s.getPid();
    out->uptime_ms = s.getUptimeMs();
    out->clients = s.getClients().size();
    out->registrations = s.getRegistrations();
    out->registered_bytes = s.getRegisteredBytes();
    out->pool_bytes = s.getPoolBytes();
    out->resident_bytes = s.getResidentBytes();
    out->open_descriptors = s.getOpenDescriptors();
    out->worker_threads = s.getWorkerThreads();
    out->session_id = client->conn->session_id();
  });
}

}  // extern "C"

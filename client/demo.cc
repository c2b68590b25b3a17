// collective-demo: a first client of collectived. Connects, registers a host
// buffer, reads the daemon's status, and frees the buffer.
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "client/collective.hpp"

namespace {

void print_status(const char* title, const collective_status_t& s) {
  std::printf("%s\n", title);
  std::printf("  daemon        collectived %s (protocol %u), pid %d, node %s\n", s.daemon_version,
              s.protocol_version, s.daemon_pid, s.node_name);
  std::printf("  uptime        %" PRIu64 " ms\n", s.uptime_ms);
  std::printf("  clients       %u (this one is session %" PRIu64 ")\n", s.clients, s.session_id);
  std::printf("  registrations %u, %" PRIu64 " bytes of client memory mapped\n", s.registrations,
              s.registered_bytes);
  std::printf("  daemon memory %" PRIu64 " KiB resident, %u open descriptors, %u worker threads\n",
              s.resident_bytes / 1024, s.open_descriptors, s.worker_threads);
}

}  // namespace

int main(int argc, char** argv) {
  const char* socket = argc > 1 ? argv[1] : nullptr;
  try {
    collective::Client client(socket, "collective-demo");
    std::printf("connected to collectived (libcollective %s)\n", collective_version());

    constexpr std::size_t kBytes = 1 << 20;
    auto* buf = static_cast<std::uint32_t*>(client.host_alloc(kBytes));
    for (std::size_t i = 0; i < kBytes / 4; ++i) buf[i] = static_cast<std::uint32_t>(i);
    std::uint64_t handle = 0, offset = 0;
    collective::check(collective_host_lookup(client.get(), buf + 10, &handle, &offset));
    std::printf("registered a %zu-byte host buffer: handle %" PRIu64
                ", &buf[10] is at offset %" PRIu64 "\n",
                kBytes, handle, offset);

    print_status("daemon status with the buffer registered:", client.status());
    client.host_free(buf);
    const auto after = client.status();
    print_status("daemon status after freeing it:", after);
    if (after.registrations != 0) {
      std::fprintf(stderr, "collective-demo: the daemon still holds %u registrations\n",
                   after.registrations);
      return 1;
    }
    std::printf("demo OK\n");
    return 0;
  } catch (const collective::Error& e) {
    std::fprintf(stderr, "collective-demo: %s (%s)\n", e.what(), collective_result_string(e.code()));
    return 1;
  }
}

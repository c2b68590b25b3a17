// A real collectived server (daemon/server.h) running in the fuzzer's own
// process, on its own thread, so that sanitizers and libFuzzer see every
// crash in the daemon's code. One per process, started on first use, never
// stopped (the process exits at the end of the run).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "ipc/fd.h"

namespace collectived::fuzz {

struct InprocDaemon {
  std::string dir;          ///< private temporary directory
  std::string socket;       ///< client socket path
  std::uint16_t peer_port;  ///< peer listener on 127.0.0.1
  std::string secret;       ///< the cluster secret's bytes
  std::string rendezvous;   ///< the address unique ids of this daemon name
  std::uint64_t max_frame_bytes;  ///< client.max_frame_bytes
};

/// Starts the daemon on first call; aborts if it cannot.
const InprocDaemon& daemon();

/// Blocking helpers that abort on unexpected errors (a fuzz harness bug, not a finding).
UniqueFd connect_unix(const std::string& path);
UniqueFd connect_tcp(std::uint16_t port);
/// Writes all of `bytes`; `fds` go with the first byte. False if the daemon
/// closed the connection.
bool send_all(int fd, std::span<const std::byte> bytes, std::span<const int> fds = {});
/// After the input is sent: half-closes, then reads and discards until the
/// daemon closes its side. Aborts (a hang: a finding) if that takes longer
/// than `seconds`.
void drain_until_closed(int fd, int seconds);

}  // namespace collectived::fuzz

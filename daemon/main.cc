// collectived: the per-node communication daemon.
//
// main() wires the pieces explicitly: command line -> profile -> logger ->
// server. Nothing is global.
#include <malloc.h>
#include <csignal>
#include <cstdio>
#include <iostream>

#include "config/profile.h"
#include "daemon/options.h"
#include "daemon/server.h"
#include "engine/log.h"
#include "ipc/error.h"
#include "ipc/version.h"

using namespace collectived;

int main(int argc, char** argv) {
  // Message buffers between daemons are allocated and freed per transfer
  // (up to tens of MiB). glibc serves such sizes with a fresh mmap and gives
  // them back on free, so every transfer page-faults its buffers in again: on
  // a VM ~12 us per 4 KiB page, i.e. ~50 ms per 16 MiB, more than the copy
  // itself. Keep them on the heap and reuse them instead; the heap is given
  // back to the kernel once more than 256 MiB of it is free. (M_MMAP_MAX 0
  // rather than a threshold: glibc refuses thresholds above 32 MiB.)
  ::mallopt(M_MMAP_MAX, 0);
  ::mallopt(M_TRIM_THRESHOLD, 256 << 20);
  daemon::Options opts;
  try {
    opts = daemon::parse_options(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const daemon::UsageError& e) {
    std::fprintf(stderr, "collectived: %s\n", e.what());
    return 2;
  }
  using Mode = daemon::Options::Mode;
  switch (opts.mode) {
    case Mode::help:
      std::fputs(daemon::usage_text(), stdout);
      return 0;
    case Mode::version:
      std::printf("collectived %s (protocol %u)\n", kVersion, wire::PROTOCOL_VERSION);
      return 0;
    case Mode::print_default_profile:
      std::fwrite(config::default_profile_text().data(), 1, config::default_profile_text().size(),
                  stdout);
      return 0;
    default:
      break;
  }

  config::Profile profile;
  try {
    profile = config::load_profile(opts.profile_file, opts.overrides);
  } catch (const config::ProfileError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  if (opts.mode == Mode::check_profile) {
    std::printf("%s: valid\n", opts.profile_file.c_str());
    return 0;
  }
  if (opts.mode == Mode::print_profile) {
    std::fputs(config::to_yaml(profile).c_str(), stdout);
    return 0;
  }

  // Writes to a closed client socket must fail with EPIPE, not kill the daemon.
  std::signal(SIGPIPE, SIG_IGN);
  engine::Logger log(profile.log.level);
  try {
    daemon::Server server(profile, {opts.profile_file, opts.overrides}, log, opts.test_hooks);
    server.listen();
    return server.run();
  } catch (const Error& e) {
    log.error("fatal", {{"code", to_string(e.code())}, {"error", e.what()}});
    return 1;
  } catch (const std::exception& e) {
    log.error("fatal", {{"error", e.what()}});
    return 1;
  }
}

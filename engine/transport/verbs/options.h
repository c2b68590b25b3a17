// The verbs transport's settings (verbs.*, memory.host_pool_bytes of the
// profile), and the clock its deadlines use.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "config/profile.h"

namespace collectived::engine::transport::verbs {

using Clock = std::chrono::steady_clock;

/// The transport's settings, from the profile (verbs.*, memory.host_pool_bytes).
struct Options {
  std::vector<config::VerbsHca> hcas;  ///< empty: every active port
  int gid_index = -1;                  ///< -1: discover (RoCE v2 IPv4-mapped preferred)
  std::uint32_t mtu = 0;               ///< bytes; 0: the port's active MTU
  std::uint32_t qps_per_connection = 1;
  std::uint32_t retry_count = 7;       ///< 0..7
  std::uint32_t timeout = 20;          ///< 0..31: 4.096 us * 2^timeout per try
  std::uint64_t pool_bytes = 64ull << 20;
  std::uint64_t slot_bytes = 512ull << 10;
  std::uint32_t slots_per_peer = 16;
  std::uint32_t mr_cache_entries = 1024;
  /// Client-memory pieces at least this large are written in place; 0 = never
  /// (NodeTransport).
  std::uint64_t in_place_min_bytes = 16 * 1024;
  /// Progress thread: busy-poll this long after the last completion, then
  /// sched_yield() until yield_us, then sleep on the completion channel.
  std::uint32_t spin_us = 50;
  std::uint32_t yield_us = 1000;
  /// A waiting caller polls the completion queue itself this long before sleeping.
  std::uint32_t wait_poll_us = 0;

  /// Test hooks (collectived --test-hook; never set in production): the
  /// file loaded instead of libibverbs.so.1 ("": the real one), and a QP
  /// error forced after this many messages (0: never; NodeTransport).
  std::string ibverbs_soname;
  std::uint64_t qp_error_after = 0;

  static Options from_profile(const config::Profile& profile);
};

}  // namespace collectived::engine::transport::verbs

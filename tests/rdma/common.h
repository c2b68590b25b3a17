// Shared by the RDMA tests and tools: options from "--key value" arguments.
#pragma once

#include <cstdlib>
#include <map>
#include <string>

#include "engine/transport/verbs/device.h"

namespace collectived::rdma_test {

namespace verbs = engine::transport::verbs;

using Args = std::map<std::string, std::string>;

inline Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) == 0) k = k.substr(2);
    a[k] = argv[i + 1];
  }
  return a;
}

inline std::string arg(const Args& a, const std::string& key, const std::string& fallback) {
  auto it = a.find(key);
  return it == a.end() ? fallback : it->second;
}

inline std::string env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

/// Transport options for the tests: small slots and short verbs timeouts, so
/// that credits run out and a dead peer is noticed in well under a second of
/// (emulated) time; overridable by arguments.
inline verbs::Options options_from(const Args& a) {
  verbs::Options o;
  o.gid_index = std::stoi(arg(a, "gid-index", env("RDMA_VM_GID_INDEX", "-1")));
  o.qps_per_connection = static_cast<std::uint32_t>(std::stoul(arg(a, "qps", "1")));
  o.slots_per_peer = static_cast<std::uint32_t>(std::stoul(arg(a, "slots", "8")));
  o.slot_bytes = std::stoull(arg(a, "slot-bytes", std::to_string(64 * 1024)));
  o.pool_bytes = std::stoull(arg(a, "pool-bytes", std::to_string(48ull << 20)));
  o.timeout = static_cast<std::uint32_t>(std::stoul(arg(a, "timeout", "14")));  // 67 ms
  o.retry_count = static_cast<std::uint32_t>(std::stoul(arg(a, "retry", "3")));
  o.mtu = static_cast<std::uint32_t>(std::stoul(arg(a, "mtu", "0")));
  o.mr_cache_entries = 64;
  o.spin_us = static_cast<std::uint32_t>(std::stoul(arg(a, "spin-us", "50")));
  o.yield_us = static_cast<std::uint32_t>(std::stoul(arg(a, "yield-us", "1000")));
  o.wait_poll_us = static_cast<std::uint32_t>(std::stoul(arg(a, "wait-poll-us", "0")));
  return o;
}

/// Bit set in the tag of an echoed message.
constexpr std::uint64_t kEchoBit = 1ull << 63;

}  // namespace collectived::rdma_test

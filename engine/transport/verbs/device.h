// A verbs device: one opened HCA port with its protection domain, registered
// pool, MR cache and progress thread, which connects pairs (verbs/pair.h).
// Free of <infiniband/verbs.h> (pimpl), so the engine and the daemon never
// include verbs headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/profile.h"
#include "engine/transport/verbs/buffer.h"
#include "engine/transport/verbs/options.h"
#include "engine/transport/verbs/pair.h"

namespace collectived::engine::transport::verbs {

class IbverbsLibrary;

struct DeviceStats {
  std::uint64_t pool_bytes = 0;         ///< registered once at open
  std::uint64_t pool_in_use = 0;
  std::uint64_t mr_cache_entries = 0;
  std::uint64_t mr_cache_hits = 0;
  std::uint64_t mr_cache_misses = 0;    ///< registrations made
};

/// One opened HCA port with its protection domain, registered pool, MR cache,
/// completion channel and progress thread.
class Device {
 public:
  /// Opens the port `hca` (name, port), or the first active port when `hca` is
  /// empty (Options::hcas picks otherwise). Throws Error (not_found,
  /// unavailable, system) saying which device and why.
  static std::unique_ptr<Device> open(std::shared_ptr<const IbverbsLibrary> lib,
                                      const Options& options, std::string local_node,
                                      std::optional<config::VerbsHca> hca = std::nullopt);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// A block of the registered pool (registered once at open).
  Buffer allocate(std::size_t size);
  /// A registration covering [data, data + size), from the MR cache or new.
  Buffer register_memory(void* data, std::size_t size);
  /// Drops cached registrations overlapping the range (call before unmapping it).
  void invalidate(void* data, std::size_t size);
  /// An object that calls invalidate(data, size) when destroyed (a no-op once
  /// the device is gone): attach it to the owner of the memory, which drops it
  /// before the memory is unmapped (engine::HostRegion).
  std::shared_ptr<void> invalidator(void* data, std::size_t size);

  /// Connects to `peer_node` over `channel` (both sides call it). Throws naming the peer.
  std::unique_ptr<Pair> connect(ExchangeChannel& channel, const std::string& peer_node,
                                Clock::time_point deadline);

  /// "rxe0 port 1 (Ethernet, RoCE v2 gid 1 0000:...:0a63:0001, mtu 1024)".
  std::string describe() const;
  const std::string& name() const;
  std::uint32_t port() const;
  DeviceStats stats() const;

  struct Impl;

 private:
  explicit Device(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Opens every port the options name (or every active port): one Device each.
/// Throws when none can be opened, with every port's reason.
std::vector<std::unique_ptr<Device>> open_devices(std::shared_ptr<const IbverbsLibrary> lib,
                                                  const Options& options,
                                                  const std::string& local_node);

}  // namespace collectived::engine::transport::verbs

// A client's host memory, mapped into the daemon.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "engine/transport/host_region.h"
#include "ipc/fd.h"

namespace collectived::engine {

/// Owns a MAP_SHARED mapping of a client's memfd. Move-only; unmaps on
/// destruction, after it destroyed its region() (and with it what transports
/// registered of it).
class HostMapping {
 public:
  /// Validates and maps `size` bytes of `fd`:
  ///  - it must be a memfd (only memfds answer F_GET_SEALS), so that a client
  ///    cannot make the daemon map a device, a file of another user or a pipe;
  ///  - it must be sealed with F_SEAL_SHRINK, so that the client can never
  ///    truncate it under the daemon's mapping (access past the end of a
  ///    shrunk file is a SIGBUS that would kill the daemon);
  ///  - it must be at least `size` bytes long.
  /// Throws Error(invalid_argument) naming what is wrong, or Error(system).
  static HostMapping map_memfd(UniqueFd fd, std::uint64_t size);

  HostMapping() = default;
  HostMapping(const HostMapping&) = delete;
  HostMapping& operator=(const HostMapping&) = delete;
  HostMapping(HostMapping&& other) noexcept;
  HostMapping& operator=(HostMapping&& other) noexcept;
  ~HostMapping();

  std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  /// The mapping as transports see it (null for an empty mapping). Its
  /// address does not change when the mapping is moved.
  HostRegion* region() const { return region_.get(); }

 private:
  HostMapping(std::byte* data, std::uint64_t size)
      : data_(data), size_(size), region_(std::make_unique<HostRegion>(data, size)) {}
  void release();
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  std::unique_ptr<HostRegion> region_;
};

}  // namespace collectived::engine

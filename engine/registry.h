// Registered client memory, by handle, per owning client session.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/host_mapping.h"

namespace collectived::engine {

/// A client's GPU allocation opened by the daemon (engine/gpu/): closed when
/// the last holder lets go.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual std::byte* data() const = 0;  ///< device address in the daemon (UVA)
  /// The same memory as GPU `device` reaches it (an allocation opened through
  /// a legacy IPC handle is mapped per accessing GPU). Thread-safe.
  virtual std::byte* data_on(int device) const { (void)device; return data(); }
  virtual std::uint64_t size() const = 0;
  virtual int device() const = 0;       ///< the daemon's ordinal of the GPU holding it
  virtual std::uint64_t buffer_id() const = 0;  ///< the client's buffer id at registration
};

/// One registration: memory of one client mapped by the daemon. Shared so that
/// an operation in flight keeps the mapping alive after deregistration.
struct Registration {
  std::uint64_t handle;
  std::uint64_t owner;  ///< session id of the client that registered it
  HostMapping mapping;
  std::shared_ptr<DeviceMemory> device;  ///< set for GPU memory (mapping is empty then)

  std::byte* data() const { return device ? device->data() : mapping.data(); }
  std::uint64_t size() const { return device ? device->size() : mapping.size(); }
};

/// Limits from the profile.
struct RegistryLimits {
  std::uint64_t max_total_bytes = 0;  ///< 0 = unlimited
  std::uint32_t max_per_owner = 65536;
};

/// Table of registrations. Thread-safe: the event loop adds and removes,
/// workers look up.
class Registry {
 public:
  explicit Registry(RegistryLimits limits) : limits_(limits) {}

  /// Adds a mapping owned by `owner`; returns its handle.
  /// Throws Error(resource_exhausted) when a profile limit would be exceeded.
  std::uint64_t add(std::uint64_t owner, HostMapping mapping);
  /// Adds a client's GPU allocation opened by the daemon. GPU memory does not
  /// count against memory.max_registered_bytes (the daemon maps no host memory for it).
  std::uint64_t add_device(std::uint64_t owner, std::shared_ptr<DeviceMemory> device);

  /// Looks up `handle` for `owner`. Throws Error(not_found) for an unknown or
  /// deregistered handle and Error(permission_denied) for another client's.
  std::shared_ptr<Registration> find(std::uint64_t owner, std::uint64_t handle) const;

  /// Like find(), and checks that [offset, offset+bytes) lies inside it.
  std::shared_ptr<Registration> find_range(std::uint64_t owner, std::uint64_t handle,
                                           std::uint64_t offset, std::uint64_t bytes) const;

  /// Removes one registration (same errors as find()).
  void remove(std::uint64_t owner, std::uint64_t handle);

  /// Removes every registration of `owner` (client exit); returns how many.
  std::size_t remove_all(std::uint64_t owner);

  struct Totals {
    std::uint64_t count = 0;
    std::uint64_t bytes = 0;
  };
  Totals totals() const;
  Totals totals_of(std::uint64_t owner) const;

  void set_limits(RegistryLimits limits);

 private:
  std::uint64_t add_locked(std::uint64_t owner, Registration reg, bool limited);
  std::shared_ptr<Registration> find_locked(std::uint64_t owner, std::uint64_t handle) const;

  mutable std::mutex mutex_;
  RegistryLimits limits_;
  std::uint64_t next_handle_ = 1;
  std::uint64_t total_bytes_ = 0;
  std::map<std::uint64_t, std::shared_ptr<Registration>> by_handle_;
  std::map<std::uint64_t, Totals> by_owner_;
};

}  // namespace collectived::engine

#include "engine/registry.h"

#include <vector>

#include "ipc/error.h"

namespace collectived::engine {

std::uint64_t Registry::add(std::uint64_t owner, HostMapping mapping) {
  std::lock_guard lock(mutex_);
  return add_locked(owner, Registration{0, owner, std::move(mapping), nullptr}, true);
}

std::uint64_t Registry::add_device(std::uint64_t owner, std::shared_ptr<DeviceMemory> device) {
  std::lock_guard lock(mutex_);
  return add_locked(owner, Registration{0, owner, HostMapping{}, std::move(device)}, false);
}

std::uint64_t Registry::add_locked(std::uint64_t owner, Registration reg, bool limited) {
  Totals& mine = by_owner_[owner];
  if (mine.count >= limits_.max_per_owner) {
    throw Error(Code::resource_exhausted,
                "client already holds " + std::to_string(mine.count) +
                    " registrations (client.max_registrations_per_client)");
  }
  const std::uint64_t size = reg.size();
  if (limited && limits_.max_total_bytes != 0 && total_bytes_ + size > limits_.max_total_bytes) {
    throw Error(Code::resource_exhausted,
                "registering " + std::to_string(size) + " bytes would exceed the node's " +
                    std::to_string(limits_.max_total_bytes) +
                    " registered bytes (memory.max_registered_bytes); " +
                    std::to_string(total_bytes_) + " are registered");
  }
  const std::uint64_t handle = next_handle_++;
  reg.handle = handle;
  by_handle_.emplace(handle, std::make_shared<Registration>(std::move(reg)));
  mine.count += 1;
  mine.bytes += size;
  total_bytes_ += size;
  return handle;
}

std::shared_ptr<Registration> Registry::find_locked(std::uint64_t owner,
                                                    std::uint64_t handle) const {
  auto it = by_handle_.find(handle);
  if (it == by_handle_.end()) {
    throw Error(Code::not_found, "unknown registration handle " + std::to_string(handle) +
                                     " (never registered, or already deregistered)");
  }
  if (it->second->owner != owner) {
    throw Error(Code::permission_denied, "registration handle " + std::to_string(handle) +
                                             " belongs to another client");
  }
  return it->second;
}

std::shared_ptr<Registration> Registry::find(std::uint64_t owner, std::uint64_t handle) const {
  std::lock_guard lock(mutex_);
  return find_locked(owner, handle);
}

std::shared_ptr<Registration> Registry::find_range(std::uint64_t owner, std::uint64_t handle,
                                                   std::uint64_t offset,
                                                   std::uint64_t bytes) const {
  auto reg = find(owner, handle);
  const std::uint64_t size = reg->size();
  // Written to be overflow-safe: offset + bytes could wrap.
  if (offset > size || bytes > size - offset) {
    throw Error(Code::invalid_argument,
                "range [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                    ") is outside registration " + std::to_string(handle) + " of " +
                    std::to_string(size) + " bytes");
  }
  return reg;
}

void Registry::remove(std::uint64_t owner, std::uint64_t handle) {
  std::shared_ptr<Registration> victim;
  {
    std::lock_guard lock(mutex_);
    victim = find_locked(owner, handle);
    by_handle_.erase(handle);
    Totals& mine = by_owner_[owner];
    mine.count -= 1;
    mine.bytes -= victim->size();
    if (mine.count == 0) by_owner_.erase(owner);
    total_bytes_ -= victim->size();
  }
  // The unmap (in the last owner's destructor) happens outside the lock.
}

std::size_t Registry::remove_all(std::uint64_t owner) {
  std::vector<std::shared_ptr<Registration>> victims;
  {
    std::lock_guard lock(mutex_);
    for (auto it = by_handle_.begin(); it != by_handle_.end();) {
      if (it->second->owner == owner) {
        total_bytes_ -= it->second->size();
        victims.push_back(std::move(it->second));
        it = by_handle_.erase(it);
      } else {
        ++it;
      }
    }
    by_owner_.erase(owner);
  }
  return victims.size();
}

Registry::Totals Registry::totals() const {
  std::lock_guard lock(mutex_);
  return {by_handle_.size(), total_bytes_};
}

Registry::Totals Registry::totals_of(std::uint64_t owner) const {
  std::lock_guard lock(mutex_);
  auto it = by_owner_.find(owner);
  return it == by_owner_.end() ? Totals{} : it->second;
}

void Registry::set_limits(RegistryLimits limits) {
  std::lock_guard lock(mutex_);
  limits_ = limits;
}

}  // namespace collectived::engine

// A client's host memory as the transports see it: a mapped range that
// payload pieces may point into, and a place where a transport that registers
// memory with hardware (verbs: an MR per HCA) keeps what it registered, so
// that it registers each mapping once and sends from it in place.
//
// Why attachments and not a cache keyed by address alone: a mapping that goes
// away and a new one that the kernel places at the same address would be
// served the old registration, whose pinned pages are no longer the client's
// memory (the stale-registration bug of every MR cache). The owner of the
// mapping (engine/host_mapping.h) destroys its HostRegion before it unmaps, and
// with it every attachment: a transport's attachment drops its registration
// there.
//
// Header-only: the engine owns regions, the verbs library (which the engine
// links, not the reverse) attaches to them.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace collectived::engine {

class HostRegion {
 public:
  HostRegion(const std::byte* base, std::size_t size) : base_(base), size_(size) {}
  /// Drops the attachments (in no particular order) while the memory is still mapped.
  ~HostRegion() { clear(); }
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  const std::byte* base() const { return base_; }
  std::size_t size() const { return size_; }
  /// Whether [p, p + n) lies inside the region.
  bool contains(const void* p, std::size_t n) const {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && b <= base_ + size_ && n <= static_cast<std::size_t>(base_ + size_ - b);
  }

  /// Runs `make` and keeps its result under `key` (a transport object), unless
  /// something is kept there already. Returns whether `make` ran. Thread-safe.
  bool attach(const void* key, const std::function<std::shared_ptr<void>()>& make) {
    std::lock_guard lock(mu_);
    auto [it, inserted] = attached_.try_emplace(key);
    if (!inserted) return false;
    try {
      it->second = make();
    } catch (...) {
      attached_.erase(it);
      throw;
    }
    return true;
  }
  /// What is kept under `key` (null if nothing).
  std::shared_ptr<void> attached(const void* key) const {
    std::lock_guard lock(mu_);
    auto it = attached_.find(key);
    return it == attached_.end() ? nullptr : it->second;
  }
  /// Drops every attachment now (outside the lock: their destructors may lock).
  void clear() {
    std::map<const void*, std::shared_ptr<void>> gone;
    {
      std::lock_guard lock(mu_);
      gone.swap(attached_);
    }
  }
  std::size_t attachments() const {
    std::lock_guard lock(mu_);
    return attached_.size();
  }

 private:
  const std::byte* base_;
  std::size_t size_;
  mutable std::mutex mu_;
  std::map<const void*, std::shared_ptr<void>> attached_;
};

}  // namespace collectived::engine

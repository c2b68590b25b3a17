// Registered memory: the daemon's pool (allocated and registered once, at
// start, sizes from the profile) and a cache of user-buffer registrations.
// Internal to the verbs transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>

#include "engine/transport/verbs/resources.h"

namespace collectived::engine::transport::verbs {

/// Access every registration here grants: local writes (receives land in it)
/// and remote writes (the peer's RDMA WRITEs target the receive slots).
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

/// Anonymous memory (mmap, populated) registered once as one MR; blocks are
/// handed out first-fit, 4 KiB aligned, and come back when their owner drops.
class RegisteredPool : public std::enable_shared_from_this<RegisteredPool> {
 public:
  /// A block of the pool; returns to the pool when destroyed.
  class Block {
   public:
    Block(std::shared_ptr<RegisteredPool> pool, std::size_t offset, std::size_t size);
    ~Block();
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    std::byte* data() const;
    std::size_t size() const { return size_; }
    std::uint32_t lkey() const;
    std::uint32_t rkey() const;

   private:
    std::shared_ptr<RegisteredPool> pool_;
    std::size_t offset_;
    std::size_t size_;
  };

  static std::shared_ptr<RegisteredPool> create(const ProtectionDomain& pd, std::size_t bytes);
  ~RegisteredPool();

  /// A block of at least `size` bytes; throws resource_exhausted naming the pool
  /// size and what is in use (memory.host_pool_bytes).
  std::unique_ptr<Block> allocate(std::size_t size);
  std::size_t capacity() const { return bytes_; }
  std::size_t in_use() const;
  const MemoryRegion& region() const { return *mr_; }

 private:
  RegisteredPool(std::size_t bytes) : bytes_(bytes) {}
  void release(std::size_t offset, std::size_t size);

  std::size_t bytes_;
  void* base_ = nullptr;
  std::unique_ptr<MemoryRegion> mr_;
  mutable std::mutex mutex_;
  std::map<std::size_t, std::size_t> free_;  // offset -> size, coalesced
  std::size_t used_ = 0;
};

/// User buffers registered once and reused: a lookup that falls inside a cached
/// region returns it. Least recently used entries beyond the capacity are dropped
/// (their MR is deregistered when the last user lets go). invalidate() must be
/// called when memory is unmapped, so that a new mapping at the same address is
/// not served a stale registration.
class MrCache {
 public:
  MrCache(const ProtectionDomain& pd, std::size_t capacity) : pd_(pd), capacity_(capacity) {}

  std::shared_ptr<MemoryRegion> get(void* addr, std::size_t length);
  /// Drops every cached region overlapping [addr, addr + length).
  void invalidate(void* addr, std::size_t length);
  std::size_t size() const;
  std::uint64_t hits() const;
  std::uint64_t misses() const;

 private:
  struct Entry {
    std::uintptr_t begin;
    std::uintptr_t end;
    std::shared_ptr<MemoryRegion> mr;
  };
  const ProtectionDomain& pd_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::list<Entry> lru_;  // most recent first
  std::uint64_t hits_ = 0;
  std::uint64_t misses_ = 0;
};

}  // namespace collectived::engine::transport::verbs

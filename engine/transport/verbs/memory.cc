#include "engine/transport/verbs/memory.h"

#include <sys/mman.h>

#include <cerrno>

#include "ipc/error.h"

namespace collectived::engine::transport::verbs {
namespace {
constexpr std::size_t kAlign = 4096;
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

RegisteredPool::Block::Block(std::shared_ptr<RegisteredPool> pool, std::size_t offset,
                             std::size_t size)
    : pool_(std::move(pool)), offset_(offset), size_(size) {}

RegisteredPool::Block::~Block() { pool_->release(offset_, round_up(size_ == 0 ? 1 : size_)); }

std::byte* RegisteredPool::Block::data() const {
  return static_cast<std::byte*>(pool_->base_) + offset_;
}
std::uint32_t RegisteredPool::Block::lkey() const { return pool_->mr_->lkey(); }
std::uint32_t RegisteredPool::Block::rkey() const { return pool_->mr_->rkey(); }

std::shared_ptr<RegisteredPool> RegisteredPool::create(const ProtectionDomain& pd,
                                                       std::size_t bytes) {
  bytes = round_up(bytes == 0 ? kAlign : bytes);
  std::shared_ptr<RegisteredPool> pool(new RegisteredPool(bytes));
  // MAP_POPULATE: fault the pages in now, at start, not on the first transfer.
  pool->base_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (pool->base_ == MAP_FAILED) {
    pool->base_ = nullptr;
    throw_errno("mmap of the verbs pool (" + std::to_string(bytes) + " bytes, memory.host_pool_bytes)");
  }
  pool->mr_ = std::make_unique<MemoryRegion>(pd, pool->base_, bytes, kAccess);
  pool->free_[0] = bytes;
  return pool;
}

RegisteredPool::~RegisteredPool() {
  mr_.reset();  // deregister before unmapping
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

std::unique_ptr<RegisteredPool::Block> RegisteredPool::allocate(std::size_t size) {
  const std::size_t need = round_up(size == 0 ? 1 : size);
  std::lock_guard lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const std::size_t offset = it->first;
    const std::size_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_[offset + need] = rest;
    used_ += need;
    return std::make_unique<Block>(shared_from_this(), offset, size);
  }
  throw Error(Code::resource_exhausted,
              "verbs pool exhausted: " + std::to_string(size) + " bytes wanted, " +
                  std::to_string(used_) + " of " + std::to_string(bytes_) +
                  " in use (raise memory.host_pool_bytes or lower verbs.slots_per_peer / "
                  "verbs.slot_bytes)");
}

void RegisteredPool::release(std::size_t offset, std::size_t size) {
  std::lock_guard lock(mutex_);
  used_ -= size;
  auto [it, inserted] = free_.emplace(offset, size);
  (void)inserted;
  // Coalesce with the following and the preceding free range.
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

std::size_t RegisteredPool::in_use() const {
  std::lock_guard lock(mutex_);
  return used_;
}

std::shared_ptr<MemoryRegion> MrCache::get(void* addr, std::size_t length) {
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t end = begin + length;
  if (end < begin) throw Error(Code::invalid_argument, "buffer range wraps around");
  std::lock_guard lock(mutex_);
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (it->begin <= begin && end <= it->end) {
      ++hits_;
      lru_.splice(lru_.begin(), lru_, it);
      return lru_.front().mr;
    }
  }
  ++misses_;
  auto mr = std::make_shared<MemoryRegion>(pd_, addr, length, kAccess);
  if (capacity_ == 0) return mr;
  lru_.push_front(Entry{begin, end, mr});
  while (lru_.size() > capacity_) lru_.pop_back();
  return mr;
}

void MrCache::invalidate(void* addr, std::size_t length) {
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t end = begin + length;
  std::lock_guard lock(mutex_);
  lru_.remove_if([&](const Entry& e) { return e.begin < end && begin < e.end; });
}

std::uint64_t MrCache::hits() const {
  std::lock_guard lock(mutex_);
  return hits_;
}

std::uint64_t MrCache::misses() const {
  std::lock_guard lock(mutex_);
  return misses_;
}

std::size_t MrCache::size() const {
  std::lock_guard lock(mutex_);
  return lru_.size();
}

}  // namespace collectived::engine::transport::verbs

// A registered memory range of a verbs device (verbs/device.h), the source
// of a pair's writes (verbs/pair.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace collectived::engine::transport::verbs {

class Device;
class Pair;

/// A registered local memory range, usable as a write source (and, for pool
/// memory, as a destination of local copies). Copies share the registration.
class Buffer {
 public:
  Buffer() = default;
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::uint32_t lkey() const { return lkey_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class Device;
  friend class Pair;
  std::shared_ptr<const void> owner_;  // the MR or pool block
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint32_t lkey_ = 0;
};

}  // namespace collectived::engine::transport::verbs

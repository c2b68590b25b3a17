// A range of the daemon's address space holding a client's virtual-memory
// allocations (cuMemCreate), imported from their POSIX file descriptors and
// mapped back to back: one allocation, or the several that one buffer spans
// (PyTorch's expandable segments map chunks, each its own allocation, back
// to back into one reserved range), so that kernels and copies see one base
// pointer + offset, as for any other registration.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/gpu/cuda_driver.h"

namespace collectived::engine::gpu {

/// Owns the reservation and every mapping made in it: the destructor unmaps
/// each piece and frees the range. Those calls may wait for the GPU: the
/// executor drops a range that kernels may have used off its event loop
/// (its graveyard). Calls run in the current context (the executor sets
/// the allocation's GPU first).
class VmmRange {
 public:
  /// Reserves `size` bytes for `pieces` allocations (mapped with map(), in
  /// address order). Throws Error naming the step.
  VmmRange(std::shared_ptr<const CudaDriver> cu, std::uint64_t size,
           std::uint32_t pieces);
  ~VmmRange();
  VmmRange(const VmmRange&) = delete;
  VmmRange& operator=(const VmmRange&) = delete;

  /// Imports the allocation behind `fd` (its handle is released once mapped:
  /// the mapping holds the memory) and maps all `size` bytes of it at
  /// `offset`, which must follow the pieces mapped so far; the last piece
  /// must end the range. Throws Error naming the piece and the step.
  void map(int fd, std::uint64_t offset, std::uint64_t size);
  /// Every piece is mapped.
  bool complete() const { return mapped_.size() == pieces_; }
  /// Grants read and write access over the whole range to the GPUs
  /// `devices` (ordinals; the allocations' own among them). Once complete.
  void set_access(const std::vector<int>& devices);

  cu::DevicePtr base() const { return base_; }
  std::uint64_t size() const { return size_; }
  std::uint32_t pieces() const { return pieces_; }

 private:
  std::shared_ptr<const CudaDriver> cu_;
  cu::DevicePtr base_ = 0;
  std::uint64_t size_ = 0;
  std::uint32_t pieces_ = 0;
  std::uint64_t filled_ = 0;  // bytes mapped from the base
  std::vector<std::pair<std::uint64_t, std::uint64_t>> mapped_;  // offset, bytes of each piece
};

}  // namespace collectived::engine::gpu

// Client virtual-memory allocations mapped back to back (engine/gpu/vmm_range.h).
#include "engine/gpu/vmm_range.h"

#include <string>

#include "ipc/error.h"

namespace collectived::engine::gpu {

VmmRange::VmmRange(std::shared_ptr<const CudaDriver> cu, std::uint64_t size, std::uint32_t pieces)
    : cu_(std::move(cu)), size_(size), pieces_(pieces) {
  if (size == 0 || pieces == 0 || pieces > size) {
    throw Error(Code::invalid_argument, "cuMemCreate memory: " + std::to_string(pieces) +
                                            " pieces of " + std::to_string(size) + " bytes in all");
  }
  cu_->check(cu_->cuMemAddressReserve(&base_, size, 0, 0, 0), "cuMemCreate memory: cuMemAddressReserve");
}

VmmRange::~VmmRange() {
  // Piece by piece, as each was mapped: a range made of several mappings is
  // not unmapped in one call by every driver.
  for (const auto& [at, bytes] : mapped_) cu_->cuMemUnmap(base_ + at, bytes);
  cu_->cuMemAddressFree(base_, size_);
}

void VmmRange::map(int fd, std::uint64_t offset, std::uint64_t size) {
  std::string what = "cuMemCreate memory";
  if (pieces_ > 1) {
    what += ", piece " + std::to_string(mapped_.size() + 1) + " of " + std::to_string(pieces_) +
            " (" + std::to_string(size) + " bytes at offset " + std::to_string(offset) + ")";
  }
  const bool last = mapped_.size() + 1 == pieces_;
  if (mapped_.size() >= pieces_ || offset != filled_ || size == 0 || size > size_ - filled_ ||
      (last && filled_ + size != size_)) {
    throw Error(Code::invalid_argument,
                what + " does not continue the registration: " + std::to_string(mapped_.size()) +
                    " of its " + std::to_string(pieces_) + " pieces fill " + std::to_string(filled_) +
                    " of its " + std::to_string(size_) + " bytes, and the last must end it");
  }
  cu::GenericAllocationHandle h = 0;
  cu_->check(cu_->cuMemImportFromShareableHandle(
                 &h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)), cu::kMemHandleTypePosixFd),
             what + ": cuMemImportFromShareableHandle");
  struct Release {
    const CudaDriver& cu;
    cu::GenericAllocationHandle h;
    ~Release() { cu.cuMemRelease(h); }  // the mapping holds the memory from here
  } release{*cu_, h};
  cu_->check(cu_->cuMemMap(base_ + offset, size, 0, h, 0), what + ": cuMemMap");
  mapped_.emplace_back(offset, size);
  filled_ += size;
}

void VmmRange::set_access(const std::vector<int>& devices) {
  std::vector<cu::MemAccessDesc> access;
  for (int d : devices) access.push_back({{cu::kMemLocationTypeDevice, d}, cu::kMemAccessFlagsProtReadWrite});
  // Once over the whole range, the pieces' mappings together.
  cu_->check(cu_->cuMemSetAccess(base_, size_, access.data(), access.size()),
             "cuMemCreate memory: cuMemSetAccess");
}

}  // namespace collectived::engine::gpu

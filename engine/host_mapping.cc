#include "engine/host_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "ipc/error.h"

namespace collectived::engine {

HostMapping HostMapping::map_memfd(UniqueFd fd, std::uint64_t size) {
  if (!fd) throw Error(Code::invalid_argument, "no descriptor came with the registration");
  if (size == 0) throw Error(Code::invalid_argument, "registration size is 0");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_errno("fstat of the registered descriptor");
  if (!S_ISREG(st.st_mode)) {
    throw Error(Code::invalid_argument,
                "the registered descriptor is not a memfd (not a regular file; create host "
                "buffers with collective_host_alloc or memfd_create)");
  }
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    throw Error(Code::invalid_argument,
                "the registered descriptor is not a memfd (F_GET_SEALS: " +
                    std::string(std::strerror(errno)) + ")");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    throw Error(Code::invalid_argument,
                "the memfd is not sealed against shrinking (F_SEAL_SHRINK): the daemon will "
                "not map memory that can be truncated under it");
  }
  if (static_cast<std::uint64_t>(st.st_size) < size) {
    throw Error(Code::invalid_argument, "the memfd holds " + std::to_string(st.st_size) +
                                            " bytes, fewer than the " + std::to_string(size) +
                                            " registered");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) throw_errno("mmap of " + std::to_string(size) + " registered bytes");
  // The mapping keeps the memory alive; the descriptor is no longer needed.
  return HostMapping(static_cast<std::byte*>(p), size);
}

HostMapping::HostMapping(HostMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      region_(std::move(other.region_)) {}

HostMapping& HostMapping::operator=(HostMapping&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    region_ = std::move(other.region_);
  }
  return *this;
}

HostMapping::~HostMapping() { release(); }

void HostMapping::release() {
  // Registrations of this memory (an HCA's MR) go first: once it is unmapped a
  // new mapping may take its address, and must never be served them.
  region_.reset();
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace collectived::engine

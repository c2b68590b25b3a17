#include "engine/gpu/importer.h"

#include <cstring>

namespace collectived::engine::gpu {
namespace {

// Most allocations one registration of cuMemCreate memory spans (RegisterGpu.
// pieces): 128 GiB of 2 MiB chunks, more than a GPU holds of 20 MiB ones.
constexpr std::uint32_t kMaxVmmPieces = 65536;

}  // namespace

std::shared_ptr<Mapping> Importer::open(std::uint64_t session, GpuRegisterArgs& a, int dev) {
  std::shared_ptr<Mapping> m;
  switch (a.kind) {
    case MemoryKind::legacy_ipc:
      m = open_legacy(a, dev);
      break;
    case MemoryKind::posix_fd:
      m = open_vmm(session, a, dev);
      break;
    case MemoryKind::pool_fd:
      m = open_pool(a, dev);
      break;
    default:
      throw Error(Code::invalid_argument, "unknown GPU memory kind");
  }
  return m;
}

void Importer::count_locked(GpuStatus& s) const {
  for (const auto& [k, w] : legacy_cache_) {
    if (auto m = w.lock()) {
      s.mappings += 1;
      s.mapped_bytes += m->size;
    }
  }
  s.mappings += other_mappings_->load();
}

void Importer::forget_locked(std::uint64_t session) {
  if (auto it = building_.find(session); it != building_.end()) {
    s_.graveyard->bury(std::move(it->second.vmm_building));
    building_.erase(it);
  }
}

std::shared_ptr<Mapping> Importer::open_legacy(const GpuRegisterArgs& a, int dev) {
  if (a.handle.size() != cu::kIpcHandleSize) {
    throw Error(Code::invalid_argument,
                "cudaMalloc memory: IPC handle of " + std::to_string(a.handle.size()) + " bytes");
  }
  {
    std::lock_guard lock(s_.mu);
    if (auto m = legacy_cache_[a.handle].lock()) {
      if (m->size < a.size) {
        throw Error(Code::invalid_argument, "cudaMalloc memory: registered size " +
                                                std::to_string(a.size) + " exceeds the allocation");
      }
      return m;
    }
  }
  // Opened outside the lock (it may wait for the GPU). Registrations come
  // from the event loop one at a time, so nobody opens the same handle meanwhile.
  auto m = std::make_shared<LegacyIpcMapping>();
  std::memcpy(&m->handle, a.handle.data(), sizeof m->handle);
  m->size = a.size;
  m->device = dev;
  m->open_first();
  std::lock_guard lock(s_.mu);
  legacy_cache_[a.handle] = m;
  // Drop cache entries of closed mappings now and then.
  if (legacy_cache_.size() > 1024) {
    for (auto it = legacy_cache_.begin(); it != legacy_cache_.end();) {
      it = it->second.expired() ? legacy_cache_.erase(it) : std::next(it);
    }
  }
  return m;
}

std::shared_ptr<Mapping> Importer::open_vmm(std::uint64_t session, GpuRegisterArgs& a, int dev) {
  cudaSetDevice(dev);
  std::shared_ptr<VmmRange> range;
  int range_dev = -1;
  if (a.piece_count == 0) {
    if (!a.fd)
      throw Error(Code::invalid_argument, "cuMemCreate memory: no descriptor came with it");
    range = std::make_shared<VmmRange>(s_.cu, a.size, 1);
    range->map(a.fd.get(), 0, a.size);
  } else {
    {
      std::lock_guard lock(s_.mu);
      if (auto it = building_.find(session); it != building_.end()) {
        range = std::move(it->second.vmm_building);
        range_dev = it->second.vmm_device;
      }
    }
    if (a.pieces.empty()) {
      s_.graveyard->bury(std::move(range));
      throw Error(Code::invalid_argument,
                  "cuMemCreate memory: a request of several pieces with none");
    }
    if (a.pieces.front().offset == 0) {
      // A new registration (one left unfinished is dropped).
      s_.graveyard->bury(std::move(range));
      if (a.piece_count > kMaxVmmPieces) {
        throw Error(Code::invalid_argument, "cuMemCreate memory: " + std::to_string(a.piece_count) +
                                                " pieces (at most " +
                                                std::to_string(kMaxVmmPieces) + ")");
      }
      range = std::make_shared<VmmRange>(s_.cu, a.size, a.piece_count);
    } else if (!range || range->size() != a.size || range->pieces() != a.piece_count ||
               range_dev != dev) {
      s_.graveyard->bury(std::move(range));
      throw Error(Code::invalid_argument,
                  "cuMemCreate memory: pieces from offset " +
                      std::to_string(a.pieces.front().offset) +
                      " continue no registration of this client in progress");
    }
    try {
      for (auto& p : a.pieces) range->map(p.fd.get(), p.offset, p.size);
    } catch (const Error&) {
      s_.graveyard->bury(std::move(range));
      throw;
    }
    if (!range->complete()) {
      std::lock_guard lock(s_.mu);
      Building& s = building_[session];
      s.vmm_building = std::move(range);
      s.vmm_device = dev;
      return nullptr;
    }
  }
  std::vector<int> access;
  for (const auto& d : s_.devices.all()) {
    int can = d.ordinal == dev;
    if (!can) cudaDeviceCanAccessPeer(&can, d.ordinal, dev);
    if (can) access.push_back(d.ordinal);
  }
  range->set_access(access);
  auto m = std::make_shared<VmmMapping>(std::move(range));
  m->device = dev;
  *other_mappings_ += 1;
  m->counter = other_mappings_;
  return m;
}

std::shared_ptr<Mapping> Importer::open_pool(GpuRegisterArgs& a, int dev) {
  if (!a.fd)
    throw Error(Code::invalid_argument, "cudaMallocAsync memory: no pool descriptor came with it");
  if (a.handle.size() != sizeof(cu::MemPoolPtrExportData)) {
    throw Error(Code::invalid_argument, "cudaMallocAsync memory: pointer export data of " +
                                            std::to_string(a.handle.size()) + " bytes");
  }
  cudaSetDevice(dev);
  auto m = std::make_shared<PoolMapping>(s_.cu);
  m->device = dev;
  m->size = a.size;
  s_.cu->check(s_.cu->cuMemPoolImportFromShareableHandle(
                   &m->pool, reinterpret_cast<void*>(static_cast<std::intptr_t>(a.fd.get())),
                   cu::kMemHandleTypePosixFd, 0),
               "cudaMallocAsync memory: cuMemPoolImportFromShareableHandle");
  cu::MemPoolPtrExportData data;
  std::memcpy(&data, a.handle.data(), sizeof data);
  // An imported pool's memory is reachable from its own GPU only until
  // access is granted: the other GPUs' kernels read and write it over
  // NVLink (split operations). Without this a kernel of the other GPU hits
  // unmapped memory and the operation never completes.
  for (const auto& d : s_.devices.all()) {
    const int other = d.ordinal;
    if (other == dev) continue;
    cu::MemAccessDesc acc{};
    acc.location = {cu::kMemLocationTypeDevice, other};
    acc.flags = cu::kMemAccessFlagsProtReadWrite;
    s_.cu->check(s_.cu->cuMemPoolSetAccess(m->pool, &acc, 1),
                 "cudaMallocAsync memory: cuMemPoolSetAccess for GPU " + std::to_string(other));
  }
  cu::DevicePtr p = 0;
  s_.cu->check(s_.cu->cuMemPoolImportPointer(&p, m->pool, &data),
               "cudaMallocAsync memory: cuMemPoolImportPointer");
  m->ptr = reinterpret_cast<std::byte*>(p);
  *other_mappings_ += 1;
  m->counter = other_mappings_;
  return m;
}

}  // namespace collectived::engine::gpu

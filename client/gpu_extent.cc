// The allocations under a GPU buffer (client/gpu_extent.h).
#include "client/gpu_extent.h"

#include <cstdio>

#include "ipc/error.h"

namespace collectived::client {

namespace cu = gpu::cu;
using gpu::CudaDriver;

namespace {

std::string ptr_text(cu::DevicePtr p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(p));
  return buf;
}

/// Empty for virtual-memory memory (cuMemCreate) at `at`, the start of its
/// mapping; otherwise what it is. Pool memory is asked first: a pool's
/// memory is virtual memory inside, but it is exported as the pool's.
std::string non_vmm_kind(const CudaDriver& cu, cu::DevicePtr at, const std::string& where) {
  void* pool = nullptr;
  cu.check(cu.cuPointerGetAttribute(&pool, cu::kPointerAttributeMempoolHandle, at), where + ": memory pool");
  if (pool != nullptr) return "stream-ordered pool memory (cudaMallocAsync)";
  int legacy = 0;
  cu.check(cu.cuPointerGetAttribute(&legacy, cu::kPointerAttributeIsLegacyIpcCapable, at),
           where + ": IPC capability");
  if (legacy != 0) return "cudaMalloc memory";
  cu::GenericAllocationHandle h = 0;
  const cu::Result r = cu.cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(at));
  if (r != cu::kSuccess) {
    return "memory that is no virtual-memory allocation (cuMemRetainAllocationHandle: " +
           cu.error_text(r) + ")";
  }
  cu.cuMemRelease(h);  // only asked: the retained reference goes at once
  return {};
}

int device_ordinal(const CudaDriver& cu, cu::DevicePtr at, const std::string& where) {
  int ordinal = 0;
  cu.check(cu.cuPointerGetAttribute(&ordinal, cu::kPointerAttributeDeviceOrdinal, at), where + ": device ordinal");
  return ordinal;
}

std::uint64_t buffer_id(const CudaDriver& cu, cu::DevicePtr at, const std::string& where) {
  std::uint64_t id = 0;
  cu.check(cu.cuPointerGetAttribute(&id, cu::kPointerAttributeBufferId, at), where + ": buffer id");
  return id;
}

}  // namespace

GpuExtent gpu_extent(const CudaDriver& cu, cu::DevicePtr p, std::uint64_t bytes, const char* which) {
  const std::string buf = std::string(which) + " buffer " + ptr_text(p);
  GpuExtent e;
  std::size_t size = 0;
  cu.check(cu.cuMemGetAddressRange(&e.base, &size, p), buf + ": cuMemGetAddressRange");
  e.size = size;
  e.pieces.push_back({0, size, buffer_id(cu, p, buf)});
  const cu::DevicePtr end = p + bytes;
  if (end <= e.base + e.size) return e;  // the usual case: one allocation

  // Past the end of its allocation: only virtual-memory allocations mapped
  // back to back (PyTorch's expandable segments) may be spanned, and only
  // where the buffer's own allocation is one.
  const std::string whole = buf + " + " + std::to_string(bytes) + " bytes";
  const std::string first = non_vmm_kind(cu, e.base, buf);
  if (!first.empty()) {
    throw Error(Code::invalid_argument,
                whole + " runs past the end of its allocation (" + first + ", " + ptr_text(e.base) +
                    " + " + std::to_string(e.size) + " bytes); only virtual-memory allocations "
                    "(cuMemCreate) mapped back to back may be spanned by one buffer");
  }
  const int device = device_ordinal(cu, p, buf);
  while (e.base + e.size < end) {
    const cu::DevicePtr next = e.base + e.size;
    const std::string at = whole + " continues at " + ptr_text(next) + " (" +
                           std::to_string(next - p) + " bytes into it)";
    unsigned type = 0;
    cu::DevicePtr b = 0;
    std::size_t s = 0;
    if (cu.cuPointerGetAttribute(&type, cu::kPointerAttributeMemoryType, next) != cu::kSuccess ||
        type != cu::kMemoryTypeDevice || cu.cuMemGetAddressRange(&b, &s, next) != cu::kSuccess ||
        b != next || s == 0) {
      throw Error(Code::invalid_argument,
                  whole + " runs past the end of mapped GPU memory: its allocations end at " +
                      ptr_text(next) + " (" + std::to_string(next - p) +
                      " bytes into it), and no GPU allocation is mapped there");
    }
    const std::string kind = non_vmm_kind(cu, next, at);
    if (!kind.empty()) {
      throw Error(Code::invalid_argument, at + " into " + kind + ", another allocation: only "
                                          "virtual-memory allocations (cuMemCreate) mapped back "
                                          "to back may be spanned by one buffer");
    }
    const int there = device_ordinal(cu, next, at);
    if (there != device) {
      throw Error(Code::invalid_argument, at + " onto GPU " + std::to_string(there) +
                                              " (it starts on GPU " + std::to_string(device) + ")");
    }
    e.pieces.push_back({e.size, s, buffer_id(cu, next, at)});
    e.size += s;
  }
  return e;
}

bool gpu_pieces_current(const CudaDriver& cu, const std::vector<GpuPiece>& registered,
                        const GpuExtent& now) {
  if (registered.size() < now.pieces.size()) return false;
  for (std::size_t i = 0; i < registered.size(); ++i) {
    const GpuPiece& r = registered[i];
    if (i < now.pieces.size()) {
      if (!(r == now.pieces[i])) return false;
      continue;
    }
    // Past the buffer: the registration holds this memory in the daemon, so
    // it must still be what is mapped there (else it goes, and the daemon
    // lets the freed memory go).
    const cu::DevicePtr at = now.base + r.offset;
    cu::DevicePtr b = 0;
    std::size_t s = 0;
    std::uint64_t id = 0;
    if (cu.cuMemGetAddressRange(&b, &s, at) != cu::kSuccess || b != at || s != r.size ||
        cu.cuPointerGetAttribute(&id, cu::kPointerAttributeBufferId, at) != cu::kSuccess ||
        id != r.buffer_id) {
      return false;
    }
  }
  return true;
}

UniqueFd export_vmm_fd(const CudaDriver& cu, cu::DevicePtr at, const std::string& where) {
  cu::GenericAllocationHandle h = 0;
  cu.check(cu.cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(at)),
           where + " is neither cudaMalloc nor pool memory; cuMemRetainAllocationHandle");
  int raw = -1;
  const cu::Result e = cu.cuMemExportToShareableHandle(&raw, h, cu::kMemHandleTypePosixFd, 0);
  cu.cuMemRelease(h);  // only retained to export it: the caller's mapping holds the memory
  if (e != cu::kSuccess) {
    throw Error(Code::invalid_argument,
                where + " is a virtual-memory allocation (cuMemCreate) that cannot be exported as a "
                        "file descriptor (" + cu.error_text(e) + "): create it with "
                        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes");
  }
  return UniqueFd(raw);
}

}  // namespace collectived::client

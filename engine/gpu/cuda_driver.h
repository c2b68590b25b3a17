// The CUDA driver API, reached at run time: dlopen("libcuda.so.1") and every
// entry point resolved through cuGetProcAddress, so that binaries built here
// start on machines without a GPU or driver (CI) and say so themselves.
//
// The few driver types used are declared here (namespace cu), with the values
// of CUDA 12/13's cuda.h: libcollective then builds without a CUDA toolkit.
// tests/gpu/cuda_abi_test.cc checks every value against cuda.h where one is
// installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

namespace collectived::engine::gpu {

namespace cu {
using Result = int;  // CUresult
using Device = int;  // CUdevice
using DevicePtr = std::uint64_t;  // CUdeviceptr
using Context = struct CtxOpaque*;
using Stream = struct StreamOpaque*;
using Event = struct EventOpaque*;
using MemPool = struct MemPoolOpaque*;
using Module = struct ModuleOpaque*;
using Function = struct FunctionOpaque*;
using GenericAllocationHandle = std::uint64_t;

inline constexpr Result kSuccess = 0;
inline constexpr Result kErrorNotInitialized = 3;
inline constexpr Result kErrorNoDevice = 100;
inline constexpr Result kErrorNotReady = 600;
inline constexpr Result kErrorNotSupported = 801;

inline constexpr std::size_t kIpcHandleSize = 64;
struct IpcMemHandle { unsigned char data[kIpcHandleSize]; };
struct IpcEventHandle { char reserved[kIpcHandleSize]; };
struct MemPoolPtrExportData { unsigned char reserved[64]; };
struct Uuid { char bytes[16]; };

// CUpointer_attribute
inline constexpr int kPointerAttributeContext = 1;
inline constexpr int kPointerAttributeMemoryType = 2;
inline constexpr int kPointerAttributeBufferId = 7;
inline constexpr int kPointerAttributeDeviceOrdinal = 9;
inline constexpr int kPointerAttributeIsLegacyIpcCapable = 10;
inline constexpr int kPointerAttributeAllowedHandleTypes = 14;
inline constexpr int kPointerAttributeMempoolHandle = 17;
// CUmemorytype
inline constexpr unsigned kMemoryTypeHost = 1;
inline constexpr unsigned kMemoryTypeDevice = 2;
// CUevent_flags
inline constexpr unsigned kEventDisableTiming = 0x2;
inline constexpr unsigned kEventInterprocess = 0x4;
// CUstreamWaitValue_flags / CUstreamWriteValue_flags
inline constexpr unsigned kStreamWaitValueGeq = 0x0;
inline constexpr unsigned kStreamWriteValueDefault = 0x0;
// cuMemHostAlloc flags
inline constexpr unsigned kMemHostAllocPortable = 0x1;
inline constexpr unsigned kMemHostAllocDeviceMap = 0x2;
// cuMemHostRegister flags
inline constexpr unsigned kMemHostRegisterPortable = 0x1;
inline constexpr unsigned kMemHostRegisterDeviceMap = 0x2;
// CUipcMem_flags
inline constexpr unsigned kIpcMemLazyEnablePeerAccess = 0x1;
// CUmemAllocationHandleType, CUmemLocationType, CUmemAllocationType, CUmemAccess_flags
inline constexpr int kMemHandleTypePosixFd = 0x1;
inline constexpr int kMemLocationTypeDevice = 0x1;
inline constexpr int kMemAllocationTypePinned = 0x1;
inline constexpr int kMemAccessFlagsProtReadWrite = 0x3;
inline constexpr int kMemAllocGranularityMinimum = 0x0;

struct MemLocation {
  int type;
  int id;
};
struct MemAllocationProp {
  int type;
  int requestedHandleTypes;
  MemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct MemAccessDesc {
  MemLocation location;
  int flags;
};
/// CUmemPoolProps: 88 bytes in every CUDA 12 and 13 header (the fields after
/// win32SecurityAttributes, maxSize and usage, came out of its reserved bytes).
struct MemPoolProps {
  int allocType;
  int handleTypes;
  MemLocation location;
  void* win32SecurityAttributes;
  std::size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
};
static_assert(sizeof(MemPoolProps) == 88);
}  // namespace cu

/// The driver entry points collectived uses. One object, loaded once by whoever
/// needs it (the daemon's GPU runtime, libcollective's GPU state) and passed down.
class CudaDriver {
 public:
  /// Loads libcuda.so.1 and resolves every entry point below. Throws
  /// Error(unavailable) naming the library and each missing symbol, or saying
  /// "no GPU" when the driver is absent.
  static std::unique_ptr<CudaDriver> load();

  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  /// Throws Error(system or unavailable) "<what>: CUDA_ERROR_... (text)" unless r == success.
  void check(cu::Result r, const std::string& what) const;
  /// "CUDA_ERROR_INVALID_VALUE (invalid argument)".
  std::string error_text(cu::Result r) const;
  int driver_version() const { return driver_version_; }

#define COLLECTIVED_CU_FUNCTIONS(X)                                                           \
  X(cuGetErrorName, cu::Result (*)(cu::Result, const char**))                                 \
  X(cuGetErrorString, cu::Result (*)(cu::Result, const char**))                               \
  X(cuInit, cu::Result (*)(unsigned))                                                         \
  X(cuDriverGetVersion, cu::Result (*)(int*))                                                 \
  X(cuDeviceGetCount, cu::Result (*)(int*))                                                   \
  X(cuDeviceGet, cu::Result (*)(cu::Device*, int))                                            \
  X(cuDeviceGetUuid, cu::Result (*)(cu::Uuid*, cu::Device))                                  \
  X(cuCtxGetCurrent, cu::Result (*)(cu::Context*))                                            \
  X(cuCtxPushCurrent, cu::Result (*)(cu::Context))                                            \
  X(cuCtxPopCurrent, cu::Result (*)(cu::Context*))                                            \
  X(cuCtxGetDevice, cu::Result (*)(cu::Device*))                                              \
  X(cuStreamGetCtx, cu::Result (*)(cu::Stream, cu::Context*))                                 \
  X(cuStreamSynchronize, cu::Result (*)(cu::Stream))                                          \
  X(cuPointerGetAttribute, cu::Result (*)(void*, int, cu::DevicePtr))                         \
  X(cuMemGetAddressRange, cu::Result (*)(cu::DevicePtr*, std::size_t*, cu::DevicePtr))       \
  X(cuIpcGetMemHandle, cu::Result (*)(cu::IpcMemHandle*, cu::DevicePtr))                      \
  X(cuIpcOpenMemHandle, cu::Result (*)(cu::DevicePtr*, cu::IpcMemHandle, unsigned))           \
  X(cuIpcCloseMemHandle, cu::Result (*)(cu::DevicePtr))                                       \
  X(cuIpcGetEventHandle, cu::Result (*)(cu::IpcEventHandle*, cu::Event))                      \
  X(cuIpcOpenEventHandle, cu::Result (*)(cu::Event*, cu::IpcEventHandle))                     \
  X(cuEventCreate, cu::Result (*)(cu::Event*, unsigned))                                      \
  X(cuEventRecord, cu::Result (*)(cu::Event, cu::Stream))                                     \
  X(cuEventQuery, cu::Result (*)(cu::Event))                                                  \
  X(cuEventDestroy, cu::Result (*)(cu::Event))                                                \
  X(cuStreamWaitEvent, cu::Result (*)(cu::Stream, cu::Event, unsigned))                       \
  X(cuStreamWaitValue32, cu::Result (*)(cu::Stream, cu::DevicePtr, std::uint32_t, unsigned))  \
  X(cuStreamWriteValue32, cu::Result (*)(cu::Stream, cu::DevicePtr, std::uint32_t, unsigned)) \
  X(cuMemHostRegister, cu::Result (*)(void*, std::size_t, unsigned))                          \
  X(cuMemHostUnregister, cu::Result (*)(void*))                                               \
  X(cuMemHostGetDevicePointer, cu::Result (*)(cu::DevicePtr*, void*, unsigned))              \
  X(cuMemRetainAllocationHandle, cu::Result (*)(cu::GenericAllocationHandle*, void*))         \
  X(cuMemExportToShareableHandle,                                                             \
    cu::Result (*)(void*, cu::GenericAllocationHandle, int, unsigned long long))              \
  X(cuMemImportFromShareableHandle, cu::Result (*)(cu::GenericAllocationHandle*, void*, int)) \
  X(cuMemGetAllocationPropertiesFromHandle,                                                   \
    cu::Result (*)(cu::MemAllocationProp*, cu::GenericAllocationHandle))                      \
  X(cuMemGetAllocationGranularity, cu::Result (*)(std::size_t*, const cu::MemAllocationProp*, int)) \
  X(cuMemAddressReserve,                                                                      \
    cu::Result (*)(cu::DevicePtr*, std::size_t, std::size_t, cu::DevicePtr, unsigned long long)) \
  X(cuMemAddressFree, cu::Result (*)(cu::DevicePtr, std::size_t))                             \
  X(cuMemMap, cu::Result (*)(cu::DevicePtr, std::size_t, std::size_t,                         \
                             cu::GenericAllocationHandle, unsigned long long))                \
  X(cuMemUnmap, cu::Result (*)(cu::DevicePtr, std::size_t))                                   \
  X(cuMemSetAccess, cu::Result (*)(cu::DevicePtr, std::size_t, const cu::MemAccessDesc*,     \
                                   std::size_t))                                              \
  X(cuMemRelease, cu::Result (*)(cu::GenericAllocationHandle))                                \
  X(cuMemPoolExportToShareableHandle, cu::Result (*)(void*, cu::MemPool, int, unsigned long long)) \
  X(cuMemPoolImportFromShareableHandle, cu::Result (*)(cu::MemPool*, void*, int, unsigned long long)) \
  X(cuMemPoolExportPointer, cu::Result (*)(cu::MemPoolPtrExportData*, cu::DevicePtr))       \
  X(cuMemPoolImportPointer, cu::Result (*)(cu::DevicePtr*, cu::MemPool, cu::MemPoolPtrExportData*)) \
  X(cuMemPoolDestroy, cu::Result (*)(cu::MemPool))                                            \
  X(cuMemPoolSetAccess, cu::Result (*)(cu::MemPool, const cu::MemAccessDesc*, std::size_t))   \
  X(cuMemFree, cu::Result (*)(cu::DevicePtr))                                                \
  /* libcollective's own kernels (client/direct.cc): */                                     \
  X(cuModuleLoadData, cu::Result (*)(cu::Module*, const void*))                               \
  X(cuModuleUnload, cu::Result (*)(cu::Module))                                               \
  X(cuModuleGetFunction, cu::Result (*)(cu::Function*, cu::Module, const char*))             \
  X(cuLaunchKernel, cu::Result (*)(cu::Function, unsigned, unsigned, unsigned, unsigned,     \
                                   unsigned, unsigned, unsigned, cu::Stream, void**, void**)) \
  X(cuMemHostAlloc, cu::Result (*)(void**, std::size_t, unsigned))                           \
  /* staging by the client across nodes (client/staging.cc): */                              \
  X(cuMemcpyDtoHAsync, cu::Result (*)(void*, cu::DevicePtr, std::size_t, cu::Stream))         \
  X(cuMemcpyHtoDAsync, cu::Result (*)(cu::DevicePtr, const void*, std::size_t, cu::Stream))   \
  X(cuMemcpyDtoDAsync, cu::Result (*)(cu::DevicePtr, cu::DevicePtr, std::size_t, cu::Stream))  \
  X(cuMemFreeHost, cu::Result (*)(void*))                                                     \
  /* Used by tools and tests (collective-perf -g, tests/gpu): */                             \
  X(cuMemAlloc, cu::Result (*)(cu::DevicePtr*, std::size_t))                                  \
  X(cuMemcpyHtoD, cu::Result (*)(cu::DevicePtr, const void*, std::size_t))                   \
  X(cuMemcpyDtoH, cu::Result (*)(void*, cu::DevicePtr, std::size_t))                         \
  X(cuMemsetD8, cu::Result (*)(cu::DevicePtr, unsigned char, std::size_t))                   \
  X(cuMemsetD32, cu::Result (*)(cu::DevicePtr, unsigned, std::size_t))                       \
  X(cuMemsetD32Async, cu::Result (*)(cu::DevicePtr, unsigned, std::size_t, cu::Stream))      \
  X(cuMemAllocAsync, cu::Result (*)(cu::DevicePtr*, std::size_t, cu::Stream))                 \
  X(cuMemPoolCreate, cu::Result (*)(cu::MemPool*, const cu::MemPoolProps*))                   \
  X(cuMemAllocFromPoolAsync, cu::Result (*)(cu::DevicePtr*, std::size_t, cu::MemPool, cu::Stream)) \
  X(cuDevicePrimaryCtxRetain, cu::Result (*)(cu::Context*, cu::Device))                       \
  X(cuCtxSetCurrent, cu::Result (*)(cu::Context))                                             \
  X(cuStreamCreate, cu::Result (*)(cu::Stream*, unsigned))                                    \
  X(cuStreamDestroy, cu::Result (*)(cu::Stream))                                              \
  X(cuEventSynchronize, cu::Result (*)(cu::Event))                                            \
  X(cuEventElapsedTime, cu::Result (*)(float*, cu::Event, cu::Event))                         \
  X(cuMemCreate, cu::Result (*)(cu::GenericAllocationHandle*, std::size_t,                    \
                                const cu::MemAllocationProp*, unsigned long long))

#define COLLECTIVED_CU_MEMBER(name, type) std::type_identity_t<type> name = nullptr;
  COLLECTIVED_CU_FUNCTIONS(COLLECTIVED_CU_MEMBER)
#undef COLLECTIVED_CU_MEMBER

 private:
  CudaDriver() = default;
  void* library_ = nullptr;
  int driver_version_ = 0;
};

/// A GPU's UUID as nvidia-smi and CUDA_VISIBLE_DEVICES write it, "GPU-" and
/// 32 hex digits grouped 8-4-4-4-12, e.g. "GPU-eb896ada-3489-2700-9f63-edaa9adbb28a".
/// `bytes`: the 16 bytes of cu::Uuid.
std::string uuid_text(const void* bytes);

/// Pushes `ctx` as the calling thread's current context for a scope.
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& cu, cu::Context ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaDriver& cu_;
  bool pushed_ = false;
};

}  // namespace collectived::engine::gpu

// engine/gpu/cuda_driver.h declares the driver's types and values itself (so
// libcollective builds without a CUDA toolkit); this compares every one with
// the toolkit's cuda.h where one is installed. A mismatch fails the build.
#include <cuda.h>

#include <cstddef>

#include "engine/gpu/cuda_driver.h"

namespace cu = collectived::engine::gpu::cu;

static_assert(cu::kSuccess == CUDA_SUCCESS);
static_assert(cu::kErrorNotInitialized == CUDA_ERROR_NOT_INITIALIZED);
static_assert(cu::kErrorNoDevice == CUDA_ERROR_NO_DEVICE);
static_assert(cu::kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(cu::kErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED);
static_assert(cu::kIpcHandleSize == CU_IPC_HANDLE_SIZE);
static_assert(sizeof(cu::IpcMemHandle) == sizeof(CUipcMemHandle));
static_assert(sizeof(cu::IpcEventHandle) == sizeof(CUipcEventHandle));
static_assert(sizeof(cu::MemPoolPtrExportData) == sizeof(CUmemPoolPtrExportData));
static_assert(sizeof(cu::Uuid) == sizeof(CUuuid));
static_assert(sizeof(cu::DevicePtr) == sizeof(CUdeviceptr));
static_assert(cu::kPointerAttributeContext == CU_POINTER_ATTRIBUTE_CONTEXT);
static_assert(cu::kPointerAttributeMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(cu::kPointerAttributeBufferId == CU_POINTER_ATTRIBUTE_BUFFER_ID);
static_assert(cu::kPointerAttributeDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(cu::kPointerAttributeIsLegacyIpcCapable == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE);
static_assert(cu::kPointerAttributeAllowedHandleTypes == CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES);
static_assert(cu::kPointerAttributeMempoolHandle == CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE);
static_assert(cu::kMemoryTypeHost == CU_MEMORYTYPE_HOST);
static_assert(cu::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);
static_assert(cu::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(cu::kEventInterprocess == CU_EVENT_INTERPROCESS);
static_assert(cu::kStreamWaitValueGeq == CU_STREAM_WAIT_VALUE_GEQ);
static_assert(cu::kStreamWriteValueDefault == CU_STREAM_WRITE_VALUE_DEFAULT);
static_assert(cu::kMemHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(cu::kMemHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(cu::kMemHostRegisterPortable == CU_MEMHOSTREGISTER_PORTABLE);
static_assert(cu::kMemHostRegisterDeviceMap == CU_MEMHOSTREGISTER_DEVICEMAP);
static_assert(cu::kIpcMemLazyEnablePeerAccess == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
static_assert(cu::kMemHandleTypePosixFd == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
static_assert(cu::kMemLocationTypeDevice == CU_MEM_LOCATION_TYPE_DEVICE);
static_assert(cu::kMemAllocationTypePinned == CU_MEM_ALLOCATION_TYPE_PINNED);
static_assert(cu::kMemAccessFlagsProtReadWrite == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
static_assert(cu::kMemAllocGranularityMinimum == CU_MEM_ALLOC_GRANULARITY_MINIMUM);
static_assert(sizeof(cu::MemLocation) == sizeof(CUmemLocation));
static_assert(sizeof(cu::MemAllocationProp) == sizeof(CUmemAllocationProp));
static_assert(sizeof(cu::MemAccessDesc) == sizeof(CUmemAccessDesc));
static_assert(sizeof(cu::MemPoolProps) == sizeof(CUmemPoolProps));
static_assert(offsetof(cu::MemPoolProps, location) == offsetof(CUmemPoolProps, location));
static_assert(offsetof(cu::MemPoolProps, maxSize) == offsetof(CUmemPoolProps, maxSize));
static_assert(offsetof(cu::MemAllocationProp, allocFlags) == offsetof(CUmemAllocationProp, allocFlags));

int main() { return 0; }

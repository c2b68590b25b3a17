#include "engine/gpu/cuda_driver.h"

#include <dlfcn.h>

#include <vector>

#include "ipc/error.h"

namespace collectived::engine::gpu {

namespace {
// Entry points are asked for with the semantics of this CUDA version: the
// driver then hands out the versions cuda.h 12.0 names (cuMemGetAddressRange_v2,
// cuStreamWaitValue32_v2, ...), whatever driver is installed.
constexpr int kApiVersion = 12000;
using GetProcAddressV2 = cu::Result (*)(const char*, void**, int, std::uint64_t, int*);
using GetProcAddressV1 = cu::Result (*)(const char*, void**, int, std::uint64_t);
}  // namespace

std::unique_ptr<CudaDriver> CudaDriver::load() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    throw Error(Code::unavailable, std::string("no GPU: the CUDA driver (libcuda.so.1) is not "
                                               "installed or cannot be loaded (") +
                                       (e ? e : "dlopen failed") + ")");
  }
  std::unique_ptr<CudaDriver> d(new CudaDriver);
  d->library_ = lib;
  auto v2 = reinterpret_cast<GetProcAddressV2>(::dlsym(lib, "cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(::dlsym(lib, "cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    throw Error(Code::unavailable,
                "the CUDA driver libcuda.so.1 is too old: it has no cuGetProcAddress "
                "(collectived needs a driver for CUDA 12.0 or newer)");
  }
  std::vector<std::string> missing;
  auto resolve = [&](const char* name, void** out) {
    cu::Result r = 0;
    if (v2 != nullptr) {
      int status = 0;
      r = v2(name, out, kApiVersion, 0, &status);
    } else {
      r = v1(name, out, kApiVersion, 0);
    }
    if (r != cu::kSuccess || *out == nullptr) {
      *out = nullptr;
      missing.emplace_back(name);
    }
  };
#define COLLECTIVED_CU_RESOLVE(name, type) resolve(#name, reinterpret_cast<void**>(&d->name));
  COLLECTIVED_CU_FUNCTIONS(COLLECTIVED_CU_RESOLVE)
#undef COLLECTIVED_CU_RESOLVE
  if (d->cuDriverGetVersion != nullptr) d->cuDriverGetVersion(&d->driver_version_);
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    throw Error(Code::unavailable,
                "the CUDA driver libcuda.so.1 (driver API version " +
                    std::to_string(d->driver_version_) + ") lacks entry points collectived "
                    "needs: " + names + " (a driver for CUDA 12.0 or newer is required)");
  }
  const cu::Result r = d->cuInit(0);
  if (r == cu::kErrorNoDevice) {
    throw Error(Code::unavailable, "no GPU: the CUDA driver is installed but sees no device");
  }
  d->check(r, "cuInit");
  return d;
}

CudaDriver::~CudaDriver() {
  // The library stays loaded: the CUDA runtime and other users may hold
  // pointers into it, and unloading a driver at exit is a known source of
  // crashes. dlclose is deliberately not called.
}

std::string CudaDriver::error_text(cu::Result r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName != nullptr) cuGetErrorName(r, &name);
  if (cuGetErrorString != nullptr) cuGetErrorString(r, &text);
  std::string s = name ? name : "CUDA error " + std::to_string(r);
  if (text != nullptr) s += std::string(" (") + text + ")";
  return s;
}

void CudaDriver::check(cu::Result r, const std::string& what) const {
  if (r == cu::kSuccess) return;
  const Code code = r == cu::kErrorNoDevice ? Code::unavailable
                    : r == cu::kErrorNotSupported ? Code::invalid_argument
                                                  : Code::system;
  throw Error(code, what + ": " + error_text(r));
}

std::string uuid_text(const void* bytes) {
  static const char* digits = "0123456789abcdef";
  const auto* u = static_cast<const unsigned char*>(bytes);
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += digits[u[i] >> 4];
    out += digits[u[i] & 15];
  }
  return out;
}

ScopedContext::ScopedContext(const CudaDriver& cu, cu::Context ctx) : cu_(cu) {
  if (ctx != nullptr) {
    cu_.check(cu_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
    pushed_ = true;
  }
}

ScopedContext::~ScopedContext() {
  if (pushed_) {
    cu::Context ignored = nullptr;
    cu_.cuCtxPopCurrent(&ignored);
  }
}

}  // namespace collectived::engine::gpu

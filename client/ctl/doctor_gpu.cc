// doctor: the CUDA driver, the GPUs, peer access between them and CUDA IPC
// between two processes; GPUDirect RDMA (peer-memory module or dma-buf) and
// GPU Direct Storage (libcufile, nvidia-fs).
//
// The driver is reached with dlopen, never linked, so doctor runs on nodes
// without one. The few driver types are declared here with cuda.h's values.
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "client/ctl/doctor.h"
#include "engine/transport/verbs/gpudirect.h"

namespace collectived::client::ctl {

namespace {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
struct CUipcMemHandle {
  char reserved[64];
};
constexpr int kAttrGpuDirectRdma = 116;   // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED
constexpr int kAttrDmaBuf = 124;          // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
constexpr CUresult kNoDevice = 100;       // CUDA_ERROR_NO_DEVICE
constexpr unsigned kLazyEnablePeerAccess = 1;

/// The driver entry points doctor calls.
struct Cuda {
  void* lib = nullptr;
  std::string missing;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetPCIBusId)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceCanAccessPeer)(int*, CUdevice, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, std::size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, std::size_t) = nullptr;
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, std::size_t) = nullptr;
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned) = nullptr;
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr) = nullptr;

  template <typename F>
  void get(F& fn, const char* name, const char* fallback = nullptr) {
    void* p = ::dlsym(lib, name);
    if (p == nullptr && fallback != nullptr) p = ::dlsym(lib, fallback);
    if (p == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
    fn = reinterpret_cast<F>(p);
  }

  /// dlopen and resolve; "" on success, else why not.
  std::string load() {
    lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = ::dlerror();
      return e ? e : "dlopen failed";
    }
    get(cuGetErrorName, "cuGetErrorName");
    get(cuInit, "cuInit");
    get(cuDriverGetVersion, "cuDriverGetVersion");
    get(cuDeviceGetCount, "cuDeviceGetCount");
    get(cuDeviceGet, "cuDeviceGet");
    get(cuDeviceGetName, "cuDeviceGetName");
    get(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    get(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
    get(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    get(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    get(cuCtxSetCurrent, "cuCtxSetCurrent");
    get(cuCtxSynchronize, "cuCtxSynchronize");
    get(cuMemAlloc, "cuMemAlloc_v2");
    get(cuMemFree, "cuMemFree_v2");
    get(cuMemsetD8, "cuMemsetD8_v2");
    get(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    get(cuIpcGetMemHandle, "cuIpcGetMemHandle");
    get(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
    get(cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    return "";
  }

  std::string err(CUresult r) const {
    const char* name = nullptr;
    if (cuGetErrorName == nullptr || cuGetErrorName(r, &name) != 0 || name == nullptr) {
      return "CUresult " + std::to_string(r);
    }
    return std::string(name) + " (" + std::to_string(r) + ")";
  }
};

std::string hex(const void* data, std::size_t n) {
  static const char* d = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    out += d[p[i] >> 4];
    out += d[p[i] & 15];
  }
  return out;
}

bool unhex(const std::string& text, void* data, std::size_t n) {
  if (text.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = static_cast<unsigned char>(std::strtoul(text.substr(2 * i, 2).c_str(), nullptr, 16));
  }
  return true;
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

/// CUDA IPC between two processes: a fresh process (this binary, re-executed)
/// allocates GPU memory, fills it and exports a handle; this process opens the
/// handle on the last GPU (another GPU when there are two or more) and reads
/// the bytes back. "" on success, else why it failed.
std::string cuda_ipc_roundtrip(const Cuda& cu, int devices) {
  int to_child[2], from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return std::string("pipe: ") + std::strerror(errno);
  const pid_t pid = ::fork();
  if (pid < 0) return std::string("fork: ") + std::strerror(errno);
  if (pid == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    ::close(to_child[1]);
    ::close(from_child[0]);
    ::execl("/proc/self/exe", "collectivectl", "__cuda-ipc-export", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  std::string line;
  // The exporter's cuInit takes up to a few seconds on a cold driver.
  pollfd pfd{from_child[0], POLLIN, 0};
  char buf[512];
  while (line.find('\n') == std::string::npos && ::poll(&pfd, 1, 20000) == 1) {
    const ssize_t n = ::read(from_child[0], buf, sizeof buf);
    if (n <= 0) break;
    line.append(buf, static_cast<std::size_t>(n));
  }
  std::string result;
  CUipcMemHandle handle{};
  if (line.rfind("handle ", 0) != 0 || !unhex(line.substr(7, 128), &handle, sizeof handle)) {
    result = "the exporting process failed: " + (line.empty() ? std::string("no answer") : line);
  } else {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    CUdeviceptr ptr = 0;
    unsigned char bytes[16] = {};
    CUresult r = cu.cuDeviceGet(&dev, devices - 1);
    if (r == 0) r = cu.cuDevicePrimaryCtxRetain(&ctx, dev);
    if (r == 0) r = cu.cuCtxSetCurrent(ctx);
    if (r == 0) r = cu.cuIpcOpenMemHandle(&ptr, handle, kLazyEnablePeerAccess);
    if (r != 0) {
      result = "cuIpcOpenMemHandle on GPU " + std::to_string(devices - 1) + ": " + cu.err(r);
    } else {
      r = cu.cuMemcpyDtoH(bytes, ptr, sizeof bytes);
      if (r != 0) {
        result = "reading the imported memory: " + cu.err(r);
      } else if (bytes[0] != 0xa5 || bytes[15] != 0xa5) {
        result = "the imported memory does not hold what the other process wrote";
      }
      cu.cuIpcCloseMemHandle(ptr);
    }
  }
  (void)!::write(to_child[1], "done\n", 5);
  ::close(to_child[1]);
  ::close(from_child[0]);
  int status = 0;
  for (int i = 0; i < 100 && ::waitpid(pid, &status, WNOHANG) == 0; ++i) ::usleep(50000);
  if (::waitpid(pid, &status, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  return result;
}

}  // namespace

/// The exporting half of the CUDA IPC check (collectivectl __cuda-ipc-export).
int cuda_ipc_export_main() {
  Cuda cu;
  const std::string why = cu.load();
  if (!why.empty() || !cu.missing.empty()) {
    std::printf("error %s%s\n", why.c_str(), cu.missing.c_str());
    return 1;
  }
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUdeviceptr ptr = 0;
  CUipcMemHandle handle{};
  CUresult r = cu.cuInit(0);
  if (r == 0) r = cu.cuDeviceGet(&dev, 0);
  if (r == 0) r = cu.cuDevicePrimaryCtxRetain(&ctx, dev);
  if (r == 0) r = cu.cuCtxSetCurrent(ctx);
  if (r == 0) r = cu.cuMemAlloc(&ptr, 1 << 20);
  if (r == 0) r = cu.cuMemsetD8(ptr, 0xa5, 1 << 20);
  if (r == 0) r = cu.cuCtxSynchronize();
  if (r == 0) r = cu.cuIpcGetMemHandle(&handle, ptr);
  if (r != 0) {
    std::printf("error %s\n", cu.err(r).c_str());
    return 1;
  }
  std::printf("handle %s\n", hex(&handle, sizeof handle).c_str());
  std::fflush(stdout);
  char buf[16];
  (void)!::read(0, buf, sizeof buf);  // until the importer is done
  cu.cuMemFree(ptr);
  return 0;
}

void check_cuda(DoctorContext& ctx, Report& r) {
  Cuda cu;
  const bool nvidia_dev = exists(ctx.options.dev_root + "/nvidiactl") ||
                          exists(ctx.options.proc_root + "/driver/nvidia/version");
  const std::string why = cu.load();
  if (!why.empty()) {
    if (!nvidia_dev) {
      r.add("cuda", Verdict::warn,
            "no GPU on this node: no NVIDIA driver (/dev/nvidiactl absent, libcuda.so.1 not "
            "found); collectived serves host memory only",
            "on GPU nodes install the NVIDIA driver; on CPU-only nodes nothing to do");
    } else {
      r.add("cuda", Verdict::fail,
            "the NVIDIA kernel driver is loaded but libcuda.so.1 does not load: " + why,
            "install the driver's user-space libraries matching the kernel module (e.g. "
            "libcuda1 / nvidia-driver-libs); in containers use the NVIDIA container toolkit");
    }
    return;
  }
  if (!cu.missing.empty()) {
    r.add("cuda", Verdict::fail, "libcuda.so.1 lacks: " + cu.missing,
          "the driver is too old for collectived: install a current NVIDIA driver");
    return;
  }
  int version = 0;
  cu.cuDriverGetVersion(&version);
  const std::string ver = std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
  const CUresult init = cu.cuInit(0);
  if (init == kNoDevice) {
    r.add("cuda", Verdict::warn, "no GPU on this node: CUDA driver " + ver + " reports no device",
          "check nvidia-smi; in containers request GPUs (nvidia.com/gpu) or set "
          "NVIDIA_VISIBLE_DEVICES");
    return;
  }
  if (init != 0) {
    r.add("cuda", Verdict::fail, "cuInit failed: " + cu.err(init) + " (driver " + ver + ")",
          "a driver/kernel-module version mismatch or a failed GPU: see nvidia-smi and dmesg; "
          "reload the nvidia modules or reboot after a driver upgrade");
    return;
  }
  int count = 0;
  cu.cuDeviceGetCount(&count);
  ctx.has_gpu = count > 0;
  std::string gpus;
  for (int i = 0; i < count; ++i) {
    CUdevice d = 0;
    cu.cuDeviceGet(&d, i);
    char name[128] = {}, bus[32] = {};
    cu.cuDeviceGetName(name, sizeof name, d);
    cu.cuDeviceGetPCIBusId(bus, sizeof bus, d);
    gpus += std::string(i ? "; " : "") + std::to_string(i) + ": " + name + " " + bus;
  }
  bool dmabuf = count > 0, gdr = count > 0;
  for (int i = 0; i < count; ++i) {
    int v = 0;
    dmabuf = dmabuf && cu.cuDeviceGetAttribute(&v, kAttrDmaBuf, i) == 0 && v == 1;
    gdr = gdr && cu.cuDeviceGetAttribute(&v, kAttrGpuDirectRdma, i) == 0 && v == 1;
  }
  ctx.cuda_dmabuf = dmabuf;
  r.add("cuda", Verdict::pass,
        "driver " + ver + ", " + std::to_string(count) + " GPU(s): " + gpus +
            "; GPU_DIRECT_RDMA_SUPPORTED=" + (gdr ? "1" : "0") +
            " DMA_BUF_SUPPORTED=" + (dmabuf ? "1" : "0"));
  if (count > 1) {
    std::string missing;
    for (int a = 0; a < count; ++a) {
      for (int b = 0; b < count; ++b) {
        int can = 0;
        if (a != b && cu.cuDeviceCanAccessPeer(&can, a, b) == 0 && !can) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(a) + "->" + std::to_string(b);
        }
      }
    }
    if (missing.empty()) {
      r.add("gpu peer access", Verdict::pass, "every pair of the " + std::to_string(count) +
                                                  " GPUs can access each other's memory");
    } else {
      r.add("gpu peer access", Verdict::warn, "no peer access for " + missing +
                                                  ": copies between them go through host memory",
            "see nvidia-smi topo -m; enable IOMMU passthrough / ACS off for PCIe peer-to-peer");
    }
  }
  const std::string ipc = cuda_ipc_roundtrip(cu, count);
  if (ipc.empty()) {
    r.add("cuda ipc", Verdict::pass,
          "another process's GPU memory (GPU 0) opened and read here (GPU " +
              std::to_string(count - 1) + ")");
  } else {
    r.add("cuda ipc", Verdict::fail, ipc,
          "clients and the daemon must share the host IPC namespace (hostIPC in Kubernetes) "
          "and see the same GPUs; check that no cgroup device rule hides /dev/nvidia*");
  }
}

void check_gpudirect_rdma(DoctorContext& ctx, Report& r) {
  // The verbs transport's own detection: the same answer the daemon logs.
  const verbs::GpuDirectStatus s =
      verbs::detect_gpudirect(ctx.verbs.get(), ctx.cuda_dmabuf, ctx.options.sysfs_root);
  if (!ctx.has_gpu) {
    r.add("gpudirect rdma", Verdict::skip, "off: no GPU; " + s.reason);
  } else if (!ctx.has_hca) {
    // Say what an HCA would get, so that a node about to receive one can be
    // checked now (the route is decided by the GPUs and the kernel modules).
    r.add("gpudirect rdma", Verdict::skip,
          "off: no RDMA device on this node; with one it would be " +
              (s.enabled ? "on (" + s.route + "): " : std::string("off: ")) + s.reason);
  } else if (s.enabled) {
    r.add("gpudirect rdma", Verdict::pass, "on (" + s.route + "): " + s.reason);
  } else {
    r.add("gpudirect rdma", Verdict::warn, s.reason,
          "modprobe nvidia-peermem (ships with the NVIDIA driver; add it to "
          "/etc/modules-load.d), or use the open NVIDIA kernel modules with kernel >= 5.12 and "
          "rdma-core >= 34 for dma-buf");
  }
}

void check_gds(DoctorContext& ctx, Report& r) {
  // RTLD_NOW: every dependency and symbol resolved now, as the failing jobs
  // would have them resolved later.
  void* h = ::dlopen("libcufile.so.0", RTLD_NOW | RTLD_LOCAL);
  const std::string nvfs_proc = ctx.options.proc_root + "/driver/nvidia-fs/version";
  const std::string nvfs_mod = ctx.options.sysfs_root + "/module/nvidia_fs/version";
  const bool nvfs = exists(nvfs_proc) || exists(nvfs_mod);
  if (h == nullptr) {
    const char* e = ::dlerror();
    const std::string why = e ? e : "dlopen failed";
    if (why.rfind("libcufile.so.0:", 0) == 0) {
      r.add("gds", Verdict::skip,
            std::string("GPU Direct Storage not installed (libcufile.so.0 not found") +
                (nvfs ? "; nvidia-fs loaded" : "") + "); collectived does not need it");
    } else {
      r.add("gds", Verdict::fail,
            "libcufile.so.0 is installed but does not load: " + why,
            "install the library the message names (a missing libdl.so or libcuda.so.1 is the "
            "usual one: apt install libc6-dev for libdl.so), then rerun doctor");
    }
    return;
  }
  std::string missing;
  for (const char* s : {"cuFileDriverOpen", "cuFileHandleRegister", "cuFileRead", "cuFileWrite"}) {
    if (::dlsym(h, s) == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(s);
  }
  ::dlclose(h);
  if (!missing.empty()) {
    r.add("gds", Verdict::fail, "libcufile.so.0 lacks " + missing,
          "reinstall GPU Direct Storage (the nvidia-gds package of the CUDA repository)");
  } else if (!nvfs) {
    r.add("gds", ctx.has_gpu ? Verdict::warn : Verdict::skip,
          "libcufile.so.0 loads, but nvidia-fs is not loaded (" + nvfs_proc +
              " absent): cuFile runs in compatibility mode (through the page cache)",
          ctx.has_gpu ? "modprobe nvidia-fs (package nvidia-fs-dkms) for direct GPU-storage DMA" : "");
  } else {
    r.add("gds", Verdict::pass,
          "libcufile.so.0 loads with all its dependencies; nvidia-fs " +
              read_line(exists(nvfs_proc) ? nvfs_proc : nvfs_mod).value_or("?"));
  }
}

}  // namespace collectived::client::ctl

#include "engine/gpu/devices.h"

#include "engine/gpu/cuda_check.h"

namespace collectived::engine::gpu {

void Devices::open(int count, std::vector<std::string>& lines) {
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    check_rt(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties");
    DeviceState d;
    d.ordinal = i;
    d.uuid.assign(prop.uuid.bytes, 16);
    d.name = prop.name;
    d.sms = prop.multiProcessorCount;
    check_rt(cudaSetDevice(i), "cudaSetDevice");
    for (auto& s : d.streams) {
      check_rt(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    for (auto& s : d.out_streams) {
      check_rt(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    for (int j = 0; j < count; ++j) {
      int can = 0;
      if (j != i && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess && can) {
        const cudaError_t pe = cudaDeviceEnablePeerAccess(j, 0);
        if (pe != cudaSuccess && pe != cudaErrorPeerAccessAlreadyEnabled) {
          check_rt(pe, "cudaDeviceEnablePeerAccess");
        }
        cudaGetLastError();
      }
    }
    lines.push_back(std::to_string(i) + ": " + d.name + " (" + uuid_text(d.uuid.data()) + ", " +
                    std::to_string(prop.multiProcessorCount) + " SMs)");
    devices_.push_back(std::move(d));
  }
}

int Devices::of(const std::string& uuid) const {
  for (const auto& d : devices_) {
    if (d.uuid == uuid) return d.ordinal;
  }
  throw Error(Code::invalid_argument, "the client's GPU (" + uuid_text(uuid.data()) +
                                          ") is not one this daemon sees (" +
                                          std::to_string(devices_.size()) +
                                          " GPU(s); check CUDA_VISIBLE_DEVICES "
                                          "of the daemon)");
}

cudaEvent_t Devices::take_event_locked(int dev) {
  cudaSetDevice(dev);  // events belong to the GPU current at creation
  DeviceState& d = devices_[dev];
  cudaEvent_t e = nullptr;
  if (!d.free_events.empty()) {
    e = d.free_events.back();
    d.free_events.pop_back();
  } else {
    check_rt(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  }
  return e;
}

void Devices::destroy() {
  for (auto& d : devices_) {
    cudaSetDevice(d.ordinal);
    for (auto s : d.streams) cudaStreamDestroy(s);
    for (auto s : d.out_streams) cudaStreamDestroy(s);
    for (auto e : d.free_events) cudaEventDestroy(e);
  }
}

}  // namespace collectived::engine::gpu

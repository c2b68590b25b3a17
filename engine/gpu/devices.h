// The GPUs the CUDA executor runs on (runtime.cc): per GPU its pooled
// streams and events. Every part of the executor enqueues on these streams;
// the executor's lock (ExecutorState::mu) orders that.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

namespace collectived::engine::gpu {

inline constexpr int kStreamsPerDevice = 4;

struct DeviceState {
  int ordinal = 0;
  std::string uuid;  // 16 bytes
  std::string name;
  int sms = 0;
  cudaStream_t streams[kStreamsPerDevice] = {};
  // Staged operations copy their outputs back here: never behind a stream
  // that waits for a client's next input.
  cudaStream_t out_streams[kStreamsPerDevice] = {};
  std::vector<cudaEvent_t> free_events;
};

class Devices {
 public:
  /// Makes every GPU's streams and enables peer access between the `count`
  /// GPUs, appending one line per GPU to `lines` (GpuStatus::devices).
  /// Throws an Error naming the call that failed.
  void open(int count, std::vector<std::string>& lines);
  /// The ordinal of the GPU with this UUID (16 bytes); throws naming it.
  int of(const std::string& uuid) const;

  DeviceState& operator[](int dev) { return devices_[dev]; }
  const DeviceState& front() const { return devices_.front(); }
  const std::vector<DeviceState>& all() const { return devices_; }
  std::size_t size() const { return devices_.size(); }

  /// A pooled event of GPU `dev` (under mu_); leaves `dev` current.
  cudaEvent_t take_event_locked(int dev);
  /// Destroys every stream and pooled event (at the executor's end).
  void destroy();

 private:
  std::vector<DeviceState> devices_;
};

}  // namespace collectived::engine::gpu

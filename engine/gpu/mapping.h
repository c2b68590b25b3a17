// Client GPU allocations as the daemon has them open (engine/gpu/importer.h
// opens them): legacy IPC handles, cuMemCreate memory, cudaMallocAsync pools.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "engine/gpu/cuda_check.h"
#include "engine/gpu/cuda_driver.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/graveyard.h"
#include "engine/gpu/vmm_range.h"

namespace collectived::engine::gpu {

/// A client allocation opened in the daemon. Shared by every registration
/// of the same allocation (legacy IPC handles are cached by handle bytes).
class Mapping {
 public:
  virtual ~Mapping() {
    if (counter) *counter -= 1;
  }
  std::shared_ptr<std::atomic<std::uint32_t>> counter;  // open mappings, for status
  std::byte* ptr = nullptr;
  std::uint64_t size = 0;
  int device = 0;
  virtual std::byte* ptr_on(int dev) {
    (void)dev;
    return ptr;
  }
};

// A legacy IPC handle maps the memory into the address space of the context
// that opens it (the peer mapping of the owning GPU does not cover other
// GPUs' contexts), so it is opened once per GPU that runs kernels on it.
class LegacyIpcMapping final : public Mapping {
 public:
  cudaIpcMemHandle_t handle{};
  ~LegacyIpcMapping() override {
    for (auto& [dev, p] : opened_) {
      cudaSetDevice(dev);
      cudaIpcCloseMemHandle(p);
    }
  }
  void open_first() { ptr = open_on(device); }
  std::byte* ptr_on(int dev) override {
    std::lock_guard lock(mu_);
    auto it = opened_.find(dev);
    return it != opened_.end() ? it->second : open_on(dev);
  }

 private:
  std::byte* open_on(int dev) {
    cudaSetDevice(dev);
    void* p = nullptr;
    check_rt(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess),
             "cudaMalloc memory: cudaIpcOpenMemHandle on GPU " + std::to_string(dev));
    opened_[dev] = static_cast<std::byte*>(p);
    return static_cast<std::byte*>(p);
  }
  std::mutex mu_;
  std::map<int, std::byte*> opened_;
};

// cuMemCreate memory: one allocation, or the several a buffer spans, mapped
// back to back into one range (its owner).
class VmmMapping final : public Mapping {
 public:
  explicit VmmMapping(std::shared_ptr<VmmRange> r) : range_(std::move(r)) {
    ptr = reinterpret_cast<std::byte*>(range_->base());
    size = range_->size();
  }

 private:
  std::shared_ptr<VmmRange> range_;
};

class PoolMapping final : public Mapping {
 public:
  explicit PoolMapping(std::shared_ptr<const CudaDriver> cu) : cu_(std::move(cu)) {}
  ~PoolMapping() override {
    cudaSetDevice(device);
    if (ptr != nullptr) cu_->cuMemFree(reinterpret_cast<cu::DevicePtr>(ptr));
    if (pool != nullptr) cu_->cuMemPoolDestroy(pool);
  }
  cu::MemPool pool = nullptr;

 private:
  std::shared_ptr<const CudaDriver> cu_;
};

/// One registration's view: the shared mapping and the client's buffer id.
class Registered final : public DeviceMemory {
 public:
  Registered(std::shared_ptr<Mapping> m, std::uint64_t id, std::shared_ptr<Graveyard> g)
      : m_(std::move(m)), id_(id), graveyard_(std::move(g)) {}
  ~Registered() override { graveyard_->bury(std::move(m_)); }
  std::byte* data() const override { return m_->ptr; }
  std::byte* data_on(int dev) const override { return m_->ptr_on(dev); }
  std::uint64_t size() const override { return m_->size; }
  int device() const override { return m_->device; }
  std::uint64_t buffer_id() const override { return id_; }

 private:
  std::shared_ptr<Mapping> m_;
  std::uint64_t id_;
  std::shared_ptr<Graveyard> graveyard_;
};

}  // namespace collectived::engine::gpu

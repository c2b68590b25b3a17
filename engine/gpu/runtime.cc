// The GPU executor with CUDA: client allocations opened once and cached, the
// clients' flag pages and interprocess events, pooled streams and events per
// GPU, and collectives as kernels over the peer mappings (engine/gpu/kernels.cu).
//
// Stream hand-off for one operation (docs/gpu.md):
//   client stream: ... producer ... | record IPC event E_r | wait flag[w_r] >= t_r | ...
//   daemon streams: wait E_0..E_n-1 | kernels | join | write flag[w_r] = t_r for every rank
// The client's wait is enqueued at submission, before the daemon has done anything:
// a stream memory operation on a word of a shared page, not an event, because
// cuStreamWaitEvent waits for the event's most recent record at the time of the
// call, and the daemon records nothing until every rank has submitted.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <array>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "engine/gpu/cuda_driver.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/kernels.h"
#include "engine/gpu/mps.h"
#include "engine/gpu/vmm_range.h"
#include "engine/host_mapping.h"
#include "engine/log.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine::gpu {

using collectived::gpu::CudaDriver;
using collectived::gpu::uuid_text;
namespace cu = collectived::gpu::cu;
using kernels::CopyLaunch;
using kernels::kMaxKernelPointers;
using kernels::ReduceLaunch;

namespace {

void check_rt(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    throw Error(Code::system, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

constexpr int kStreamsPerDevice = 4;
// An input staged by its client arrives in at most this many pieces.
constexpr std::uint32_t kMaxClientPieces = 64;
// Most allocations one registration of cuMemCreate memory spans (RegisterGpu.
// pieces): 128 GiB of 2 MiB chunks, more than a GPU holds of 20 MiB ones.
constexpr std::uint32_t kMaxVmmPieces = 65536;

/// Where GPU `dev` addresses the bytes of span `sp` (its registration mapped
/// on that GPU, peer mappings included); null where the span has no memory.
std::byte* on_device(const Span& sp, int dev) {
  if (!sp.reg) return nullptr;
  return sp.reg->device->data_on(dev) + (sp.ptr - sp.reg->device->data());
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

std::uint64_t env_bytes(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 10);
}

/// CUDA resources whose release may wait for the GPU (cudaIpcCloseMemHandle,
/// cuMemUnmap, cudaHostUnregister, cudaFreeHost) are never released on the
/// daemon's event loop: the last owner buries them here and the executor's
/// completion thread drops them. A client killed while its operation was
/// queued on a GPU stream is exactly when such a release would block.
struct Graveyard {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<void>> dead;
  bool open = true;  // false once the executor is gone: drop at once
  void bury(std::shared_ptr<void> p) {
    if (!p) return;
    std::unique_lock lock(mu);
    if (!open) {
      lock.unlock();
      p.reset();
      return;
    }
    dead.push_back(std::move(p));
    cv.notify_one();
  }
  std::vector<std::shared_ptr<void>> take() {
    std::lock_guard lock(mu);
    return std::exchange(dead, {});
  }
};

/// Pinned host buffers for staging (cudaHostAlloc, portable): allocated on
/// first need, kept and reused (allocation costs ~ms per 100 MiB).
class PinnedPool {
 public:
  ~PinnedPool() {
    for (auto& [bytes, p] : free_) cudaFreeHost(p);
  }
  std::byte* take(std::uint64_t bytes, std::uint64_t& got) {
    {
      std::lock_guard lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + (std::uint64_t{4} << 20)) {
        got = it->first;
        std::byte* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    got = (bytes + (std::uint64_t{2} << 20) - 1) & ~((std::uint64_t{2} << 20) - 1);
    void* p = nullptr;
    check_rt(cudaHostAlloc(&p, got, cudaHostAllocPortable),
             "cudaHostAlloc of " + std::to_string(got) + " bytes of host staging");
    return static_cast<std::byte*>(p);
  }
  void give(std::byte* p, std::uint64_t bytes) {
    std::lock_guard lock(mu_);
    free_.emplace(bytes, p);
  }

 private:
  std::mutex mu_;
  std::multimap<std::uint64_t, std::byte*> free_;
};

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
  virtual std::byte* ptr_on(int dev) { (void)dev; return ptr; }
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
  void open_first() {
    ptr = open_on(device);
  }
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

/// A client's flag page: host memory shared by memfd, registered with CUDA in
/// both processes; words written by the daemon's streams (or its CPU).
struct FlagPage {
  HostMapping mapping;
  bool registered = false;
  cu::DevicePtr device = 0;  // the page as the GPUs address it
  ~FlagPage() {
    if (registered) cudaHostUnregister(mapping.data());
  }
  std::uint32_t words() const { return static_cast<std::uint32_t>(mapping.size() / 4); }
  std::atomic<std::uint32_t>* word(std::uint32_t i) const {
    return reinterpret_cast<std::atomic<std::uint32_t>*>(mapping.data()) + i;
  }
};

struct OpenedEvent {
  std::string handle;
  cudaEvent_t event = nullptr;
  ~OpenedEvent() {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

/// Pinned staging the GPU may still be copying into or out of: an operation
/// that ended (failed) with its copies enqueued. The reaper waits for the
/// copies' events before the staging goes back to the pool, and before the
/// ranks' streams are released from the CPU (the last RankSync holder does
/// that).
struct StagingLeftovers {
  std::vector<std::shared_ptr<RankSync>> syncs;  // destroyed last
  std::shared_ptr<PinnedPool> pool;
  std::vector<std::pair<std::byte*, std::uint64_t>> blocks;
  std::vector<cudaEvent_t> events;  // on one stream, only the last one waits
  ~StagingLeftovers() {
    for (auto e : events) {
      cudaEventSynchronize(e);
      cudaEventDestroy(e);
    }
    for (auto& [p, bytes] : blocks) pool->give(p, bytes);
  }
};

/// One rank's pipelined staged operation (GpuExecutor::make_chunked): the
/// whole input and output in pinned host memory, laid out chunk after chunk
/// (chunk i holds what a collective of its count has: for all-gather's
/// output, reduce-scatter's and all-to-all's input and output, nranks blocks
/// of the chunk's count), and one event per chunk marking its input copied.
struct ChunkPipe {
  ChunkedArgs a;
  std::shared_ptr<PinnedPool> pool;
  std::shared_ptr<Graveyard> graveyard;
  int dev = 0;
  std::uint64_t es = 1;
  std::uint64_t smul = 1, rmul = 1;  // blocks per chunk in the input / output (1 or nranks)
  std::byte* host_send = nullptr;
  std::byte* host_recv = nullptr;
  std::uint64_t send_got = 0, recv_got = 0;
  std::vector<cudaEvent_t> copied;  // chunk i's input is in host memory
  bool started = false;

  std::uint64_t first(std::uint32_t i) const { return a.first[i]; }
  std::uint64_t count(std::uint32_t i) const { return a.first[i + 1] - a.first[i]; }
  Span send_chunk(std::uint32_t i) const {
    if (host_send == nullptr) return {};
    return Span{nullptr, host_send + first(i) * es * smul, count(i) * es * smul};
  }
  Span recv_chunk(std::uint32_t i) const {
    if (host_recv == nullptr) return {};
    return Span{nullptr, host_recv + first(i) * es * rmul, count(i) * es * rmul};
  }
  /// Pinned staging of the whole operation (outside the executor's lock).
  void allocate() {
    if (host_send == nullptr && a.send.bytes != 0) host_send = pool->take(a.send.bytes, send_got);
    if (host_recv == nullptr && a.recv.bytes != 0) host_recv = pool->take(a.recv.bytes, recv_got);
  }
  /// The GPU may still be copying into the staging (a chunk failed early).
  ~ChunkPipe() {
    auto l = std::make_shared<StagingLeftovers>();
    l->pool = pool;
    if (host_send != nullptr) l->blocks.emplace_back(host_send, send_got);
    if (host_recv != nullptr) l->blocks.emplace_back(host_recv, recv_got);
    l->events = std::move(copied);
    if (graveyard) graveyard->bury(std::move(l));
  }
};

class Sync final : public RankSync {
 public:
  std::shared_ptr<FlagPage> flags;
  std::shared_ptr<OpenedEvent> event;
  std::shared_ptr<Graveyard> graveyard;
  std::uint32_t word = 0, ticket = 0;
  std::uint32_t ready_word = 0;  // when there is no event: the client's stream writes it
  std::uint64_t session = 0;
  bool released = false;  // the flag write is enqueued on a daemon stream
  // A chunk of a pipelined staged operation (make_chunked): every chunk but
  // the last leaves the client's done word alone.
  std::shared_ptr<ChunkPipe> pipe;
  std::uint32_t chunk = 0;
  bool holds_done = true;

  /// Moves a word forward to the ticket (never back; wrap-aware).
  void advance(std::uint32_t i) const { advance(i, ticket); }
  /// Moves a word forward to `value`.
  void advance(std::uint32_t i, std::uint32_t value) const {
    auto* w = flags->word(i);
    std::uint32_t cur = w->load(std::memory_order_relaxed);
    while (!ipc::word_reached(cur, value) &&
           !w->compare_exchange_weak(cur, value, std::memory_order_release)) {
    }
  }
  /// The client's stream has marked its input ready (ready words only).
  bool ready_reached() const { return event || ready_reached(ticket); }
  /// The ready word reached `value` (a piece's: piece_value).
  bool ready_reached(std::uint32_t value) const {
    return ipc::word_reached(flags->word(ready_word)->load(std::memory_order_acquire), value);
  }
  /// Staged by the client in `pieces` pieces of `piece_bytes`: its stream
  /// writes this value once piece q is in its host staging (the last piece's
  /// is the ticket).
  std::uint32_t piece_value(std::uint32_t q) const {
    return ipc::stage_piece_value(ticket, pieces, q);
  }
  std::uint32_t pieces = 1;
  std::uint64_t piece_bytes = 0;
  std::uint32_t piece_first = 0;  // copied from this piece on, wrapping around
  std::uint32_t out_pieces = 1;   // the client copies the output back in pieces
  std::uint64_t out_piece_bytes = 0;
  /// The client died, or the deadline passed: let the daemon's streams past its input.
  void release_ready() const {
    // First: a thread reading the word (InPieces::poll) must not take the
    // value written here for the client's input.
    forced.store(true, std::memory_order_release);
    if (!event) advance(ready_word);
  }
  /// release_ready wrote the ready word: the input it marks never came.
  mutable std::atomic<bool> forced{false};
  /// Lets the client's stream go on from the CPU (failed or timed out).
  void release_done() const {
    if (holds_done) advance(word);
  }

  ~Sync() override {
    // Never ran on the GPU (failed, refused, aborted): release the client's
    // stream from here.
    if (!released && flags) release_done();
    if (graveyard) {
      graveyard->bury(std::move(flags));  // cudaHostUnregister off the event loop
      graveyard->bury(std::move(event));
    }
  }
};

struct Session {
  std::shared_ptr<FlagPage> flags;
  std::map<std::uint32_t, std::shared_ptr<OpenedEvent>> events;
  /// A registration of several cuMemCreate allocations whose pieces are
  /// still coming (RegisterGpu.pieces, one request after the other).
  std::shared_ptr<VmmRange> vmm_building;
  int vmm_device = -1;  // its GPU
};

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

struct Pending {
  std::vector<std::pair<int, cudaEvent_t>> tails;  // (device, event): all streams' last work
  std::vector<std::pair<int, cudaEvent_t>> events;  // to return to the pools
  std::vector<std::shared_ptr<RankSync>> syncs;     // by rank; null for other nodes' ranks
  std::vector<std::string> who;                     // by rank
  std::vector<Span> spans;  // keep the mappings open until the GPU is done
  std::shared_ptr<void> keep;  // a staged operation's stage
  std::function<void(Code, std::string)> done;
  std::string failure;  // set when a client taking part died while it was queued
  Code failure_code = Code::remote;
  Clock::time_point deadline = Clock::time_point::max();
  bool answered = false;  // done() ran (deadline): wait for the GPU only to recycle
  bool releases_done = true;  // the op writes the ranks' done words (not stage_in)
  /// Ranks staged by their client: done also waits for their ready words to
  /// reach these values (a piece's, or the last), which the CPU reads (the
  /// syncs are held alive by `syncs`).
  std::vector<std::pair<const Sync*, std::uint32_t>> ready_words;
  /// Where it was queued (device, stream): an operation that times out with
  /// every input ready names the ones queued before it there that still
  /// wait for theirs (expire()). `comm`: its communicator, for that message.
  std::vector<std::pair<int, cudaStream_t>> streams;
  std::string comm;
};

/// A staged operation (across nodes): pinned host buffers per local rank.
class Stage final : public GpuStage {
 public:
  Stage(std::shared_ptr<PinnedPool> pool, std::shared_ptr<Graveyard> graveyard)
      : pool_(std::move(pool)), graveyard_(std::move(graveyard)) {}
  ~Stage() override {
    if (!early_events.empty()) {
      // Early copies back (stage_out_early) and no stage_out, which takes
      // their events (it failed): the GPU may still be copying from the
      // staging into the ranks' outputs.
      auto l = std::make_shared<StagingLeftovers>();
      l->syncs = std::move(op.sync);
      l->pool = pool_;
      l->blocks = std::move(blocks_);
      for (auto& [dev, e] : early_events) l->events.push_back(e);
      graveyard_->bury(std::move(l));
      return;
    }
    for (auto& [p, bytes] : blocks_) pool_->give(p, bytes);
  }
  Span take(std::uint64_t bytes) {
    if (bytes == 0) return {};
    std::uint64_t got = 0;
    std::byte* p = pool_->take(bytes, got);
    blocks_.emplace_back(p, got);
    return Span{nullptr, p, bytes};
  }
  GpuCollective op;
  std::size_t slot = 0;
  /// By rank: (offset, bytes) of its output copied back early, and one
  /// event per device (from the executor's pool) recorded after the latest
  /// of those copies, until stage_out takes them back to the pool.
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> early;
  std::vector<std::pair<int, cudaEvent_t>> early_events;

 private:
  std::shared_ptr<PinnedPool> pool_;
  std::shared_ptr<Graveyard> graveyard_;
  std::vector<std::pair<std::byte*, std::uint64_t>> blocks_;
};

class CudaExecutor final : public GpuExecutor {
 public:
  CudaExecutor(Logger& log, const GpuOptions& options)
      : log_(log),
        stage_chunk_bytes_(options.stage_chunk_bytes),
        copy_engine_min_bytes_(options.copy_engine_min_bytes),
        two_step_min_gpus_(std::max(2, options.two_step_min_gpus)) {
    // Every kernel loaded when the context is made. With lazy loading (the
    // default since CUDA 12.2) the first launch of each kernel loads it, and
    // loading may synchronize the context: a launch enqueued behind a stream
    // that waits for a client's input (which may never come) then blocked the
    // daemon's event loop -- the "client killed while queued" hang.
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    status_.mps = options.mps;
    mps_ = std::make_unique<MpsControl>(log, options.mps);
    status_.mps_reason = mps_->reason();
    status_.mps_active = mps_->active();
    try {
      init();
      status_.available = true;
    } catch (const Error& e) {
      status_.available = false;
      status_.reason = e.what();
      log_.info("gpu_unavailable", {{"reason", e.what()}});
      return;
    }
    completer_ = std::thread([this] { complete_loop(); });
    reaper_ = std::thread([this] { reap_loop(); });
  }

  ~CudaExecutor() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (completer_.joinable()) completer_.join();
    sessions_.clear();
    {
      std::lock_guard lock(graveyard_->mu);
      graveyard_->open = false;
    }
    graveyard_->cv.notify_all();
    if (reaper_.joinable()) reaper_.join();
    for (auto& g : graveyard_->take()) g.reset();
    for (auto& d : devices_) {
      cudaSetDevice(d.ordinal);
      for (auto s : d.streams) cudaStreamDestroy(s);
      for (auto s : d.out_streams) cudaStreamDestroy(s);
      for (auto e : d.free_events) cudaEventDestroy(e);
    }
  }

  GpuStatus status() const override {
    std::lock_guard lock(mu_);
    GpuStatus s = status_;
    s.mappings = 0;
    s.mapped_bytes = 0;
    for (const auto& [k, w] : legacy_cache_) {
      if (auto m = w.lock()) {
        s.mappings += 1;
        s.mapped_bytes += m->size;
      }
    }
    s.mappings += other_mappings_->load();
    return s;
  }

  std::shared_ptr<DeviceMemory> open(std::uint64_t session, GpuRegisterArgs a) override {
    require();
    (void)session;
    const int dev = device_of(a.device_uuid);
    std::shared_ptr<Mapping> m;
    switch (a.kind) {
      case MemoryKind::legacy_ipc: m = open_legacy(a, dev); break;
      case MemoryKind::posix_fd: m = open_vmm(session, a, dev); break;
      case MemoryKind::pool_fd: m = open_pool(a, dev); break;
      default: throw Error(Code::invalid_argument, "unknown GPU memory kind");
    }
    if (!m) return nullptr;  // more pieces to come
    return std::make_shared<Registered>(std::move(m), a.buffer_id, graveyard_);
  }

  void attach_flags(std::uint64_t session, UniqueFd memfd, std::uint64_t bytes) override {
    require();
    if (bytes < 4 || bytes > (1 << 20) || bytes % 4 != 0) {
      throw Error(Code::invalid_argument, "flag page of " + std::to_string(bytes) +
                                              " bytes (4 B .. 1 MiB, whole words)");
    }
    auto page = std::make_shared<FlagPage>();
    page->mapping = HostMapping::map_memfd(std::move(memfd), bytes);
    cudaSetDevice(devices_.front().ordinal);
    check_rt(cudaHostRegister(page->mapping.data(), page->mapping.size(),
                              cudaHostRegisterPortable | cudaHostRegisterMapped),
             "cudaHostRegister of the client's flag page");
    page->registered = true;
    void* dptr = nullptr;
    check_rt(cudaHostGetDevicePointer(&dptr, page->mapping.data(), 0),
             "cudaHostGetDevicePointer of the client's flag page");
    page->device = reinterpret_cast<cu::DevicePtr>(dptr);
    std::lock_guard lock(mu_);
    sessions_[session].flags = std::move(page);
  }

  std::shared_ptr<RankSync> make_sync(std::uint64_t session, const GpuSyncArgs& a) override {
    require();
    auto sync = std::make_shared<Sync>();
    sync->send_buffer_id = a.send_buffer_id;
    sync->recv_buffer_id = a.recv_buffer_id;
    std::lock_guard lock(mu_);
    Session& s = sessions_[session];
    if (!s.flags) {
      throw Error(Code::invalid_usage, "GPU operation before the client attached its flag page");
    }
    if (a.flag_word >= s.flags->words()) {
      throw Error(Code::invalid_argument, "flag word " + std::to_string(a.flag_word) +
                                              " outside the client's flag page");
    }
    // From here on the sync releases the client's stream if it is dropped.
    sync->flags = s.flags;
    sync->word = a.flag_word;
    sync->ticket = a.ticket;
    sync->session = session;
    sync->graveyard = graveyard_;
    sync->client_staged = a.client_staged;
    if (a.own_segment_on_gpu && !a.client_staged) {
      throw Error(Code::invalid_argument,
                  "ownSegmentOnGpu is for operations staged by the client (clientStaged)");
    }
    sync->own_segment_on_gpu = a.own_segment_on_gpu;
    if (a.client_staged && !a.event_handle.empty()) {
      throw Error(Code::invalid_argument,
                  "an operation staged by the client takes a ready word, not an event");
    }
    if (a.client_staged && a.ready_pieces > 1) {
      if (a.ready_pieces > kMaxClientPieces || a.piece_bytes == 0 ||
          a.piece_first >= a.ready_pieces) {
        throw Error(Code::invalid_argument,
                    "an input staged by the client in " + std::to_string(a.ready_pieces) +
                        " pieces of " + std::to_string(a.piece_bytes) + " bytes from piece " +
                        std::to_string(a.piece_first) + " (1 to " +
                        std::to_string(kMaxClientPieces) + " pieces)");
      }
      sync->pieces = a.ready_pieces;
      sync->piece_bytes = a.piece_bytes;
      sync->piece_first = a.piece_first;
    }
    if (a.client_staged && a.out_pieces > 1) {
      if (a.out_pieces > kMaxClientPieces || a.out_piece_bytes == 0) {
        throw Error(Code::invalid_argument,
                    "an output copied back by the client in " + std::to_string(a.out_pieces) +
                        " pieces of " + std::to_string(a.out_piece_bytes) + " bytes (1 to " +
                        std::to_string(kMaxClientPieces) + " pieces)");
      }
      sync->out_pieces = a.out_pieces;
      sync->out_piece_bytes = a.out_piece_bytes;
    }
    if (a.event_handle.empty()) {
      // The client's stream marks its input ready on a flag word.
      if (a.ready_word >= s.flags->words()) {
        throw Error(Code::invalid_argument, "ready word " + std::to_string(a.ready_word) +
                                                " outside the client's flag page");
      }
      sync->ready_word = a.ready_word;
      return sync;
    }
    if (a.event_handle.size() != cu::kIpcHandleSize) {
      throw Error(Code::invalid_argument, "IPC event handle of " +
                                              std::to_string(a.event_handle.size()) + " bytes");
    }
    auto& ev = s.events[a.event_id];
    if (!ev || ev->handle != a.event_handle) {
      if (s.events.size() > 4096) {
        throw Error(Code::resource_exhausted, "more than 4096 IPC events from one client");
      }
      auto opened = std::make_shared<OpenedEvent>();
      opened->handle = a.event_handle;
      cudaIpcEventHandle_t h;
      std::memcpy(&h, a.event_handle.data(), sizeof h);
      cudaSetDevice(devices_.front().ordinal);
      check_rt(cudaIpcOpenEventHandle(&opened->event, h), "cudaIpcOpenEventHandle");
      ev = std::move(opened);
    }
    sync->event = ev;
    return sync;
  }

  std::vector<std::shared_ptr<RankSync>> make_chunked(std::uint64_t session, const GpuSyncArgs& args,
                                                      ChunkedArgs chunked) override {
    require();
    if (chunked.first.size() < 2 || chunked.first.front() != 0 || chunked.first.back() != chunked.count) {
      throw Error(Code::internal, "bad chunks of a staged GPU operation");
    }
    auto pipe = std::make_shared<ChunkPipe>();
    pipe->pool = pinned_;
    pipe->graveyard = graveyard_;
    pipe->es = dtype_size(chunked.dtype);
    const auto n = static_cast<std::uint64_t>(chunked.nranks);
    pipe->smul = chunked.kind == OpKind::reduce_scatter || chunked.kind == OpKind::all_to_all ? n : 1;
    pipe->rmul = chunked.kind == OpKind::all_gather || chunked.kind == OpKind::all_to_all ? n : 1;
    const Span& any = chunked.recv.reg ? chunked.recv : chunked.send;
    pipe->dev = any.reg && any.reg->device ? any.reg->device->device() : devices_.front().ordinal;
    pipe->a = std::move(chunked);
    const auto k = static_cast<std::uint32_t>(pipe->a.first.size() - 1);
    std::vector<std::shared_ptr<RankSync>> out;
    for (std::uint32_t i = 0; i < k; ++i) {
      auto rs = make_sync(session, args);
      auto* s = static_cast<Sync*>(rs.get());
      s->pipe = pipe;
      s->chunk = i;
      s->holds_done = i + 1 == k;
      out.push_back(std::move(rs));
    }
    return out;
  }

  std::uint64_t stage_chunk_bytes() const override { return stage_chunk_bytes_; }

  void client_gone(std::uint64_t session) override {
    std::lock_guard lock(mu_);
    if (auto it = sessions_.find(session); it != sessions_.end()) {
      graveyard_->bury(std::move(it->second.flags));
      for (auto& [id, ev] : it->second.events) graveyard_->bury(std::move(ev));
      graveyard_->bury(std::move(it->second.vmm_building));
      sessions_.erase(it);
    }
    // Operations of this client still queued on the GPUs: their input may
    // never be marked ready. Mark it from here (the daemon's CPU writes the
    // word in the shared page), so that the daemon's streams (and every other
    // rank's stream behind them) go on, and fail them naming the rank.
    for (auto& p : pending_) {
      for (std::size_t r = 0; r < p.syncs.size(); ++r) {
        auto* s = static_cast<Sync*>(p.syncs[r].get());
        if (s == nullptr || s->session != session) continue;
        s->release_ready();
        if (p.failure.empty()) {
          p.failure = (r < p.who.size() ? p.who[r] : "a rank") +
                      " disconnected (its client process exited or was killed) while the operation "
                      "was queued on the GPU; the outputs are undefined";
        }
      }
    }
    cv_.notify_all();
  }

  void run(GpuCollective op, std::function<void(Code, std::string)> done) override {
    require();
    const int n = static_cast<int>(op.sync.size());
    std::vector<int> rank_dev(n, -1);
    for (int r = 0; r < n; ++r) {
      if (op.sync[r] && op.sync[r]->client_staged) {
        throw Error(Code::invalid_argument,
                    op.who[r] +
                        " staged its GPU buffers through host memory, but the communicator "
                        "has every rank on this node (only operations across nodes are staged)");
      }
    }
    for (int r = 0; r < n; ++r) {
      if (op.recv[r].reg) rank_dev[r] = op.recv[r].reg->device->device();
      else if (op.send[r].reg) rank_dev[r] = op.send[r].reg->device->device();
      if (!op.sync[r]) throw Error(Code::internal, "GPU operation without a stream hand-off");
    }
    // GPUs taking part, in rank order; the first is the lead.
    std::vector<int> devs;
    for (int d : rank_dev) {
      if (d >= 0 && std::find(devs.begin(), devs.end(), d) == devs.end()) devs.push_back(d);
    }
    if (devs.empty()) devs.push_back(devices_.front().ordinal);
    const std::uint64_t es = dtype_size(op.dtype);
    const std::uint64_t bytes = op.count * es;
    // One GPU doing everything wins up to ~8 MiB per rank for all-reduce,
    // broadcast and reduce (the split costs a cross-GPU event hop, ~15-20 us);
    // for the sharded operations the split (each GPU writing its own ranks'
    // chunks) wins above ~1 MiB per rank (docs/gpu.md, "Measurements").
    const bool sharded = op.kind == OpKind::all_gather || op.kind == OpKind::reduce_scatter ||
                         op.kind == OpKind::all_to_all;
    const std::uint64_t limit = one_shot_env_ ? one_shot_bytes_ : sharded ? (1u << 20) : (8u << 20);
    // A send/recv pair: one copy kernel on the sender's GPU (over NVLink).
    const bool one_shot = devs.size() == 1 || bytes <= limit || op.kind == OpKind::p2p;
    const std::size_t slot = std::hash<std::string>{}(op.comm) % kStreamsPerDevice;

    Pending p;
    p.done = std::move(done);
    p.deadline = op.deadline;
    p.who = op.who;
    for (auto& s : op.send) if (s.reg) p.spans.push_back(s);
    for (auto& s : op.recv) if (s.reg) p.spans.push_back(s);
    // Open every mapping in each executing GPU's context now: before anything
    // of this operation is enqueued, and outside the lock (opening a mapping
    // may wait for the GPU, which a deadline must still be able to unblock).
    for (int d : one_shot ? std::vector<int>{devs.front()} : devs) {
      for (const auto* v : {&op.send, &op.recv}) {
        for (const auto& sp : *v) {
          if (sp.reg && sp.reg->device) sp.reg->device->data_on(d);
        }
      }
    }
    std::lock_guard lock(mu_);
    auto take_event = [&](int dev) {
      cudaEvent_t e = take_event_locked(dev);
      p.events.emplace_back(dev, e);
      return e;
    };
    auto stream_of = [&](int dev) { return devices_[dev].streams[slot]; };
    const std::vector<int> exec = one_shot ? std::vector<int>{devs.front()} : devs;
    // 1. Every executing stream waits for every rank's producer work. The
    //    clients' events are opened in the first GPU's context, and only a
    //    stream of that GPU waits on them (the driver crashed, SIGSEGV in
    //    cuStreamWaitEvent, when a stream of another GPU waited on one); the
    //    other GPUs wait on a local event recorded behind those waits.
    const int front = devices_.front().ordinal;
    cudaSetDevice(front);
    for (int r = 0; r < n; ++r) {
      auto* s = static_cast<Sync*>(op.sync[r].get());
      if (s->event) {
        check_rt(cudaStreamWaitEvent(stream_of(front), s->event->event, 0),
                 "cudaStreamWaitEvent on rank " + std::to_string(r) + "'s event");
      } else {
        cu_->check(cu_->cuStreamWaitValue32(reinterpret_cast<cu::Stream>(stream_of(front)),
                                            s->flags->device + 4 * static_cast<cu::DevicePtr>(s->ready_word),
                                            s->ticket, cu::kStreamWaitValueGeq),
                   "cuStreamWaitValue32 on rank " + std::to_string(r) + "'s ready word");
      }
    }
    const bool gated = !(exec.size() == 1 && exec.front() == front);
    if (gated) {
      cudaEvent_t gate = take_event(front);
      check_rt(cudaEventRecord(gate, stream_of(front)), "cudaEventRecord (gate)");
      for (int dev : exec) {
        if (dev == front) continue;
        cudaSetDevice(dev);
        check_rt(cudaStreamWaitEvent(stream_of(dev), gate, 0), "cudaStreamWaitEvent (gate)");
      }
      if (std::find(exec.begin(), exec.end(), front) == exec.end()) {
        cudaSetDevice(front);
        cudaEvent_t tail = take_event(front);
        check_rt(cudaEventRecord(tail, stream_of(front)), "cudaEventRecord");
        p.tails.emplace_back(front, tail);
      }
    }
    debug_sync(exec, stream_of, "waiting for the ranks' events");
    // 2. The work, each executing GPU its share. A broadcast split over
    //    gpu.two_step_min_gpus GPUs or more takes two steps, every GPU
    //    waiting for the others in between (broadcast_step).
    const bool two_steps =
        op.kind == OpKind::broadcast && exec.size() >= static_cast<std::size_t>(two_step_min_gpus_);
    for (int step = 0; step < (two_steps ? 2 : 1); ++step) {
      if (step == 1) {
        std::vector<cudaEvent_t> first(exec.size());
        for (std::size_t i = 0; i < exec.size(); ++i) {
          cudaSetDevice(exec[i]);
          first[i] = take_event(exec[i]);
          check_rt(cudaEventRecord(first[i], stream_of(exec[i])), "cudaEventRecord (first step)");
        }
        for (std::size_t i = 0; i < exec.size(); ++i) {
          cudaSetDevice(exec[i]);
          for (std::size_t j = 0; j < exec.size(); ++j) {
            if (j != i) {
              check_rt(cudaStreamWaitEvent(stream_of(exec[i]), first[j], 0),
                       "cudaStreamWaitEvent (GPU " + std::to_string(exec[j]) + "'s first step)");
            }
          }
        }
      }
      for (std::size_t i = 0; i < exec.size(); ++i) {
        cudaSetDevice(exec[i]);
        enqueue_work(op, rank_dev, exec, i, stream_of(exec[i]), two_steps ? step : -1);
      }
    }
    debug_sync(exec, stream_of, "the kernels");
    // 3. Join on the lead, release every rank's stream, and let the other
    //    streams wait for the join (the next operation starts after this one).
    const int lead = exec.front();
    cudaSetDevice(lead);
    for (std::size_t i = 1; i < exec.size(); ++i) {
      cudaSetDevice(exec[i]);
      cudaEvent_t e = take_event(exec[i]);
      check_rt(cudaEventRecord(e, stream_of(exec[i])), "cudaEventRecord");
      cudaSetDevice(lead);
      check_rt(cudaStreamWaitEvent(stream_of(lead), e, 0), "cudaStreamWaitEvent");
    }
    for (int r = 0; r < n && !op.hold; ++r) {
      auto* s = static_cast<Sync*>(op.sync[r].get());
      const cu::DevicePtr word = s->flags->device + 4 * static_cast<cu::DevicePtr>(s->word);
      cu_->check(cu_->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream_of(lead)),
                                           word, s->ticket, cu::kStreamWriteValueDefault),
                 "cuStreamWriteValue32 (release rank " + std::to_string(r) + "'s stream)");
      s->released = true;
    }
    debug_sync(exec, stream_of, "the join and the flag writes");
    cudaEvent_t joined = take_event(lead);
    check_rt(cudaEventRecord(joined, stream_of(lead)), "cudaEventRecord");
    p.tails.emplace_back(lead, joined);
    for (std::size_t i = 1; i < exec.size(); ++i) {
      cudaSetDevice(exec[i]);
      check_rt(cudaStreamWaitEvent(stream_of(exec[i]), joined, 0), "cudaStreamWaitEvent");
      cudaEvent_t tail = take_event(exec[i]);
      check_rt(cudaEventRecord(tail, stream_of(exec[i])), "cudaEventRecord");
      p.tails.emplace_back(exec[i], tail);
    }
    p.syncs = std::move(op.sync);
    for (int d : exec) p.streams.emplace_back(d, stream_of(d));
    if (std::find(exec.begin(), exec.end(), front) == exec.end()) p.streams.emplace_back(front, stream_of(front));
    p.comm = op.comm;
    pending_.push_back(std::move(p));
    ++generation_;
    cv_.notify_one();
  }

  std::shared_ptr<GpuStage> stage_in(GpuCollective op,
                                     std::function<void(Code, std::string)> ready) override {
    require();
    const int n = static_cast<int>(op.sync.size());
    auto st = std::make_shared<Stage>(pinned_, graveyard_);
    st->send.resize(n);
    st->recv.resize(n);
    st->early.resize(n);
    st->slot = std::hash<std::string>{}(op.comm) % kStreamsPerDevice;
    Pending p;
    p.done = std::move(ready);
    p.deadline = op.deadline;
    p.who = op.who;
    p.releases_done = false;
    // Pinned staging first, outside the lock (a first cudaHostAlloc of a size
    // takes milliseconds, and may wait for the GPU).
    bool by_client = false;
    for (int r = 0; r < n; ++r) {
      if (!op.sync[r]) continue;
      if (op.sync[r]->client_staged) {
        // The client's own host buffers, filled by its stream before its
        // ready word, read back after its done word: the host collective
        // runs on them as they are.
        const auto* cs = static_cast<const Sync*>(op.sync[r].get());
        const std::uint64_t in = op.send[r].bytes;
        if (cs->pieces > 1 &&
            (in == 0 || ipc::stage_piece_count(in, cs->piece_bytes) != cs->pieces)) {
          throw Error(Code::invalid_argument, op.who[r] + " staged an input of " +
                                                  std::to_string(in) + " bytes in " +
                                                  std::to_string(cs->pieces) + " pieces of " +
                                                  std::to_string(cs->piece_bytes) + " bytes");
        }
        st->send[r] = Span{nullptr, op.send[r].ptr, op.send[r].bytes};
        st->recv[r] = Span{nullptr, op.recv[r].ptr, op.recv[r].bytes};
        by_client = true;
        continue;
      }
      if (auto* s = static_cast<Sync*>(op.sync[r].get()); s->pipe) {
        // A chunk of a pipelined operation: its part of the rank's staging.
        s->pipe->allocate();
        st->send[r] = s->pipe->send_chunk(s->chunk);
        st->recv[r] = s->pipe->recv_chunk(s->chunk);
        continue;
      }
      // One staging buffer where host_in_place says so, so that the host
      // collective does not copy the input into the output first: in place
      // on the GPU, and out-of-place all-reduce and broadcast (a broadcast
      // root's output is then copied on its GPU, stage_out), rather than a
      // broadcast root copying its whole buffer on the CPU (and, out of
      // place, back to the GPU).
      st->recv[r] = st->take(op.recv[r].bytes);
      st->send[r] = host_in_place(op, r) ? st->recv[r] : st->take(op.send[r].bytes);
    }
    // Inputs in pieces (GpuCollective::in_piece_bytes): every rank that
    // copies an input copies one of the same size (not none), and none is a
    // chunk of a pipelined operation. One piece is enough: the engine then
    // starts the host collective at once, which waits for it
    // (GpuStage::in).
    auto copies_input = [&](int r) {
      return op.sync[r] && op.send[r].bytes != 0 && !(op.kind == OpKind::broadcast && r != op.root);
    };
    std::uint64_t piece = 0, in_bytes = 0;
    std::uint32_t pieces = 1;
    // Ranks staged by their clients: the pieces are the clients' (each
    // piece's ready value, in order from the first), where every local rank
    // is staged by its client and those with an input cut it alike. The
    // host collective may then start at once and receive into a rank's host
    // staging before its stream reached the operation: its client alternates
    // between two staging buffers, and this communicator's previous
    // operation, which ended before this one starts here, had the other
    // one's ready word, written after the stream copied out of this one
    // (client/staging.h).
    std::vector<std::vector<std::pair<const Sync*, std::uint32_t>>> client_pieces;
    if (by_client && op.in_piece_bytes != 0 && !op.hold) {
      bool all = true, uniform = true;
      std::uint32_t k = 0, first = 0;
      std::uint64_t pb = 0;
      for (int r = 0; r < n; ++r) {
        const auto* cs = static_cast<const Sync*>(op.sync[r].get());
        if (cs == nullptr) continue;
        all = all && cs->client_staged;
        if (!copies_input(r)) continue;
        if (in_bytes == 0) {
          in_bytes = op.send[r].bytes;
          k = cs->pieces;
          pb = cs->pieces > 1 ? cs->piece_bytes : in_bytes;
          first = cs->piece_first;
        }
        uniform = uniform && op.send[r].bytes == in_bytes && cs->pieces == k &&
                  (cs->pieces > 1 ? cs->piece_bytes : in_bytes) == pb && cs->piece_first == first;
      }
      const bool waits_only = op.kind == OpKind::broadcast && in_bytes == 0 && op.count != 0;
      if (all && uniform && (in_bytes != 0 || waits_only)) {
        if (waits_only) {
          k = 1;
          pb = op.in_piece_bytes;
        }
        st->in = std::make_shared<InPieces>();
        st->in->piece = pb;
        st->in->count = k;
        st->in->first = waits_only ? 0 : first;
        client_pieces.resize(k);
        for (int r = 0; r < n; ++r) {
          const auto* cs = static_cast<const Sync*>(op.sync[r].get());
          if (cs == nullptr) continue;
          for (std::uint32_t q = 0; q < k; ++q) {
            // A rank without an input (a broadcast's) has one value: its last.
            client_pieces[q].emplace_back(cs, copies_input(r) ? cs->piece_value(q) : cs->ticket);
          }
        }
        st->in->marks.resize(k);
        for (std::uint32_t q = 0; q < k; ++q) {
          for (const auto& [cs, value] : client_pieces[q]) {
            st->in->marks[q].push_back({cs->flags->word(cs->ready_word), value, &cs->forced});
          }
        }
        pieces = k;
        p.done = [in = st->in, ready = std::move(p.done)](Code code, std::string why) {
          in->arrived(0, code, why);
          ready(code, std::move(why));
        };
      }
    }
    if (op.in_piece_bytes != 0 && !op.hold && !by_client) {
      bool uniform = true;
      for (int r = 0; r < n; ++r) {
        if (op.sync[r] && static_cast<Sync*>(op.sync[r].get())->pipe) uniform = false;
        if (!copies_input(r)) continue;
        if (in_bytes == 0) in_bytes = op.send[r].bytes;
        uniform = uniform && op.send[r].bytes == in_bytes;
      }
      // A broadcast's node without its root copies no input, and has only
      // its ranks' streams to wait for before it may write their outputs:
      // one empty piece (the event after the stream waits) stands for that,
      // so that its host collective starts now too, and its ready to
      // receive goes out while the GPU still waits for the streams. Started
      // after them, the root waits for that message (~120 us at 1 MiB after
      // its input is in host memory).
      const bool waits_only = op.kind == OpKind::broadcast && in_bytes == 0 && op.count != 0;
      if (uniform && (in_bytes != 0 || waits_only)) {
        piece = op.in_piece_bytes;
        pieces = ipc::stage_piece_count(in_bytes, piece);
        st->in = std::make_shared<InPieces>();
        st->in->piece = piece;
        st->in->count = pieces;
        st->in->first = static_cast<std::uint32_t>(
            std::min<std::uint64_t>(op.in_first_byte / piece, pieces - 1));
        // Piece 0 of every rank is `p`: it tells st->in too (with its
        // deadline's error, naming the ranks whose input never came).
        p.done = [in = st->in, ready = std::move(p.done)](Code code, std::string why) {
          in->arrived(0, code, why);
          ready(code, std::move(why));
        };
      }
    }
    // Piece k >= 1 of every rank: an operation of its own for the completion
    // thread, which tells st->in when it is in.
    std::vector<Pending> later(pieces > 1 ? pieces - 1 : 0);
    std::lock_guard lock(mu_);
    auto take_event = [&](int dev) {
      cudaEvent_t e = take_event_locked(dev);
      p.events.emplace_back(dev, e);
      return e;
    };
    const int front = devices_.front().ordinal;
    for (int r = 0; r < n; ++r) {
      auto* s = static_cast<Sync*>(op.sync[r].get());
      if (s == nullptr) continue;  // a rank on another node
      if (s->client_staged) {
        if (client_pieces.empty())
          p.ready_words.emplace_back(s, s->ticket);  // the completion thread reads it
        continue;
      }
      const Span& gs = op.send[r];
      const Span& gr = op.recv[r];
      if (s->pipe) {
        start_pipe(*s->pipe, *s, st->slot, op.who[r]);
        p.tails.emplace_back(s->pipe->dev, s->pipe->copied[s->chunk]);
        p.spans.push_back(gs);
        p.spans.push_back(gr);
        continue;
      }
      const int dev = gr.reg ? gr.reg->device->device() : gs.reg ? gs.reg->device->device() : front;
      cudaSetDevice(dev);
      cudaStream_t stream = devices_[dev].streams[st->slot];
      if (s->event) {
        if (dev != front) {
          throw Error(Code::invalid_argument,
                      "GPU operation across nodes with an IPC event hand-off on GPU " +
                          std::to_string(dev) + ": the client library uses ready words; update it");
        }
        check_rt(cudaStreamWaitEvent(stream, s->event->event, 0), "cudaStreamWaitEvent");
      } else {
        cu_->check(cu_->cuStreamWaitValue32(reinterpret_cast<cu::Stream>(stream),
                                            s->flags->device + 4 * static_cast<cu::DevicePtr>(s->ready_word),
                                            s->ticket, cu::kStreamWaitValueGeq),
                   "cuStreamWaitValue32 on " + op.who[r] + "'s ready word");
      }
      // A broadcast's input is read at its root only. In pieces, each
      // followed by an event, in the order the host collective reads them
      // (from in->first on): the exchange starts after the first and reads
      // each later one once its event is reached, so the copies overlap it.
      bool tailed = false;
      if (copies_input(r)) {
        const std::byte* src = on_device(gs, dev);
        for (std::uint32_t q = 0; q < pieces; ++q) {
          const std::uint64_t at = pieces > 1 ? ((st->in->first + q) % pieces) * piece : 0;
          const std::uint64_t len = std::min(gs.bytes - at, pieces > 1 ? piece : gs.bytes);
          check_rt(cudaMemcpyAsync(st->send[r].ptr + at, src + at, len, cudaMemcpyDeviceToHost, stream),
                   "copy of " + op.who[r] + "'s input to host staging");
          cudaEvent_t e = q == 0 ? take_event(dev) : take_event_locked(dev);
          check_rt(cudaEventRecord(e, stream), "cudaEventRecord");
          if (q == 0) {
            p.tails.emplace_back(dev, e);
            tailed = true;
          } else {
            later[q - 1].events.emplace_back(dev, e);
            later[q - 1].tails.emplace_back(dev, e);
          }
        }
      }
      if (!tailed) {
        cudaEvent_t tail = take_event(dev);
        check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
        p.tails.emplace_back(dev, tail);
      }
      p.spans.push_back(gs);
      p.spans.push_back(gr);
    }
    p.syncs = op.sync;
    if (by_client && log_.enabled(config::LogLevel::debug)) {
      log_.debug("gpu_client_staged",
                 {{"comm", op.comm}, {"seq", op.seq}, {"op", to_string(op.kind)}});
    }
    const Clock::time_point deadline = op.deadline;
    st->op = std::move(op);
    p.keep = st;
    if (!client_pieces.empty()) {
      p.ready_words = std::move(client_pieces[0]);
      for (std::uint32_t k = 0; k + 1 < pieces; ++k) {
        later[k].ready_words = std::move(client_pieces[k + 1]);
        // At the deadline, name the ranks whose input stopped coming.
        later[k].syncs = p.syncs;
        later[k].who = p.who;
      }
    }
    for (std::uint32_t k = 0; k + 1 < pieces; ++k) {
      Pending& q = later[k];
      q.deadline = deadline;
      q.releases_done = false;
      q.spans = p.spans;  // the inputs' mappings stay open until their last piece is in
      q.keep = st;        // and the staging stays ours
      q.done = [in = st->in, k](Code code, std::string why) { in->arrived(k + 1, code, why); };
    }
    pending_.push_back(std::move(p));
    for (auto& q : later) pending_.push_back(std::move(q));
    ++generation_;
    cv_.notify_one();
    return st;
  }

  void stage_out(std::shared_ptr<GpuStage> gstage,
                 std::function<void(Code, std::string)> done) override {
    require();
    auto* st = static_cast<Stage*>(gstage.get());
    const GpuCollective& op = st->op;
    const int n = static_cast<int>(op.sync.size());
    Pending p;
    p.done = std::move(done);
    // The copies back wait for nothing; the operation's own deadline may be
    // close after the exchange between nodes, so give them time of their own.
    p.deadline = std::max(op.deadline, Clock::now() + std::chrono::seconds(30));
    p.who = op.who;
    std::lock_guard lock(mu_);
    for (int r = 0; r < n; ++r) {
      auto* s = static_cast<Sync*>(op.sync[r].get());
      if (s == nullptr) continue;
      if (s->client_staged) {
        // The outputs are final in the client's host buffers: its stream
        // goes on and copies them back itself.
        s->advance(s->word);
        s->released = true;
        continue;
      }
      const Span& gs = op.send[r];
      const Span& gr = op.recv[r];
      if (s->pipe) {
        const ChunkPipe& pp = *s->pipe;
        cudaSetDevice(pp.dev);
        cudaStream_t stream = devices_[pp.dev].out_streams[st->slot];
        const Span& whole = pp.a.recv;
        if (whole.bytes != 0) {
          // This chunk's part of the output, in the whole operation's layout.
          const std::uint64_t es = pp.es, c = pp.count(s->chunk), at = pp.first(s->chunk);
          std::byte* dst = on_device(whole, pp.dev) + at * es;
          const std::byte* src = pp.host_recv + at * es * pp.rmul;
          for (std::uint64_t b = 0; b < pp.rmul; ++b) {  // one block per rank where there are several
            check_rt(cudaMemcpyAsync(dst + b * pp.a.count * es, src + b * c * es, c * es,
                                     cudaMemcpyHostToDevice, stream),
                     "copy of " + op.who[r] + "'s output (chunk " + std::to_string(s->chunk) +
                         ") from host staging");
          }
        }
        if (s->holds_done) {
          const cu::DevicePtr word = s->flags->device + 4 * static_cast<cu::DevicePtr>(s->word);
          cu_->check(cu_->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream), word, s->ticket,
                                               cu::kStreamWriteValueDefault),
                     "cuStreamWriteValue32 (release " + op.who[r] + "'s stream)");
        }
        s->released = true;
        cudaEvent_t tail = take_event_locked(pp.dev);
        p.events.emplace_back(pp.dev, tail);
        check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
        p.tails.emplace_back(pp.dev, tail);
        continue;
      }
      const int dev = gr.reg ? gr.reg->device->device() : gs.reg ? gs.reg->device->device()
                                                           : devices_.front().ordinal;
      cudaSetDevice(dev);
      cudaStream_t stream = devices_[dev].out_streams[st->slot];
      // A broadcast root's output is its input, on the GPU already: copied
      // there, device to device, where they differ.
      const bool root_bcast = op.kind == OpKind::broadcast && r == op.root;
      if (root_bcast && gr.bytes != 0 && !staged_in_place(op, r)) {
        check_rt(cudaMemcpyAsync(on_device(gr, dev), on_device(gs, dev), gr.bytes,
                                 cudaMemcpyDeviceToDevice, stream),
                 "copy of broadcast root " + op.who[r] + "'s input to its output");
      }
      if (gr.bytes != 0 && copied_back(op, r)) {
        // What stage_out_early did not copy yet.
        auto copied = st->early[r];
        std::sort(copied.begin(), copied.end());
        std::uint64_t at = 0;
        copied.emplace_back(gr.bytes, 0);
        for (const auto& [off, len] : copied) {
          if (off > at) {
            check_rt(cudaMemcpyAsync(on_device(gr, dev) + at, st->recv[r].ptr + at, off - at,
                                     cudaMemcpyHostToDevice, stream),
                     "copy of " + op.who[r] + "'s output from host staging");
          }
          at = std::max(at, off + len);
        }
      }
      if (op.hold) {
        // A send/recv group: its stream is released from the CPU once every
        // item is done (the RankSync's last holder).
        cudaEvent_t tail = take_event_locked(dev);
        p.events.emplace_back(dev, tail);
        check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
        p.tails.emplace_back(dev, tail);
        continue;
      }
      const cu::DevicePtr word = s->flags->device + 4 * static_cast<cu::DevicePtr>(s->word);
      cu_->check(cu_->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream), word, s->ticket,
                                           cu::kStreamWriteValueDefault),
                 "cuStreamWriteValue32 (release " + op.who[r] + "'s stream)");
      s->released = true;
      cudaEvent_t tail = take_event_locked(dev);
      p.events.emplace_back(dev, tail);
      check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
      p.tails.emplace_back(dev, tail);
    }
    // The early copies came before these on the same streams: their events
    // go back to the pool with this operation's.
    p.events.insert(p.events.end(), st->early_events.begin(), st->early_events.end());
    st->early_events.clear();
    p.syncs = op.sync;
    p.keep = std::move(gstage);
    pending_.push_back(std::move(p));
    ++generation_;
    cv_.notify_one();
  }

  void stage_out_early(GpuStage& gstage, int r, std::uint64_t offset, std::uint64_t bytes) override {
    auto& st = static_cast<Stage&>(gstage);
    const GpuCollective& op = st.op;
    if (r < 0 || r >= static_cast<int>(op.sync.size()) || bytes == 0 || op.hold) return;
    const auto* s = static_cast<const Sync*>(op.sync[r].get());
    if (s == nullptr || s->pipe) return;
    if (s->client_staged) {
      client_out_early(st, *s, r, offset, bytes);
      return;
    }
    const Span& gr = op.recv[r];
    if (!copied_back(op, r) || gr.reg == nullptr || st.recv[r].ptr == nullptr || offset > gr.bytes ||
        bytes > gr.bytes - offset) {
      return;
    }
    // The output is ours to write once the rank's stream reached the
    // operation, that is once the first piece of its input is in. The
    // exchange may start before (GpuStage::in): stage_out copies what comes
    // earlier.
    if (st.in && st.in->reached.load(std::memory_order_acquire) == 0) return;
    const int dev = gr.reg->device->device();
    std::lock_guard lock(mu_);
    cudaSetDevice(dev);
    // The out stream: never behind a stream that waits for a client's next
    // input.
    cudaStream_t stream = devices_[dev].out_streams[st.slot];
    check_rt(cudaMemcpyAsync(on_device(gr, dev) + offset, st.recv[r].ptr + offset, bytes,
                             cudaMemcpyHostToDevice, stream),
             "early copy of " + op.who[r] + "'s output from host staging");
    auto e = std::find_if(st.early_events.begin(), st.early_events.end(),
                          [&](const auto& de) { return de.first == dev; });
    if (e == st.early_events.end()) {
      e = st.early_events.insert(st.early_events.end(), {dev, take_event_locked(dev)});
    }
    check_rt(cudaEventRecord(e->second, stream), "cudaEventRecord");
    st.early[r].emplace_back(offset, bytes);
  }

 private:
  /// Staged by the client with its output copied back in pieces: bytes
  /// [offset, offset + bytes) of rank r's output are final in its host
  /// staging. Where that completes pieces 0 .. q, the done word goes to
  /// piece q's value, and the client's stream copies them back while the
  /// exchange goes on (it waits for each piece's value in turn).
  static void client_out_early(Stage& st, const Sync& s, int r, std::uint64_t offset,
                               std::uint64_t bytes) {
    const std::uint64_t total = st.recv[r].bytes;
    if (s.out_pieces <= 1 || offset > total || bytes > total - offset) return;
    auto& ranges = st.early[r];
    ranges.emplace_back(offset, bytes);
    std::sort(ranges.begin(), ranges.end());
    std::uint64_t prefix = 0;  // bytes final from the start
    for (const auto& [off, len] : ranges) {
      if (off > prefix) break;
      prefix = std::max(prefix, off + len);
    }
    const std::uint64_t full = prefix >= total ? s.out_pieces : prefix / s.out_piece_bytes;
    if (full == 0) return;
    const auto q = static_cast<std::uint32_t>(std::min<std::uint64_t>(full, s.out_pieces) - 1);
    s.advance(s.word, ipc::stage_piece_value(s.ticket, s.out_pieces, q));
  }

  /// Whether rank r's output of a staged operation is copied back from the
  /// host staging. Not a reduce's output off its root (not written, as
  /// NCCL's), nor a broadcast root's (its input, on the GPU already).
  static bool copied_back(const GpuCollective& op, int r) {
    return !(op.kind == OpKind::reduce && r != op.root) && !(op.kind == OpKind::broadcast && r == op.root);
  }
  /// Whether rank r's buffers of a staged operation are one (send == recv)
  /// for an operation whose input and output have the same size.
  static bool staged_in_place(const GpuCollective& op, int r) {
    const bool same_size_kind =
        op.kind == OpKind::all_reduce || op.kind == OpKind::broadcast || op.kind == OpKind::reduce;
    return same_size_kind && same_size_spans(op, r) &&
           op.send[static_cast<std::size_t>(r)].ptr == op.recv[static_cast<std::size_t>(r)].ptr;
  }
  /// Rank r's input and output are both GPU memory of one (non-zero) size.
  static bool same_size_spans(const GpuCollective& op, int r) {
    const Span& s = op.send[static_cast<std::size_t>(r)];
    const Span& d = op.recv[static_cast<std::size_t>(r)];
    return s.reg != nullptr && d.reg != nullptr && s.bytes == d.bytes && s.bytes != 0;
  }
  /// Whether rank r's host staging is one buffer for input and output: in
  /// place on the GPU, or out of place for an all-reduce or broadcast (their
  /// input is read once, their output has its size). Not an out-of-place
  /// reduce: the host's in-place reduce is the slower one (2 H200, 2
  /// daemons over TCP: 4 and 16 MiB 0.78-0.82x in place).
  static bool host_in_place(const GpuCollective& op, int r) {
    if (staged_in_place(op, r)) return true;
    const bool kind = op.kind == OpKind::all_reduce || op.kind == OpKind::broadcast;
    return kind && same_size_spans(op, r);
  }

  /// The first chunk of a pipelined staged operation to reach stage_in
  /// (under mu_): waits for the rank's input, then copies every chunk's input
  /// to the host, recording one event per chunk.
  void start_pipe(ChunkPipe& pp, const Sync& s, std::size_t slot, const std::string& who) {
    if (pp.started) return;
    const int front = devices_.front().ordinal;
    cudaSetDevice(pp.dev);
    cudaStream_t stream = devices_[pp.dev].streams[slot];
    if (s.event) {
      if (pp.dev != front) {
        throw Error(Code::invalid_argument,
                    "GPU operation across nodes with an IPC event hand-off on GPU " +
                        std::to_string(pp.dev) + ": the client library uses ready words; update it");
      }
      check_rt(cudaStreamWaitEvent(stream, s.event->event, 0), "cudaStreamWaitEvent");
    } else {
      cu_->check(cu_->cuStreamWaitValue32(reinterpret_cast<cu::Stream>(stream),
                                          s.flags->device + 4 * static_cast<cu::DevicePtr>(s.ready_word),
                                          s.ticket, cu::kStreamWaitValueGeq),
                 "cuStreamWaitValue32 on " + who + "'s ready word");
    }
    const Span& whole = pp.a.send;
    const std::byte* base = whole.bytes != 0 ? on_device(whole, pp.dev) : nullptr;
    const auto k = static_cast<std::uint32_t>(pp.a.first.size() - 1);
    for (std::uint32_t i = 0; i < k; ++i) {
      if (base != nullptr) {
        const std::uint64_t es = pp.es, c = pp.count(i), at = pp.first(i);
        std::byte* dst = pp.host_send + at * es * pp.smul;
        const std::byte* src = base + at * es;
        for (std::uint64_t b = 0; b < pp.smul; ++b) {  // one block per rank where there are several
          check_rt(cudaMemcpyAsync(dst + b * c * es, src + b * pp.a.count * es, c * es,
                                   cudaMemcpyDeviceToHost, stream),
                   "copy of " + who + "'s input (chunk " + std::to_string(i) + ") to host staging");
        }
      }
      cudaEvent_t e = nullptr;
      check_rt(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      pp.copied.push_back(e);
      check_rt(cudaEventRecord(e, stream), "cudaEventRecord");
    }
    pp.started = true;
  }

  /// A pooled event of GPU `dev` (under mu_); leaves `dev` current.
  cudaEvent_t take_event_locked(int dev) {
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

  /// COLLECTIVED_GPU_DEBUG_SYNC=1: synchronize after each step of an operation
  /// and name the step that failed (diagnosis only: it blocks).
  template <typename StreamOf>
  void debug_sync(const std::vector<int>& exec, StreamOf&& stream_of, const char* step) {
    if (!debug_sync_) return;
    for (int dev : exec) {
      cudaSetDevice(dev);
      const cudaError_t e = cudaStreamSynchronize(stream_of(dev));
      if (e != cudaSuccess) {
        log_.error("gpu_debug_sync", {{"step", step}, {"device", dev}, {"error", cudaGetErrorString(e)}});
        check_rt(e, std::string("GPU ") + std::to_string(dev) + ": " + step);
      }
    }
    log_.info("gpu_debug_sync", {{"step", step}, {"ok", 1}});
  }

  void require() const {
    if (!status_.available) throw Error(Code::unavailable, status_.reason);
  }

  void init() {
    cu_ = CudaDriver::load();
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      throw Error(Code::unavailable, std::string("no GPU: cudaGetDeviceCount: ") +
                                         (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
    }
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
      status_.devices.push_back(std::to_string(i) + ": " + d.name + " (" + uuid_text(d.uuid.data()) + ", " +
                                std::to_string(prop.multiProcessorCount) + " SMs)");
      devices_.push_back(std::move(d));
    }
    status_.reason = "CUDA driver API " + std::to_string(cu_->driver_version()) + ", " +
                     std::to_string(count) + " GPU(s)";
    log_.info("gpu_ready", {{"devices", count}, {"driver", cu_->driver_version()}, {"mps", status_.mps}});
  }

  int device_of(const std::string& uuid) const {
    for (const auto& d : devices_) {
      if (d.uuid == uuid) return d.ordinal;
    }
    throw Error(Code::invalid_argument,
                "the client's GPU (" + uuid_text(uuid.data()) + ") is not one this daemon sees (" +
                    std::to_string(devices_.size()) + " GPU(s); check CUDA_VISIBLE_DEVICES "
                    "of the daemon)");
  }

  std::shared_ptr<Mapping> open_legacy(const GpuRegisterArgs& a, int dev) {
    if (a.handle.size() != cu::kIpcHandleSize) {
      throw Error(Code::invalid_argument, "cudaMalloc memory: IPC handle of " +
                                              std::to_string(a.handle.size()) + " bytes");
    }
    {
      std::lock_guard lock(mu_);
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
    std::lock_guard lock(mu_);
    legacy_cache_[a.handle] = m;
    // Drop cache entries of closed mappings now and then.
    if (legacy_cache_.size() > 1024) {
      for (auto it = legacy_cache_.begin(); it != legacy_cache_.end();) {
        it = it->second.expired() ? legacy_cache_.erase(it) : std::next(it);
      }
    }
    return m;
  }

  /// cuMemCreate memory: one allocation (a.fd), or the next pieces of a
  /// registration of several that one buffer spans (a.pieces: PyTorch's
  /// expandable segments), imported and mapped back to back into one range
  /// of the daemon's (VmmRange). Null while pieces are still to come: the
  /// range being filled waits in the session.
  std::shared_ptr<Mapping> open_vmm(std::uint64_t session, GpuRegisterArgs& a, int dev) {
    cudaSetDevice(dev);
    std::shared_ptr<VmmRange> range;
    int range_dev = -1;
    if (a.piece_count == 0) {
      if (!a.fd) throw Error(Code::invalid_argument, "cuMemCreate memory: no descriptor came with it");
      range = std::make_shared<VmmRange>(cu_, a.size, 1);
      range->map(a.fd.get(), 0, a.size);
    } else {
      {
        std::lock_guard lock(mu_);
        if (auto it = sessions_.find(session); it != sessions_.end()) {
          range = std::move(it->second.vmm_building);
          range_dev = it->second.vmm_device;
        }
      }
      if (a.pieces.empty()) {
        graveyard_->bury(std::move(range));
        throw Error(Code::invalid_argument, "cuMemCreate memory: a request of several pieces with none");
      }
      if (a.pieces.front().offset == 0) {
        // A new registration (one left unfinished is dropped).
        graveyard_->bury(std::move(range));
        if (a.piece_count > kMaxVmmPieces) {
          throw Error(Code::invalid_argument, "cuMemCreate memory: " + std::to_string(a.piece_count) +
                                                  " pieces (at most " + std::to_string(kMaxVmmPieces) + ")");
        }
        range = std::make_shared<VmmRange>(cu_, a.size, a.piece_count);
      } else if (!range || range->size() != a.size || range->pieces() != a.piece_count || range_dev != dev) {
        graveyard_->bury(std::move(range));
        throw Error(Code::invalid_argument,
                    "cuMemCreate memory: pieces from offset " + std::to_string(a.pieces.front().offset) +
                        " continue no registration of this client in progress");
      }
      try {
        for (auto& p : a.pieces) range->map(p.fd.get(), p.offset, p.size);
      } catch (const Error&) {
        graveyard_->bury(std::move(range));
        throw;
      }
      if (!range->complete()) {
        std::lock_guard lock(mu_);
        Session& s = sessions_[session];
        s.vmm_building = std::move(range);
        s.vmm_device = dev;
        return nullptr;
      }
    }
    std::vector<int> access;
    for (const auto& d : devices_) {
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

  std::shared_ptr<Mapping> open_pool(GpuRegisterArgs& a, int dev) {
    if (!a.fd) throw Error(Code::invalid_argument, "cudaMallocAsync memory: no pool descriptor came with it");
    if (a.handle.size() != sizeof(cu::MemPoolPtrExportData)) {
      throw Error(Code::invalid_argument, "cudaMallocAsync memory: pointer export data of " +
                                              std::to_string(a.handle.size()) + " bytes");
    }
    cudaSetDevice(dev);
    auto m = std::make_shared<PoolMapping>(cu_);
    m->device = dev;
    m->size = a.size;
    cu_->check(cu_->cuMemPoolImportFromShareableHandle(
                   &m->pool, reinterpret_cast<void*>(static_cast<std::intptr_t>(a.fd.get())),
                   cu::kMemHandleTypePosixFd, 0),
               "cudaMallocAsync memory: cuMemPoolImportFromShareableHandle");
    cu::MemPoolPtrExportData data;
    std::memcpy(&data, a.handle.data(), sizeof data);
    // An imported pool's memory is reachable from its own GPU only until
    // access is granted: the other GPUs' kernels read and write it over
    // NVLink (split operations). Without this a kernel of the other GPU hits
    // unmapped memory and the operation never completes.
    for (const auto& d : devices_) {
      const int other = d.ordinal;
      if (other == dev) continue;
      cu::MemAccessDesc acc{};
      acc.location = {cu::kMemLocationTypeDevice, other};
      acc.flags = cu::kMemAccessFlagsProtReadWrite;
      cu_->check(cu_->cuMemPoolSetAccess(m->pool, &acc, 1),
                 "cudaMallocAsync memory: cuMemPoolSetAccess for GPU " + std::to_string(other));
    }
    cu::DevicePtr p = 0;
    cu_->check(cu_->cuMemPoolImportPointer(&p, m->pool, &data),
               "cudaMallocAsync memory: cuMemPoolImportPointer");
    m->ptr = reinterpret_cast<std::byte*>(p);
    *other_mappings_ += 1;
    m->counter = other_mappings_;
    return m;
  }

  /// Enqueues executing GPU exec[i]'s share of `op` on `stream`; of step
  /// `step` (0 or 1) where the operation takes two (run()), else -1.
  void enqueue_work(const GpuCollective& op, const std::vector<int>& rank_dev,
                    const std::vector<int>& exec, std::size_t i, cudaStream_t stream, int step) {
    const int n = static_cast<int>(op.send.size());
    const int dev = exec[i];
    const int blocks = devices_[dev].sms * 4;
    const std::uint64_t es = dtype_size(op.dtype);
    const bool split = exec.size() > 1;
    // Element range [lo, hi) of `total` this GPU computes (split: equal shares
    // on 256-element boundaries, so that 16-byte vectors stay aligned).
    auto share = [&](std::uint64_t total) {
      if (!split) return std::pair<std::uint64_t, std::uint64_t>{0, total};
      const std::uint64_t unit = 256;
      const std::uint64_t units = (total + unit - 1) / unit;
      const std::uint64_t per = (units + exec.size() - 1) / exec.size();
      const std::uint64_t lo = std::min(total, per * unit * i);
      const std::uint64_t hi = std::min(total, per * unit * (i + 1));
      return std::pair{lo, hi};
    };
    // Copies: split GPUs write their own ranks' outputs (reading peers over NVLink).
    auto mine = [&](int r) { return !split || rank_dev[r] == dev; };
    // Every span as this GPU addresses it.
    std::vector<std::byte*> send(n, nullptr), recv(n, nullptr);
    for (int r = 0; r < n; ++r) {
      send[r] = on_device(op.send[r], dev);
      recv[r] = on_device(op.recv[r], dev);
    }
    auto reduce = [&](std::vector<const std::byte*> srcs, std::vector<std::byte*> dsts,
                      std::uint64_t count, bool whole = false) {
      auto [lo, hi] = whole ? std::pair<std::uint64_t, std::uint64_t>{0, count} : share(count);
      if (hi <= lo) return;
      ReduceLaunch a{};
      a.nsrc = static_cast<int>(srcs.size());
      a.ndst = static_cast<int>(dsts.size());
      if (a.nsrc > kMaxKernelPointers || a.ndst > kMaxKernelPointers) {
        throw Error(Code::invalid_argument, "more than 64 ranks in a GPU collective");
      }
      for (int s = 0; s < a.nsrc; ++s) a.src[s] = srcs[s] + lo * es;
      for (int d = 0; d < a.ndst; ++d) a.dst[d] = dsts[d] + lo * es;
      a.count = hi - lo;
      a.avg_divisor = static_cast<std::uint32_t>(n);
      check_rt(kernels::launch_reduce(static_cast<kernels::DType>(op.dtype),
                                       static_cast<kernels::RedOp>(op.redop), a, blocks, stream),
               "reduction kernel");
    };
    // Copies of rank `from`'s bytes into rank `to`'s buffer; `peer` when the
    // two lie on different GPUs (the bytes cross NVLink).
    struct Copy {
      const std::byte* src;
      std::byte* dst;
      bool peer;
    };
    std::vector<Copy> pairs;
    // Copies that go to this GPU's copy engines whatever else it does, each
    // with its own length (a broadcast's halves below).
    std::vector<CopyPart> engine_parts;
    auto copy = [&](int from, int to, const std::byte* src, std::byte* dst) {
      pairs.push_back({src, dst, rank_dev[from] != rank_dev[to]});
    };
    const std::uint64_t one = op.count * es;
    switch (op.kind) {
      case OpKind::all_reduce: {
        std::vector<const std::byte*> srcs;
        std::vector<std::byte*> dsts;
        for (int r = 0; r < n; ++r) {
          srcs.push_back(send[r]);
          dsts.push_back(recv[r]);
        }
        reduce(srcs, dsts, op.count);
        break;
      }
      case OpKind::reduce: {
        // The root's GPU pulls every input and writes locally.
        if (!mine(op.root)) break;
        std::vector<const std::byte*> srcs;
        for (int r = 0; r < n; ++r) srcs.push_back(send[r]);
        reduce(srcs, {recv[op.root]}, op.count, /*whole=*/true);
        break;
      }
      case OpKind::reduce_scatter: {
        // Rank j's chunk is computed by rank j's GPU (pulling the inputs over
        // NVLink, writing locally); in place (recv == send + j*count) each
        // element is read from every source before it is written.
        for (int j = 0; j < n; ++j) {
          if (!mine(j)) continue;
          std::vector<const std::byte*> srcs;
          for (int r = 0; r < n; ++r) srcs.push_back(send[r] + j * one);
          reduce(srcs, {recv[j]}, op.count, /*whole=*/true);
        }
        break;
      }
      case OpKind::all_gather:
        for (int r = 0; r < n; ++r) {
          if (!mine(r)) continue;
          for (int j = 0; j < n; ++j) {
            std::byte* dst = recv[r] + j * one;
            if (dst != send[j]) copy(j, r, send[j], dst);
          }
        }
        break;
      case OpKind::broadcast: {
        if (step >= 0) {
          broadcast_step(op, rank_dev, exec, i, send, recv, step, blocks, stream);
          return;
        }
        // Two GPUs, split, large, and nothing to copy inside the root's GPU
        // (in place at the root, as PyTorch's broadcast is): the other GPU
        // pulls the first half of the root's bytes and the root's GPU pushes
        // the second half, each on its own copy engine: two DMA engines on the
        // one NVLink direction, faster than the pull alone (most at 16-64
        // MiB). With a copy inside the root's GPU the push would queue behind
        // it on the same stream, so then the other GPU pulls it all
        // (docs/gpu.md, "Measurements").
        bool root_gpu_idle = true;
        for (int r = 0; r < n; ++r) {
          if (rank_dev[r] == rank_dev[op.root] && recv[r] != send[op.root]) root_gpu_idle = false;
        }
        const bool halves = split && exec.size() == 2 && root_gpu_idle && copy_engine_min_bytes_ != 0 &&
                            one >= copy_engine_min_bytes_;
        const std::uint64_t half = (one / 2) & ~std::uint64_t{4095};
        for (int r = 0; r < n; ++r) {
          const bool other_gpu = rank_dev[r] != rank_dev[op.root];
          if (halves && other_gpu) {
            if (mine(r)) engine_parts.push_back({send[op.root], recv[r], half});
            if (dev == rank_dev[op.root]) engine_parts.push_back({send[op.root] + half, recv[r] + half, one - half});
            continue;
          }
          if (!mine(r)) continue;
          if (recv[r] != send[op.root]) copy(op.root, r, send[op.root], recv[r]);
        }
        break;
      }
      case OpKind::all_to_all: {
        bool in_place = false;
        for (int r = 0; r < n; ++r) in_place = in_place || (send[r] != nullptr && send[r] == recv[r]);
        if (!in_place) {
          for (int r = 0; r < n; ++r) {
            if (!mine(r)) continue;
            for (int j = 0; j < n; ++j) {
              copy(j, r, send[j] + r * one, recv[r] + j * one);
            }
          }
          break;
        }
        // In place (on some ranks at least): the block a sends to b and the
        // block b sends to a are moved together (each element of both read
        // before either is written), by rank a's GPU for a <= b: a block's
        // destination is the other block's source where a rank is in place.
        std::vector<std::array<std::byte*, 4>> swaps;  // src_a, dst_a, src_b, dst_b
        for (int a = 0; a < n; ++a) {
          if (!mine(a)) continue;
          for (int b = a; b < n; ++b) {
            swaps.push_back({send[a] + b * one, recv[b] + a * one, send[b] + a * one, recv[a] + b * one});
          }
        }
        constexpr int kMax = kernels::ExchangeLaunch::kMax;
        for (std::size_t k = 0; k < swaps.size(); k += kMax) {
          kernels::ExchangeLaunch x{};
          x.n = static_cast<int>(std::min<std::size_t>(kMax, swaps.size() - k));
          for (int y = 0; y < x.n; ++y) {
            x.src_a[y] = swaps[k + y][0];
            x.dst_a[y] = swaps[k + y][1];
            x.src_b[y] = swaps[k + y][2];
            x.dst_b[y] = swaps[k + y][3];
          }
          x.bytes = one;
          check_rt(kernels::launch_exchange(x, blocks, stream), "exchange kernel (in-place all_to_all)");
        }
        break;
      }
      case OpKind::p2p:
        // A matched send (rank 0's send) and receive (rank 1's recv).
        if (n == 2 && one != 0 && send[0] != nullptr && recv[1] != nullptr && send[0] != recv[1]) {
          copy(0, 1, send[0], recv[1]);
        }
        break;
      default:
        throw Error(Code::invalid_argument,
                    std::string(to_string(op.kind)) + " does not run on GPU buffers");
    }
    // Large copies between GPUs go to the copy engines when this GPU's share
    // is only such copies: a DMA over NVLink needs no SMs and moves more per
    // second than the copy kernel over the peer mapping from 16 MiB. A share
    // that also copies inside the GPU keeps the one kernel: on the same stream
    // the copy engine and the kernel run one after the other, where the kernel
    // overlaps both (docs/gpu.md, "Measurements").
    const bool engines = copy_engine_min_bytes_ != 0 && one >= copy_engine_min_bytes_ &&
                         std::all_of(pairs.begin(), pairs.end(), [](const Copy& c) { return c.peer; });
    std::vector<CopyPart> kernel_parts;
    for (const Copy& c : pairs) (engines ? engine_parts : kernel_parts).push_back({c.src, c.dst, one});
    for (const CopyPart& c : engine_parts) {
      check_rt(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
               "cudaMemcpyAsync between GPUs (copy engine)");
    }
    launch_copies(std::move(kernel_parts), blocks, stream, "copy kernel");
  }

  /// A copy of `bytes` from `src` to `dst` (device addresses of the executing GPU).
  struct CopyPart {
    const std::byte* src;
    std::byte* dst;
    std::uint64_t bytes;
  };

  /// The copy kernels for `parts` (destinations disjoint): one launch per
  /// length and kMaxKernelPointers pairs.
  static void launch_copies(std::vector<CopyPart> parts, int blocks, cudaStream_t stream, const char* what) {
    std::stable_sort(parts.begin(), parts.end(),
                     [](const CopyPart& a, const CopyPart& b) { return a.bytes < b.bytes; });
    for (std::size_t k = 0; k < parts.size();) {
      CopyLaunch c{};
      c.bytes = parts[k].bytes;
      while (k < parts.size() && parts[k].bytes == c.bytes && c.n < kMaxKernelPointers) {
        c.src[c.n] = parts[k].src;
        c.dst[c.n] = parts[k].dst;
        ++c.n;
        ++k;
      }
      check_rt(kernels::launch_copy(c, blocks, stream), what);
    }
  }

  /// One step of a broadcast split over k >= 3 GPUs. The root's bytes are cut
  /// into k chunks, chunk c for GPU exec[c]. Step 0: every other GPU pulls its
  /// chunk from the root into its first rank's output (a copy engine).
  /// Step 1, after every GPU's step 0: each GPU's ranks read every chunk from
  /// where it now lies (the root's input, or the first rank's output of that
  /// chunk's GPU), with one copy kernel reading several GPUs at once. The
  /// root GPU's links carry 2 (k - 1) / k of the bytes where every GPU pulling
  /// the whole buffer from the root made them carry k - 1 times the bytes
  /// (on 4 H200, a third of NCCL's broadcast bandwidth).
  void broadcast_step(const GpuCollective& op, const std::vector<int>& rank_dev,
                      const std::vector<int>& exec, std::size_t i, const std::vector<std::byte*>& send,
                      const std::vector<std::byte*>& recv, int step, int blocks, cudaStream_t stream) {
    const int n = static_cast<int>(op.send.size());
    const int dev = exec[i];
    const int root_dev = rank_dev[op.root];
    const std::uint64_t one = op.count * dtype_size(op.dtype);
    const std::uint64_t k = exec.size();
    // Page multiples: every chunk starts 16-byte aligned for the copy kernel.
    const std::uint64_t per = ((one + k - 1) / k + 4095) & ~std::uint64_t{4095};
    auto len = [&](std::size_t c) -> std::uint64_t {
      const std::uint64_t at = c * per;
      return at >= one ? 0 : std::min(per, one - at);
    };
    // Where chunk c lies after step 0: the root's input, or the output of
    // the first rank on GPU exec[c].
    std::vector<int> first(k, -1);
    for (int r = n - 1; r >= 0; --r) {
      const auto at = std::find(exec.begin(), exec.end(), rank_dev[r]);
      if (at != exec.end()) first[static_cast<std::size_t>(at - exec.begin())] = r;
    }
    if (step == 0) {
      if (dev != root_dev && len(i) != 0) {
        check_rt(cudaMemcpyAsync(recv[first[i]] + i * per, send[op.root] + i * per, len(i), cudaMemcpyDefault,
                                 stream),
                 "cudaMemcpyAsync (broadcast, chunk " + std::to_string(i) + " from the root's GPU)");
      }
      return;
    }
    std::vector<CopyPart> parts;
    for (int r = 0; r < n; ++r) {
      if (rank_dev[r] != dev) continue;
      if (dev == root_dev) {
        if (recv[r] != send[op.root]) parts.push_back({send[op.root], recv[r], one});
        continue;
      }
      for (std::size_t c = 0; c < k; ++c) {
        if (len(c) == 0 || (c == i && r == first[i])) continue;
        const std::byte* from = exec[c] == root_dev ? send[op.root] : recv[first[c]];
        parts.push_back({from + c * per, recv[r] + c * per, len(c)});
      }
    }
    launch_copies(std::move(parts), blocks, stream, "copy kernel (broadcast, second step)");
  }

  /// The completion thread: polls every queued operation's last events
  /// (cudaEventQuery: nothing here waits on the GPU without a bound), answers
  /// each when its GPU work is done, and answers at the deadline those that
  /// are not, naming the ranks whose input never became ready and releasing
  /// every rank's stream from the CPU.
  void complete_loop() {
    int idle = 0;
    std::uint64_t seen = 0;
    for (;;) {
      std::vector<Pending> finished;
      std::vector<std::pair<std::function<void(Code, std::string)>, std::string>> expired;
      bool waiting = false;
      bool stopping = false;
      std::vector<Pending*> snapshot;
      {
        std::unique_lock lock(mu_);
        if (pending_.empty()) {
          if (stopping_) return;
          cv_.wait_for(lock, std::chrono::milliseconds(100));
          continue;
        }
        if (stopping_) {
          // Stopping: every operation was answered and its streams released
          // below; give the GPU a few seconds, then leave what is stuck.
          if (stop_since_ == Clock::time_point{}) stop_since_ = Clock::now();
          if (Clock::now() - stop_since_ > std::chrono::seconds(5)) return;
        }
        if (generation_ != seen) {
          seen = generation_;
          idle = 0;
        }
        stopping = stopping_;
        for (auto& p : pending_) snapshot.push_back(&p);
      }
      // Query outside the lock (the event loop enqueues under it). Entries of
      // pending_ stay put (std::list) and only this thread removes them; their
      // tails and deadlines do not change once queued.
      const auto now = Clock::now();
      std::vector<Pending*> done_now;
      bool due = stopping;
      for (Pending* p : snapshot) {
        bool done = std::all_of(p->ready_words.begin(), p->ready_words.end(),
                                [](const auto& sv) { return sv.first->ready_reached(sv.second); });
        for (auto& [dev, e] : p->tails) {
          if (!done) break;
          const cudaError_t r = cudaEventQuery(e);
          if (r == cudaErrorNotReady) {
            done = false;
            break;
          }
          if (r != cudaSuccess) {
            std::lock_guard lock(mu_);
            if (p->failure.empty()) {
              p->failure = std::string("GPU ") + std::to_string(dev) + ": " + cudaGetErrorName(r) +
                           " (" + cudaGetErrorString(r) + ")";
              p->failure_code = Code::system;
            }
          }
        }
        if (done) {
          done_now.push_back(p);
        } else {
          waiting = true;
          if (!p->answered && now >= p->deadline) due = true;
        }
      }
      if (!done_now.empty() || due) {
        std::lock_guard lock(mu_);
        for (auto it = pending_.begin(); it != pending_.end();) {
          Pending& p = *it;
          if (std::find(done_now.begin(), done_now.end(), &p) != done_now.end()) {
            finished.push_back(std::move(p));
            it = pending_.erase(it);
            continue;
          }
          if (!p.answered && (now >= p.deadline || stopping)) {
            p.answered = true;
            std::string why = expire(p);
            if (stopping) why = "the daemon is stopping; " + why;
            expired.emplace_back(std::move(p.done), std::move(why));
          }
          ++it;
        }
      }
      for (auto& [done, why] : expired) {
        log_.warn("gpu_operation_timeout", {{"reason", why}});
        if (done) done(Code::timeout, why);
      }
      for (auto& p : finished) {
        Code code = Code::ok;
        std::string message;
        if (!p.failure.empty()) {
          code = p.failure_code;
          message = p.failure;
        }
        p.spans.clear();
        p.syncs.clear();
        p.keep.reset();
        {
          std::lock_guard lock(mu_);
          for (auto& [dev, e] : p.events) devices_[dev].free_events.push_back(e);
        }
        if (!p.answered && p.done) p.done(code, message);
      }
      if (!finished.empty() || !expired.empty()) idle = 0;
      if (waiting && finished.empty()) {
        // Short operations finish within microseconds: yield first, then
        // back off so that a long or stuck one does not burn a core.
        ++idle;
        if (idle < 2000) {
          std::this_thread::yield();
        } else if (idle < 4000) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
    }
  }

  /// Drops buried CUDA resources, on a thread of its own: a release that
  /// waits for the GPU must not hold up the completion thread (which is what
  /// unblocks the GPU at a deadline).
  void reap_loop() {
    for (;;) {
      std::vector<std::shared_ptr<void>> dead;
      {
        std::unique_lock lock(graveyard_->mu);
        graveyard_->cv.wait(lock, [&] { return !graveyard_->open || !graveyard_->dead.empty(); });
        if (!graveyard_->open) return;
        dead = std::exchange(graveyard_->dead, {});
      }
      dead.clear();
    }
  }

  /// The deadline passed with `p` still on the GPU (under mu_): names the
  /// ranks whose input is not ready, then lets the daemon's streams past those
  /// inputs and releases every rank's stream from the CPU (outputs undefined).
  std::string expire(Pending& p) {
    std::string missing;
    for (std::size_t r = 0; r < p.syncs.size(); ++r) {
      auto* s = static_cast<Sync*>(p.syncs[r].get());
      if (s == nullptr || s->ready_reached()) continue;
      if (!missing.empty()) missing += ", ";
      missing += r < p.who.size() ? p.who[r] : "rank " + std::to_string(r);
    }
    for (auto& rs : p.syncs) {
      auto* s = static_cast<Sync*>(rs.get());
      if (s == nullptr) continue;
      s->release_ready();
      if (p.releases_done) s->release_done();
    }
    if (!p.failure.empty()) return p.failure;
    if (!missing.empty()) {
      return "timed out (deadlines.operation_ms) waiting for the input of " + missing +
             ": the work queued before the operation on its CUDA stream has not finished (a "
             "stuck kernel, or a stream waiting on something that never comes); the outputs are "
             "undefined and every rank's stream was released";
    }
    return "timed out (deadlines.operation_ms): every rank's input was ready, but the GPU did not "
           "finish the operation in time" + blocked_behind(p) +
           "; the outputs are undefined and every rank's stream was released";
  }

  /// What `p` waits behind on its streams (mu_ held): the operations queued
  /// there before it whose inputs are not all ready, naming the ranks.
  std::string blocked_behind(const Pending& p) const {
    std::string out;
    for (const Pending& q : pending_) {
      if (&q == &p) break;
      if (q.answered) continue;
      bool shared = false;
      for (const auto& s : q.streams) {
        shared = shared || std::find(p.streams.begin(), p.streams.end(), s) != p.streams.end();
      }
      if (!shared) continue;
      std::string missing;
      for (std::size_t r = 0; r < q.syncs.size(); ++r) {
        auto* s = static_cast<const Sync*>(q.syncs[r].get());
        if (s == nullptr || s->ready_reached()) continue;
        missing += (missing.empty() ? "" : ", ") + (r < q.who.size() ? q.who[r] : "rank " + std::to_string(r));
      }
      out += (out.empty() ? "" : "; ") + std::string("an operation of communicator ") + q.comm +
             (missing.empty() ? " whose GPU work has not finished"
                              : " still waiting for the input of " + missing);
    }
    return out.empty() ? "" : " (queued behind, on the daemon's stream: " + out + ")";
  }

  Logger& log_;
  const bool debug_sync_ = env_flag("COLLECTIVED_GPU_DEBUG_SYNC");
  // Bytes per rank up to which one GPU runs the whole operation (one-shot);
  // above, every GPU computes its share. COLLECTIVED_GPU_ONE_SHOT_BYTES overrides.
  const std::uint64_t one_shot_bytes_ = env_bytes("COLLECTIVED_GPU_ONE_SHOT_BYTES", 0);
  const bool one_shot_env_ = one_shot_bytes_ != 0;
  // Across nodes, operations of more than this many bytes per rank (count x
  // element size) are cut into chunks of it, so that the copies to and from
  // host memory overlap the exchange between nodes (0: never cut, the
  // default: what it gains depends on the host path between the daemons;
  // docs/gpu.md, "Pipelined"). Every daemon of a cluster must use the same
  // value (profile gpu.stage_chunk_bytes).
  const std::uint64_t stage_chunk_bytes_;
  // Copies from one GPU to another of at least this many bytes go to the
  // copy engines (cudaMemcpyAsync over the peer mapping) instead of the copy
  // kernel; 0: always the kernel (profile gpu.copy_engine_min_bytes).
  const std::uint64_t copy_engine_min_bytes_;
  // A broadcast split over this many GPUs or more takes two steps
  // (broadcast_step; profile gpu.two_step_min_gpus).
  const int two_step_min_gpus_;
  std::shared_ptr<CudaDriver> cu_;  // mappings hold it too: they may outlive the executor
  std::unique_ptr<MpsControl> mps_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  Clock::time_point stop_since_{};
  GpuStatus status_;
  std::vector<DeviceState> devices_;
  std::map<std::string, std::weak_ptr<Mapping>> legacy_cache_;
  std::shared_ptr<std::atomic<std::uint32_t>> other_mappings_ =
      std::make_shared<std::atomic<std::uint32_t>>(0);
  std::map<std::uint64_t, Session> sessions_;
  std::list<Pending> pending_;
  std::uint64_t generation_ = 0;  // operations queued so far (the completer's back-off)
  std::shared_ptr<Graveyard> graveyard_ = std::make_shared<Graveyard>();
  std::shared_ptr<PinnedPool> pinned_ = std::make_shared<PinnedPool>();
  std::thread completer_;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<GpuExecutor> make_gpu_executor(Logger& log, const GpuOptions& options) {
  return std::make_unique<CudaExecutor>(log, options);
}

}  // namespace collectived::engine::gpu

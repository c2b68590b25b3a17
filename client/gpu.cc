// libcollective's GPU side: registration of CUDA allocations with the daemon,
// the flag page the caller's streams wait on, pooled interprocess events, and
// the stream-ordered collectives (client/collective.h, GPU section).
//
// Only the CUDA driver API is used, loaded at run time (engine/gpu/cuda_driver.h):
// libcollective needs no CUDA toolkit to build and no driver to load.
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "client/client_internal.h"
#include "client/direct.h"
#include "client/gpu_extent.h"
#include "client/staging.h"
#include "engine/gpu/cuda_driver.h"
#include "ipc/stage_pieces.h"

using namespace collectived;
using namespace collectived::client;
namespace cu = collectived::engine::gpu::cu;
using collectived::engine::gpu::CudaDriver;
using collectived::engine::gpu::ScopedContext;

namespace collectived::client {

namespace {
// Words of the flag page: one per operation in flight at most; reused round
// robin. The page holds kFlagWords "done" words (the daemon writes them, the
// caller's stream waits) and then kFlagWords "ready" words (the caller's stream
// writes them, the daemon's stream waits).
constexpr std::uint32_t kFlagWords = 4096;
constexpr std::size_t kFlagPageBytes = 2 * kFlagWords * 4;

std::string ptr_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
}  // namespace

struct GpuRegistration {
  std::uint64_t handle = 0;
  std::uint64_t size = 0;
  /// The allocations it was made of (one; several for a buffer spanning
  /// virtual-memory allocations mapped back to back): each is checked for
  /// staleness by its own buffer id.
  std::vector<GpuPiece> pieces;
};


struct GpuState {
  std::unique_ptr<CudaDriver> cu;
  Connection* conn = nullptr;
  void* flags = nullptr;
  cu::DevicePtr flags_dev = 0;
  std::vector<std::uint32_t> tickets = std::vector<std::uint32_t>(kFlagWords, 0);
  std::uint64_t next_word = 0;
  std::map<std::uintptr_t, GpuRegistration> regs;  // by allocation base
  std::mutex tickets_mu;  // tickets[] between submitters and the watchdog
  std::atomic<bool> stop{false};
  std::thread watchdog;
  DirectPolicy direct;  // what the daemon allows (AttachedGpu)
  /// Across nodes, rank buffers up to this many bytes are staged here
  /// (AttachedGpu.clientStageMaxBytes; 0: by the daemon).
  std::uint64_t client_stage_max = 0;
  /// A staged reduce-scatter over two nodes may keep its own segment on the
  /// GPU (AttachedGpu.ownSegmentOnGpu).
  bool own_segment_on_gpu = false;

  /// If the daemon dies, nothing writes the flag words any more: release every
  /// stream still waiting, so that the application's GPU never hangs on us
  /// (its operations then fail with the connection's error).
  void watch(int fd) {
    watchdog = std::thread([this, fd] {
      while (!stop.load()) {
        pollfd p{fd, POLLRDHUP, 0};
        const int r = ::poll(&p, 1, 200);
        if (r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
          release_all();
          return;
        }
      }
    });
  }
  void release_all() {
    std::lock_guard lock(tickets_mu);
    for (std::uint32_t w = 0; w < kFlagWords; ++w) release(w, tickets[w]);
  }

  std::atomic<std::uint32_t>* word(std::uint32_t w) const {
    return reinterpret_cast<std::atomic<std::uint32_t>*>(flags) + w;
  }
  bool reached(std::uint32_t w, std::uint32_t ticket) const {
    return ipc::word_reached(word(w)->load(std::memory_order_acquire), ticket);
  }
  /// Moves a word forward to `ticket` from the CPU (never backwards).
  void release(std::uint32_t w, std::uint32_t ticket) const {
    auto* a = word(w);
    std::uint32_t cur = a->load(std::memory_order_relaxed);
    while (!ipc::word_reached(cur, ticket) &&
           !a->compare_exchange_weak(cur, ticket, std::memory_order_release)) {
    }
  }

  /// The staging kernels (ClientStaging::Kernels) by context, loaded when a
  /// communicator across nodes is made (gpu_comm_created), under gpu_mutex.
  /// Not at an operation: cuModuleLoadData may wait for work queued on the
  /// GPU, and a caller's stream may be waiting on something the caller does
  /// only after the call (gpu_test's late-input case hung in it).
  struct StageModule {
    std::unique_ptr<KernelModule> module;
    ClientStaging::Kernels kernels;
  };
  std::map<cu::Context, StageModule> stage_modules;  // destroyed before `cu`
  const ClientStaging::Kernels* stage_kernels(cu::Context ctx) const {
    auto it = stage_modules.find(ctx);
    return it == stage_modules.end() ? nullptr : &it->second.kernels;
  }

  ~GpuState() {
    stop = true;
    if (watchdog.joinable()) watchdog.join();
    if (flags == nullptr) return;
    // Nothing will write these words any more: release every stream still
    // waiting, so that a disconnect never leaves the application's GPU stuck.
    release_all();
    cu->cuMemHostUnregister(flags);
    ::munmap(flags, kFlagPageBytes);
  }
};

namespace {

/// The client's GPU state, made at first use: the driver, the flag page
/// registered with CUDA here and attached to the daemon.
std::shared_ptr<GpuState> gpu_state(collective_client_t* client) {
  std::lock_guard lock(client->gpu_mutex);
  if (client->gpu) return client->gpu;
  auto s = std::make_shared<GpuState>();
  s->cu = CudaDriver::load();
  s->conn = client->conn.get();
  const std::size_t bytes = kFlagPageBytes;
  UniqueFd fd(::memfd_create("collective-gpu-flags", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw Error(Code::system, std::string("memfd_create: ") + std::strerror(errno));
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    throw Error(Code::system, std::string("flag page memfd: ") + std::strerror(errno));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) throw Error(Code::system, std::string("mmap: ") + std::strerror(errno));
  const cu::Result r = s->cu->cuMemHostRegister(
      p, bytes, cu::kMemHostRegisterPortable | cu::kMemHostRegisterDeviceMap);
  if (r != cu::kSuccess) {
    ::munmap(p, bytes);
    s->cu->check(r, "cuMemHostRegister of the GPU flag page");
  }
  s->flags = p;  // from here the destructor cleans up
  s->cu->check(s->cu->cuMemHostGetDevicePointer(&s->flags_dev, p, 0), "cuMemHostGetDevicePointer");
  capnp::MallocMessageBuilder b;
  b.initRoot<wire::Message>().initAttachGpu().setBytes(bytes);
  const int fds[1] = {fd.get()};
  auto reply = client->conn->call(b, fds, Clock::now() + kControlTimeout);
  if (reply->message().isAttachedGpu()) {
    auto a = reply->message().getAttachedGpu();
    s->direct.allowed = a.getClientKernels();
    s->direct.reason = a.getReason().cStr();
    s->direct.max_bytes = a.getMaxBytes();
    // 0: a daemon older than the field; DirectPolicy's default stands.
    if (a.getTwoStepMinGpus() != 0) s->direct.two_step_min_ranks = static_cast<int>(a.getTwoStepMinGpus());
    s->direct.two_step_bytes = a.getTwoStepBytes();
    s->client_stage_max = a.getClientStageMaxBytes();
    s->own_segment_on_gpu = a.getOwnSegmentOnGpu();
  } else {
    s->direct.reason = "the daemon does not offer the client's kernels (an older collectived)";
  }
  s->watch(client->conn->socket_fd());
  client->gpu = s;
  return s;
}

}  // namespace

void gpu_comm_created(collective_comm_t* comm) noexcept {
  if (comm_nodes(comm) < 2 || direct_fatbin().empty()) return;
  // Only where the application uses CUDA already (the driver library is
  // loaded and a context current): a host-only application never starts
  // CUDA here.
  if (void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)) {
    ::dlclose(lib);
  } else {
    return;
  }
  try {
    collective_client_t* client = comm_client(comm);
    std::shared_ptr<GpuState> s;
    {
      std::lock_guard lock(client->gpu_mutex);
      s = client->gpu;
    }
    if (!s) {
      // The GPU state is made only with a context current (it registers its
      // flag page with CUDA): a driver of our own to ask first.
      std::unique_ptr<CudaDriver> cu = CudaDriver::load();
      cu::Context ctx = nullptr;
      if (cu->cuCtxGetCurrent(&ctx) != cu::kSuccess || ctx == nullptr) return;
      s = gpu_state(client);
    }
    if (s->client_stage_max == 0) return;  // the daemon stages everything
    const CudaDriver& cu = *s->cu;
    std::lock_guard lock(client->gpu_mutex);
    cu::Context ctx = nullptr;
    if (cu.cuCtxGetCurrent(&ctx) != cu::kSuccess || ctx == nullptr ||
        s->stage_modules.count(ctx) != 0)
      return;
    GpuState::StageModule m;
    m.module = KernelModule::load(cu);
    if (!m.module) return;
    m.kernels.in = m.module->function("collectived_stage_in");
    m.kernels.out = m.module->function("collectived_stage_out");
    if (m.kernels.in == nullptr || m.kernels.out == nullptr) return;
    m.kernels.reduce = m.module->function("collectived_stage_reduce");
    s->stage_modules.emplace(ctx, std::move(m));
  } catch (const std::exception&) {
    // No GPU state here (no driver, a daemon without GPUs): the copies serve.
  }
}

namespace {

/// Registers the allocation(s) under a buffer at `ptr` (state mutex held by
/// the caller): one whole allocation, or the virtual-memory allocations it
/// spans as one registration of several pieces, which the daemon maps back
/// to back into one range of its own (the frame carries at most
/// ipc::kMaxFdsPerFrame descriptors: several frames where there are more).
GpuRegistration& register_allocation(collective_client_t* client, GpuState& s, const void* ptr,
                                     const GpuExtent& a) {
  const CudaDriver& cu = *s.cu;
  const std::string where = "GPU memory at " + ptr_text(ptr);
  int ordinal = 0;
  cu.check(cu.cuPointerGetAttribute(&ordinal, cu::kPointerAttributeDeviceOrdinal,
                                    reinterpret_cast<cu::DevicePtr>(ptr)),
           where + ": device ordinal");
  cu::Device dev = 0;
  cu.check(cu.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  cu::Uuid uuid{};
  cu.check(cu.cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid");

  capnp::MallocMessageBuilder b;
  auto r = b.initRoot<wire::Message>().initRegisterGpu();
  r.setSize(a.size);
  r.setDeviceUuid(capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(uuid.bytes), 16));
  r.setBufferId(a.buffer_id());
  GpuRegistration reg;
  reg.size = a.size;
  reg.pieces = a.pieces;
  if (a.pieces.size() > 1) {
    // gpu_extent checked that every piece is virtual memory of this GPU.
    const auto n = static_cast<std::uint32_t>(a.pieces.size());
    r.setKind(wire::GpuMemoryKind::POSIX_FD);
    r.setPieceCount(n);
    for (std::uint32_t first = 0; first < n; first += ipc::kMaxFdsPerFrame) {
      const std::uint32_t count = std::min(n - first, ipc::kMaxFdsPerFrame);
      auto list = r.initPieces(count);
      std::vector<UniqueFd> owned;
      std::vector<int> fds;
      for (std::uint32_t i = 0; i < count; ++i) {
        const GpuPiece& p = a.pieces[first + i];
        list[i].setOffset(p.offset);
        list[i].setSize(p.size);
        owned.push_back(export_vmm_fd(cu, a.base + p.offset,
                                      where + " (allocation " + std::to_string(first + i + 1) + " of the " +
                                          std::to_string(n) + " it spans)"));
        fds.push_back(owned.back().get());
      }
      auto reply = client->conn->call(b, fds, Clock::now() + kControlTimeout);
      reg.handle = reply->message().getRegistered().getHandle();
      // Handle 0 until the last piece is in, a handle then.
      if ((reg.handle == 0) != (first + count < n)) {
        throw Error(Code::protocol, where + ": the daemon answered " + std::to_string(first + count) +
                                        " of " + std::to_string(n) + " pieces with handle " +
                                        std::to_string(reg.handle));
      }
    }
    return s.regs[a.base] = std::move(reg);
  }
  UniqueFd fd;
  void* pool = nullptr;
  cu.check(cu.cuPointerGetAttribute(&pool, cu::kPointerAttributeMempoolHandle,
                                    reinterpret_cast<cu::DevicePtr>(ptr)),
           where + ": memory pool");
  int legacy = 0;
  cu.check(cu.cuPointerGetAttribute(&legacy, cu::kPointerAttributeIsLegacyIpcCapable,
                                    reinterpret_cast<cu::DevicePtr>(ptr)),
           where + ": IPC capability");
  if (pool != nullptr) {
    // cudaMallocAsync: only a pool made shareable can be exported.
    int raw = -1;
    const cu::Result e = cu.cuMemPoolExportToShareableHandle(
        &raw, static_cast<cu::MemPool>(pool), cu::kMemHandleTypePosixFd, 0);
    if (e != cu::kSuccess) {
      throw Error(Code::invalid_argument,
                  where + " is stream-ordered pool memory (cudaMallocAsync) from a pool that "
                          "cannot be shared (" + cu.error_text(e) + "); the default pool never "
                          "can: allocate from a pool created with handleTypes = "
                          "cudaMemHandleTypePosixFileDescriptor, or with cudaMalloc");
    }
    fd.reset(raw);
    cu::MemPoolPtrExportData data{};
    cu.check(cu.cuMemPoolExportPointer(&data, a.base), where + ": cuMemPoolExportPointer");
    r.setKind(wire::GpuMemoryKind::POOL_FD);
    r.setHandle(capnp::Data::Reader(data.reserved, sizeof data.reserved));
  } else if (legacy != 0) {
    cu::IpcMemHandle h{};
    cu.check(cu.cuIpcGetMemHandle(&h, a.base), where + " (cudaMalloc memory): cuIpcGetMemHandle");
    r.setKind(wire::GpuMemoryKind::LEGACY_IPC);
    r.setHandle(capnp::Data::Reader(h.data, sizeof h.data));
  } else {
    // Virtual-memory allocation (cuMemCreate): export its physical memory as a
    // POSIX file descriptor, which travels by SCM_RIGHTS.
    fd = export_vmm_fd(cu, a.base, where);
    r.setKind(wire::GpuMemoryKind::POSIX_FD);
  }
  std::vector<int> fds;
  if (fd) fds.push_back(fd.get());
  auto reply = client->conn->call(b, fds, Clock::now() + kControlTimeout);
  reg.handle = reply->message().getRegistered().getHandle();
  return s.regs[a.base] = std::move(reg);
}

void deregister_handle(collective_client_t* client, std::uint64_t handle) {
  capnp::MallocMessageBuilder b;
  b.initRoot<wire::Message>().initDeregister().setHandle(handle);
  client->conn->call(b, {}, Clock::now() + kControlTimeout);
}

struct Located {
  std::uint64_t handle = 0, offset = 0, buffer_id = 0;
};

/// Checks that [ptr, ptr+bytes) is GPU memory inside one allocation, or
/// inside virtual-memory allocations mapped back to back (gpu_extent), and
/// drops this client's registration at the first one's base if the memory
/// there is not what it was made of any more (any piece's buffer id changed:
/// freed and allocated again, or unmapped and another allocation mapped in
/// its place), or if it is too short for this buffer: the daemon would
/// otherwise keep the freed memory mapped, or miss the rest. gpu_mutex held.
GpuExtent inspect_gpu(collective_client_t* client, GpuState& s, const void* ptr,
                      std::uint64_t bytes, const char* which) {
  const CudaDriver& cu = *s.cu;
  const auto p = reinterpret_cast<cu::DevicePtr>(ptr);
  unsigned type = 0;
  const cu::Result tr = cu.cuPointerGetAttribute(&type, cu::kPointerAttributeMemoryType, p);
  if (tr != cu::kSuccess || type != cu::kMemoryTypeDevice) {
    throw Error(Code::invalid_argument, std::string(which) + " buffer " + ptr_text(ptr) +
                                            " is not GPU memory the CUDA driver knows" +
                                            (tr != cu::kSuccess ? " (" + cu.error_text(tr) + ")" : ""));
  }
  GpuExtent a = gpu_extent(cu, p, bytes, which);
  auto it = s.regs.find(a.base);
  if (it != s.regs.end() && !gpu_pieces_current(cu, it->second.pieces, a)) {
    const std::uint64_t stale = it->second.handle;
    s.regs.erase(it);
    try {
      deregister_handle(client, stale);
    } catch (const Error&) {
      // Already gone on the daemon's side; nothing more to release.
    }
  }
  return a;
}

/// Handle and offset of [ptr, ptr+bytes), registering its allocation(s)
/// first if needed, and again if the memory there changed since.
Located locate_gpu(collective_client_t* client, GpuState& s, const void* ptr, std::uint64_t bytes,
                   const char* which) {
  const GpuExtent a = inspect_gpu(client, s, ptr, bytes, which);
  auto it = s.regs.find(a.base);
  GpuRegistration& reg = it != s.regs.end() ? it->second : register_allocation(client, s, ptr, a);
  return Located{reg.handle, reinterpret_cast<cu::DevicePtr>(ptr) - a.base, a.buffer_id()};
}

/// Two ranks on two nodes: a staged reduce-scatter may keep its own segment
/// on the GPU (where the daemon offers it, AttachedGpu.ownSegmentOnGpu).
bool two_nodes_one_rank_each(const collective_comm_t* comm) {
  return comm_nodes(comm) == 2 && collective_comm_size(comm) == 2;
}

/// [lo, hi) without [skip_lo, skip_hi): up to two ranges, in order (an
/// empty one has hi <= lo).
std::array<std::pair<std::uint64_t, std::uint64_t>, 2> around(std::uint64_t lo, std::uint64_t hi,
                                                               std::uint64_t skip_lo,
                                                               std::uint64_t skip_hi) {
  if (skip_hi <= skip_lo || skip_hi <= lo || hi <= skip_lo) return {{{lo, hi}, {hi, hi}}};
  return {{{lo, std::max(lo, skip_lo)}, {std::min(hi, skip_hi), hi}}};
}

class StreamSubmit final : public GpuSubmit {
 public:
  /// `staged`: the communicator's staging, where this client stages the
  /// operation itself (across nodes); null: the daemon reads the GPU buffers.
  /// `first_byte`: staged, the input byte the daemon's exchange reads first
  /// (its piece is copied first).
  /// `two_nodes`: staged, the communicator has two ranks on two nodes (node
  /// `node`): a reduce-scatter may keep its own segment on the GPU.
  StreamSubmit(collective_client_t* client, std::shared_ptr<GpuState> s, cu::Stream stream,
               CommGpu* staged = nullptr, std::uint64_t first_byte = 0, int rank = 0,
               bool two_nodes = false, int node = 0)
      : client_(client),
        s_(std::move(s)),
        stream_(stream),
        staged_(staged),
        first_byte_(first_byte),
        rank_(rank),
        two_nodes_(two_nodes),
        node_(node) {}

  void fill(wire::Collective::Builder c, const void* send, std::uint64_t send_bytes,
            const void* recv, std::uint64_t recv_bytes) override {
    GpuState& s = *s_;
    ScopedContext scope(*s.cu, lock_stream_context());
    if (staged_ != nullptr) {
      fill_staged(c, send, send_bytes, recv, recv_bytes);
      return;
    }
    Located snd, rcv;
    const auto sp = reinterpret_cast<std::uintptr_t>(send), rp = reinterpret_cast<std::uintptr_t>(recv);
    if (send_bytes > 0 && recv_bytes > 0 && sp < rp + recv_bytes && rp < sp + send_bytes) {
      // Overlapping (in place): one registration for both, also where they
      // start in different allocations of a range spanning several (an
      // in-place all-gather's input in a later chunk than its output): the
      // daemon knows the in-place layout only within one registration, and
      // two would be two mappings of the same memory.
      const std::uintptr_t lo = std::min(sp, rp), hi = std::max(sp + send_bytes, rp + recv_bytes);
      snd = rcv = locate_gpu(client_, s, reinterpret_cast<const void*>(lo), hi - lo, "send and recv");
      snd.offset += sp - lo;
      rcv.offset += rp - lo;
    } else {
      if (send_bytes > 0) snd = locate_gpu(client_, s, send, send_bytes, "send");
      if (recv_bytes > 0) rcv = locate_gpu(client_, s, recv, recv_bytes, "recv");
    }
    c.getSend().setHandle(snd.handle);
    c.getSend().setOffset(snd.offset);
    c.getRecv().setHandle(rcv.handle);
    c.getRecv().setOffset(rcv.offset);
    fill_sync(c.initGpu(), snd.buffer_id, rcv.buffer_id);
  }

  void fill_group(wire::P2PGroup::Builder g,
                  const std::vector<std::pair<const void*, std::uint64_t>>& bufs) override {
    GpuState& s = *s_;
    ScopedContext scope(*s.cu, lock_stream_context());
    auto items = g.getItems();
    for (unsigned i = 0; i < bufs.size(); ++i) {
      if (bufs[i].second == 0) continue;
      const Located at = locate_gpu(client_, s, bufs[i].first, bufs[i].second,
                                    items[i].getIsSend() ? "send" : "recv");
      items[i].getBuffer().setHandle(at.handle);
      items[i].getBuffer().setOffset(at.offset);
      items[i].setBufferId(at.buffer_id);
    }
    fill_sync(g.initGpu(), 0, 0);
  }

  /// Takes gpu_mutex (held until sent()) and returns the context of the
  /// caller's stream, which the registrations and stream writes run in.
  cu::Context lock_stream_context() {
    const CudaDriver& cu = *s_->cu;
    lock_ = std::unique_lock(client_->gpu_mutex);
    cu.check(cu.cuStreamGetCtx(stream_, &ctx_), "cuStreamGetCtx of the caller's stream");
    return ctx_;
  }

  /// Takes a flag word and ticket, marks the input ready on the caller's
  /// stream (the context is current, gpu_mutex held).
  void fill_sync(wire::GpuSync::Builder g, std::uint64_t send_id, std::uint64_t recv_id) {
    take_word(1);
    // The input is ready when the caller's stream gets here: it writes the
    // ticket to this operation's ready word, which the daemon's stream waits
    // for. (Not an interprocess event: a stream waiting on the event of a
    // client that dies never goes on; a ready word the daemon can write
    // itself when the client is gone.)
    mark_ready(ticket_);
    set_sync(g, send_id, recv_id);
  }

  /// Takes a flag word whose previous operation is done (4096 in flight at
  /// most) and `tickets` tickets of it: the operation's is the last, the
  /// ones before mark pieces of its input.
  void take_word(std::uint32_t tickets) {
    GpuState& s = *s_;
    word_ = static_cast<std::uint32_t>(s.next_word++ % kFlagWords);
    while (!s.reached(word_, s.tickets[word_])) sched_yield();
    std::lock_guard tl(s.tickets_mu);
    ticket_ = s.tickets[word_] += tickets;
  }
  /// The operation's ready word, as the GPU addresses it.
  cu::DevicePtr ready_word() const { return s_->flags_dev + 4 * (kFlagWords + word_); }
  /// The caller's stream writes `value` to the operation's ready word.
  void mark_ready(std::uint32_t value) {
    const CudaDriver& cu = *s_->cu;
    cu.check(cu.cuStreamWriteValue32(stream_, ready_word(), value, cu::kStreamWriteValueDefault),
             "cuStreamWriteValue32 (marking the input ready)");
  }
  void set_sync(wire::GpuSync::Builder g, std::uint64_t send_id, std::uint64_t recv_id) {
    g.setFlagWord(word_);
    g.setReadyWord(kFlagWords + word_);
    g.setTicket(ticket_);
    g.setSendBufferId(send_id);
    g.setRecvBufferId(recv_id);
  }

  void sent() override {
    const CudaDriver& cu = *s_->cu;
    ScopedContext scope(cu, ctx_);
    const cu::DevicePtr done = s_->flags_dev + 4 * word_;
    std::string what = "cuStreamWaitValue32 (the caller's stream waiting for the daemon)";
    cu::Result r = cu::kSuccess;
    try {
      if (staged_ == nullptr) {
        r = cu.cuStreamWaitValue32(stream_, done, ticket_, cu::kStreamWaitValueGeq);
      } else {
        r = copy_back(done, what);
      }
    } catch (const Error&) {
      lock_.unlock();
      throw;
    }
    lock_.unlock();
    cu.check(r, what);
  }

  std::function<void()> on_failure() override {
    return [s = s_, w = word_, t = ticket_] { s->release(w, t); };
  }

 private:
  /// Staged by the client: the daemon wrote each piece of the output into
  /// the staging before the done word reached its value (all of it by the
  /// ticket): the stream copies each back as soon as it is final, while the
  /// exchange goes on. gpu_mutex held, the stream's context current.
  cu::Result copy_back(cu::DevicePtr done, std::string& what) {
    const CudaDriver& cu = *s_->cu;
    const std::uint32_t k = out_pieces_;
    const ClientStaging::Kernels* kern = s_->stage_kernels(ctx_);
    cu::Result r = cu::kSuccess;
    for (std::uint32_t q = 0; q < k && r == cu::kSuccess; ++q) {
      r = cu.cuStreamWaitValue32(stream_, done, ipc::stage_piece_value(ticket_, k, q),
                                 cu::kStreamWaitValueGeq);
      const std::uint64_t at = q * out_piece_,
                          len = std::min(out_piece_, copy_bytes_ - std::min(at, copy_bytes_));
      if (r != cu::kSuccess || len == 0) continue;
      const auto dst = reinterpret_cast<cu::DevicePtr>(recv_) + at;
      if (own_on_gpu_) {
        // The other node's contribution, combined on the GPU with this
        // rank's own segment of the input.
        const std::uint64_t es = collective_dtype_size(static_cast<collective_dtype_t>(dtype_));
        staged_->staging->kernel_reduce(*kern, stream_, own_src_ + at, lease_.recv_dev + at, dst,
                                        len / es, dtype_, redop_, 2, node_ == 0);
      } else if (out_by_kernel_) {
        staged_->staging->kernel_out(*kern, stream_, lease_, dst, len);
      } else {
        // Around the rank's own block where the GPU has it already.
        for (const auto& [lo, hi] : around(at, at + len, own_lo_, own_hi_)) {
          if (hi <= lo || r != cu::kSuccess) continue;
          r = cu.cuMemcpyHtoDAsync(reinterpret_cast<cu::DevicePtr>(recv_) + lo, lease_.recv + lo,
                                   hi - lo, stream_);
        }
        what = "copy of the output from host staging (cuMemcpyHtoDAsync)";
      }
    }
    if (r == cu::kSuccess) staged_->staging->release(stream_);
    return r;
  }

  /// Staged by the client: the input goes to host staging on the caller's
  /// stream, then the ready word; the request names the staging (host
  /// registrations) and says so (GpuSync.clientStaged). gpu_mutex held, the
  /// stream's context current.
  void fill_staged(wire::Collective::Builder c, const void* send, std::uint64_t send_bytes,
                   const void* recv, std::uint64_t recv_bytes) {
    GpuState& s = *s_;
    const CudaDriver& cu = *s.cu;
    // The buffers as they are (no registration: the daemon never maps them),
    // but within their allocations.
    if (send_bytes > 0) inspect_gpu(client_, s, send, send_bytes, "send");
    if (recv_bytes > 0) inspect_gpu(client_, s, recv, recv_bytes, "recv");
    if (!staged_->staging) {
      staged_->staging = std::make_unique<ClientStaging>(
          client_, std::shared_ptr<const CudaDriver>(s_, s.cu.get()));
    }
    // All-reduce and broadcast in place on the host (one buffer): their
    // input is read once and their output has its size, so the host
    // collective copies nothing from one to the other.
    const auto kind = c.asReader().getKind();
    bool one = (kind == wire::OpKind::ALL_REDUCE || kind == wire::OpKind::BROADCAST) &&
               (send_bytes == 0 || send_bytes == recv_bytes);
    // An all-gather in place on the host too: the input is copied into its
    // rank's block of the output staging, so the daemon copies nothing into
    // its own block (it was a memcpy of the whole input per operation) and
    // that block is final from the start. Above the staging kernels' size
    // the stream does not copy the block back from the host either: it
    // copies it on the GPU (own_lo_ .. own_hi_, below).
    std::uint64_t send_at = 0;
    own_lo_ = own_hi_ = 0;
    const bool gather_in_place = kind == wire::OpKind::ALL_GATHER && send_bytes > 0 &&
                                 recv_bytes % send_bytes == 0 &&
                                 recv_bytes / send_bytes > static_cast<std::uint64_t>(rank_);
    if (gather_in_place) {
      one = true;
      send_at = static_cast<std::uint64_t>(rank_) * send_bytes;
    }
    {
      // The daemon sees only the staging: the layout check it makes of
      // buffers it maps (engine/validate.cc, check_overlap) is made here.
      const auto sp = reinterpret_cast<std::uintptr_t>(send),
                 rp = reinterpret_cast<std::uintptr_t>(recv);
      if (send_bytes > 0 && recv_bytes > 0 && sp < rp + recv_bytes && rp < sp + send_bytes) {
        const std::uint64_t per =
            c.asReader().getCount() *
            collective_dtype_size(static_cast<collective_dtype_t>(c.asReader().getDtype()));
        const auto rank = static_cast<std::uint64_t>(rank_);
        const bool in_place = kind == wire::OpKind::ALL_GATHER       ? sp == rp + rank * per
                              : kind == wire::OpKind::REDUCE_SCATTER ? rp == sp + rank * per
                                                                     : sp == rp;
        if (!in_place) {
          throw Error(Code::invalid_argument,
                      "send and recv buffers overlap but are not the in-place layout");
        }
      }
    }
    // The input in pieces, each marked ready on its own, so that the
    // daemon's exchange starts with the first (cut as the daemon cuts what it
    // stages).
    std::uint64_t piece = send_bytes;
    std::uint32_t pieces = 1, first = 0;
    if (send_bytes > ipc::kStagePieceMin) {
      piece = ipc::stage_piece_bytes(send_bytes);
      pieces = ipc::stage_piece_count(send_bytes, piece);
      first = static_cast<std::uint32_t>(std::min<std::uint64_t>(first_byte_ / piece, pieces - 1));
    }
    lease_ = staged_->staging->take(send_bytes, recv_bytes, one, stream_, send_at);
    if (send_bytes > 0) {
      c.getSend().setHandle(lease_.handle);
      c.getSend().setOffset(lease_.send_offset);
    }
    if (recv_bytes > 0) {
      c.getRecv().setHandle(lease_.handle);
      c.getRecv().setOffset(lease_.recv_offset);
    }
    recv_ = recv;
    copy_bytes_ = recv_bytes;
    out_piece_ = std::max<std::uint64_t>(recv_bytes, 1);
    out_pieces_ = 1;
    if (kind == wire::OpKind::BROADCAST && send_bytes != 0) {
      // The root's output is its input: copied on the GPU (nothing where
      // they are one buffer), not back from the host.
      copy_bytes_ = 0;
      if (recv_bytes != 0 && recv != send) {
        cu.check(cu.cuMemcpyDtoDAsync(reinterpret_cast<cu::DevicePtr>(recv),
                                      reinterpret_cast<cu::DevicePtr>(send), recv_bytes, stream_),
                 "copy of the broadcast root's input to its output (cuMemcpyDtoDAsync)");
      }
    } else if (recv_bytes > ipc::kStagePieceMin) {
      out_piece_ = ipc::stage_piece_bytes(recv_bytes);
      out_pieces_ = ipc::stage_piece_count(recv_bytes, out_piece_);
    }
    take_word(std::max(pieces, out_pieces_));
    const ClientStaging::Kernels* kern = s.stage_kernels(ctx_);
    // A reduce-scatter over two nodes: the rank's own segment stays on the
    // GPU. Its input is not staged (nor read by the daemon), and the stream
    // combines the other node's contribution with it there, instead of the
    // daemon reducing both on the CPU (docs/gpu.md, "Own segment on the GPU").
    own_on_gpu_ = kind == wire::OpKind::REDUCE_SCATTER && two_nodes_ && s.own_segment_on_gpu &&
                  kern != nullptr && kern->reduce != nullptr && recv_bytes > 0 &&
                  send_bytes == 2 * recv_bytes;
    std::uint64_t own_lo = 0, own_hi = 0;  // of the input: not staged
    if (own_on_gpu_) {
      own_lo = static_cast<std::uint64_t>(rank_) * recv_bytes;
      own_hi = own_lo + recv_bytes;
      own_src_ = reinterpret_cast<cu::DevicePtr>(send) + own_lo;
      dtype_ = c.asReader().getDtype();
      redop_ = c.asReader().getRedop();
    }
    // A small output (one piece) is copied back by a kernel: a launch costs
    // the stream less than a copy engine's transfer (ClientStaging::kKernelMaxBytes).
    out_by_kernel_ = !own_on_gpu_ && kern != nullptr && out_pieces_ == 1 &&
                     copy_bytes_ <= ClientStaging::kKernelMaxBytes;
    const bool k_in = kern != nullptr && pieces == 1 && send_bytes > 0 &&
                      send_bytes <= ClientStaging::kKernelMaxBytes;
    if (k_in) {
      staged_->staging->kernel_in(*kern, stream_, reinterpret_cast<cu::DevicePtr>(send), lease_,
                                  send_bytes, ready_word(), ticket_);
    }
    for (std::uint32_t q = 0; q < pieces && send_bytes > 0 && !k_in; ++q) {
      const std::uint64_t at = ((first + q) % pieces) * piece,
                          end = at + std::min(piece, send_bytes - at);
      // Around the own segment where it stays on the GPU.
      for (const auto& [lo, hi] : around(at, end, own_lo, own_hi)) {
        if (hi <= lo) continue;
        cu.check(cu.cuMemcpyDtoHAsync(lease_.send + lo, reinterpret_cast<cu::DevicePtr>(send) + lo,
                                      hi - lo, stream_),
                 "copy of the input to host staging (cuMemcpyDtoHAsync)");
      }
      mark_ready(ipc::stage_piece_value(ticket_, pieces, q));
    }
    if (send_bytes == 0) mark_ready(ticket_);
    if (gather_in_place && !out_by_kernel_) {
      // The rank's own block of the output, on the GPU: copied there from
      // the input (nothing where the caller's all-gather is in place), not
      // back from the host staging. The daemon's exchange goes on meanwhile.
      own_lo_ = send_at;
      own_hi_ = send_at + send_bytes;
      const auto dst = reinterpret_cast<cu::DevicePtr>(recv) + own_lo_,
                 src = reinterpret_cast<cu::DevicePtr>(send);
      if (dst != src) {
        cu.check(cu.cuMemcpyDtoDAsync(dst, src, send_bytes, stream_),
                 "copy of the rank's own block of the all-gather output (cuMemcpyDtoDAsync)");
      }
    }
    auto g = c.initGpu();
    set_sync(g, 0, 0);
    g.setClientStaged(true);
    g.setReadyPieces(pieces);
    g.setPieceBytes(piece);
    g.setPieceFirst(first);
    g.setOutPieces(out_pieces_);
    g.setOutPieceBytes(out_piece_);
    g.setOwnSegmentOnGpu(own_on_gpu_);
  }

  collective_client_t* client_;
  std::shared_ptr<GpuState> s_;
  cu::Stream stream_;
  CommGpu* staged_ = nullptr;
  std::uint64_t first_byte_ = 0;
  int rank_ = 0;
  bool two_nodes_ = false;
  int node_ = 0;
  // A reduce-scatter whose own segment stays on the GPU (fill_staged).
  bool own_on_gpu_ = false;
  cu::DevicePtr own_src_ = 0;
  std::uint8_t dtype_ = 0, redop_ = 0;
  bool out_by_kernel_ = false;  // the output is copied back by kernel_out
  ClientStaging::Lease lease_;
  const void* recv_ = nullptr;
  std::uint64_t copy_bytes_ = 0;  // of the output, copied back from the staging
  // An all-gather's own block of the output, copied on the GPU (not back).
  std::uint64_t own_lo_ = 0, own_hi_ = 0;
  std::uint64_t out_piece_ = 1;
  std::uint32_t out_pieces_ = 1;
  cu::Context ctx_ = nullptr;
  std::unique_lock<std::mutex> lock_;
  std::uint32_t word_ = 0, ticket_ = 0;
};

/// The communicator's client kernels, set up at its first stream-ordered
/// collective (a collective step: every rank is in the same call); null where
/// its operations go to the daemon.
DirectComm* direct_for(collective_comm_t* comm, const std::shared_ptr<GpuState>& s, void* stream) {
  CommGpu& g = comm_gpu(comm);
  if (g.state.load() == 2) return g.direct.get();
  std::lock_guard lock(g.mu);
  if (g.state.load() == 2) return g.direct.get();
  g.state = 1;
  const CudaDriver& cu = *s->cu;
  cu::Context ctx = nullptr;
  cu.check(cu.cuStreamGetCtx(static_cast<cu::Stream>(stream), &ctx), "cuStreamGetCtx of the caller's stream");
  std::string why;
  try {
    g.direct = DirectComm::setup(comm, std::shared_ptr<const CudaDriver>(s, s->cu.get()), ctx,
                                 s->direct, comm_client(comm)->conn->node_name(), why);
  } catch (const Error& e) {
    g.path = std::string("daemon: setting up the client's kernels failed: ") + e.what();
    g.state = 2;
    throw;
  }
  g.path = g.direct ? g.direct->description() : "daemon: " + why;
  if (comm_nodes(comm) > 1 && s->client_stage_max != 0) {
    bool kernels = false;
    {
      std::lock_guard l(comm_client(comm)->gpu_mutex);
      kernels = s->stage_kernels(ctx) != nullptr;
    }
    g.path +=
        "; up to " + std::to_string(s->client_stage_max) +
        " bytes per rank staged by this library" +
        (kernels
             ? " (up to " + std::to_string(ClientStaging::kKernelMaxBytes) +
                   " bytes by its staging kernels)"
             : " (by copy engines: no CUDA context was current when the communicator was made)");
    // Said where it holds: two nodes, one rank each, a daemon that offers it
    // and the kernels loaded (StreamSubmit::fill_staged).
    if (kernels && s->own_segment_on_gpu && two_nodes_one_rank_each(comm)) {
      g.path += "; a reduce-scatter keeps its own segment on the GPU (the daemon moves the other "
                "node's part only)";
    }
  }
  g.state = 2;
  return g.direct.get();
}

collective_result_t run_direct(collective_comm_t* comm, GpuState& s, DirectComm& d, direct::Kind kind,
                               const void* send, std::uint64_t send_bytes, void* recv,
                               std::uint64_t recv_bytes, std::size_t count,
                               collective_dtype_t dtype, collective_redop_t redop, int root,
                               void* stream, const char* name, collective_request_t** request) {
  if (request != nullptr) *request = nullptr;
  if (redop < COLLECTIVE_SUM || redop > COLLECTIVE_AVG) {
    return fail(Code::invalid_argument, std::string(name) + " on " + comm_where(comm) +
                                            ": unknown reduction " + std::to_string(redop));
  }
  if (root < 0 || root >= collective_comm_size(comm)) {
    return fail(Code::invalid_argument, std::string(name) + " on " + comm_where(comm) + ": root " +
                                            std::to_string(root) + " is not a rank");
  }
  const std::string what = std::string(name) + " on " + comm_where(comm);
  return guarded(name, [&] {
    try {
      {
        // The kernels take the buffers as they are (no registration), but
        // within their allocations.
        std::lock_guard lock(comm_client(comm)->gpu_mutex);
        if (send_bytes > 0) inspect_gpu(comm_client(comm), s, send, send_bytes, "send");
        if (recv_bytes > 0) inspect_gpu(comm_client(comm), s, recv, recv_bytes, "recv");
      }
      std::unique_ptr<LocalCompletion> done;
      if (count > 0) {
        done = d.run(kind, send, recv, count, static_cast<int>(dtype), static_cast<int>(redop), root,
                     static_cast<cu::Stream>(stream), request != nullptr, what);
      }
      if (request != nullptr) *request = new_local_request(comm, what, std::move(done));
    } catch (const Error& e) {
      throw Error(e.code(), "on " + comm_where(comm) + ": " + e.what());
    }
  });
}

collective_result_t stream_op(collective_comm_t* comm, wire::OpKind kind, const void* send,
                              std::uint64_t send_bytes, void* recv, std::uint64_t recv_bytes,
                              std::size_t count, collective_dtype_t dtype,
                              collective_redop_t redop, int root, void* stream, const char* name,
                              collective_request_t** request) {
  if (comm == nullptr) return fail(Code::invalid_argument, std::string(name) + ": comm must be set");
  std::shared_ptr<GpuState> s;
  const collective_result_t r = guarded(name, [&] { s = gpu_state(comm_client(comm)); });
  if (r != COLLECTIVE_OK) return r;
  // The client's own kernels, where every rank of the communicator owns one
  // GPU of this node (decided once, by every rank at the same operation).
  DirectComm* direct = nullptr;
  const collective_result_t dr = guarded(name, [&] { direct = direct_for(comm, s, stream); });
  if (dr != COLLECTIVE_OK) return dr;
  if (direct != nullptr) {
    const std::size_t es = collective_dtype_size(dtype);
    std::optional<direct::Kind> dk;
    switch (kind) {
      case wire::OpKind::ALL_REDUCE: dk = direct::kAllReduce; break;
      case wire::OpKind::REDUCE_SCATTER: dk = direct::kReduceScatter; break;
      case wire::OpKind::ALL_GATHER: dk = direct::kAllGather; break;
      case wire::OpKind::BROADCAST: dk = direct::kBroadcast; break;
      default: break;  // reduce, all-to-all: the daemon
    }
    // The same choice on every rank: it depends on the operation alone.
    if (dk && es != 0 && count * es <= direct->max_bytes()) {
      return run_direct(comm, *s, *direct, *dk, send, send_bytes, recv, recv_bytes, count, dtype, redop,
                        root, stream, name, request);
    }
  }
  // Across nodes, up to the daemon's limit: staged here, on the caller's
  // stream (the same choice on every rank of this node's daemon is not
  // needed: each rank's staging is its own).
  const std::uint64_t es = collective_dtype_size(dtype), one = count * es;
  const int nodes = comm_nodes(comm);
  // Each communicator keeps two blocks of an operation's input + output:
  // an all-gather or all-to-all over many ranks is left to the daemon's
  // staging (pooled per operation) beyond 8 x the limit.
  const bool staged = nodes > 1 && count > 0 && one != 0 && one <= s->client_stage_max &&
                      send_bytes + recv_bytes <= 8 * s->client_stage_max;
  // Where the daemon's exchange starts reading the input (its pairwise
  // all-reduce and reduce-scatter send the next node's segment first): that
  // piece is copied first.
  std::uint64_t first_byte = 0;
  if (staged && kind == wire::OpKind::ALL_REDUCE) {
    const auto j = static_cast<std::uint64_t>((comm_node(comm) + 1) % nodes),
               n = static_cast<std::uint64_t>(nodes);
    first_byte = (count / n * j + std::min<std::uint64_t>(j, count % n)) * es;
  } else if (staged && kind == wire::OpKind::REDUCE_SCATTER) {
    first_byte = static_cast<std::uint64_t>(comm_next_node_first_rank(comm)) * one;
  }
  StreamSubmit submit(comm_client(comm), s, static_cast<cu::Stream>(stream),
                      staged ? &comm_gpu(comm) : nullptr, first_byte, collective_comm_rank(comm),
                      two_nodes_one_rank_each(comm), comm_node(comm));
  return submit_gpu_collective(comm, kind, send, send_bytes, recv, recv_bytes, count, dtype, redop,
                               root, name, request, submit);
}

}  // namespace

bool is_gpu_pointer(collective_client_t* client, const void* ptr) {
  try {
    auto s = gpu_state(client);
    unsigned type = 0;
    return s->cu->cuPointerGetAttribute(&type, cu::kPointerAttributeMemoryType,
                                        reinterpret_cast<cu::DevicePtr>(ptr)) == cu::kSuccess &&
           type == cu::kMemoryTypeDevice;
  } catch (const Error&) {
    return false;  // no driver, no GPU
  }
}

namespace {

std::uint64_t elems(size_t count, collective_dtype_t dtype) {
  return count * collective_dtype_size(dtype);
}

}  // namespace
}  // namespace collectived::client

extern "C" {

collective_result_t collective_gpu_register(collective_client_t* client, const void* ptr,
                                            uint64_t* handle) {
  if (client == nullptr || ptr == nullptr) {
    return fail(Code::invalid_argument, "collective_gpu_register: client and ptr must be set");
  }
  return guarded("collective_gpu_register", [&] {
    auto s = gpu_state(client);
    std::lock_guard lock(client->gpu_mutex);
    cu::Context ctx = nullptr;
    s->cu->cuPointerGetAttribute(&ctx, cu::kPointerAttributeContext,
                                 reinterpret_cast<cu::DevicePtr>(ptr));
    ScopedContext scope(*s->cu, ctx);
    const Located l = locate_gpu(client, *s, ptr, 1, "GPU");
    if (handle != nullptr) *handle = l.handle;
  });
}

collective_result_t collective_gpu_deregister(collective_client_t* client, const void* ptr) {
  if (client == nullptr || ptr == nullptr) {
    return fail(Code::invalid_argument, "collective_gpu_deregister: client and ptr must be set");
  }
  return guarded("collective_gpu_deregister", [&] {
    auto s = gpu_state(client);
    std::vector<std::uint64_t> handles;
    {
      std::lock_guard lock(client->gpu_mutex);
      // Every registration holding it: registrations of buffers spanning
      // allocations mapped back to back may overlap (each is made from its
      // buffer's first allocation on).
      const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
      for (auto it = s->regs.begin(); it != s->regs.end() && it->first <= addr;) {
        if (addr < it->first + it->second.size) {
          handles.push_back(it->second.handle);
          it = s->regs.erase(it);
        } else {
          ++it;
        }
      }
      if (handles.empty()) throw Error(Code::not_found, "no registered GPU allocation holds " + ptr_text(ptr));
    }
    for (std::uint64_t h : handles) deregister_handle(client, h);
  });
}

collective_result_t collective_group_end_stream(collective_comm_t* comm, void* stream,
                                                collective_request_t** request) {
  const char* name = "collective_group_end_stream";
  if (comm == nullptr) return fail(Code::invalid_argument, std::string(name) + ": comm must be set");
  std::shared_ptr<GpuState> s;
  const collective_result_t r = guarded(name, [&] { s = gpu_state(comm_client(comm)); });
  if (r != COLLECTIVE_OK) {
    // The group is closed either way (as collective_group_end does on failure).
    submit_gpu_group(comm, nullptr, nullptr);
    return r;
  }
  StreamSubmit submit(comm_client(comm), s, static_cast<cu::Stream>(stream));
  return submit_gpu_group(comm, request, &submit);
}

collective_result_t collective_all_reduce_stream(collective_comm_t* comm, const void* send,
                                                 void* recv, size_t count,
                                                 collective_dtype_t dtype,
                                                 collective_redop_t redop, void* stream,
                                                 collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  return stream_op(comm, wire::OpKind::ALL_REDUCE, send, b, recv, b, count, dtype, redop, 0,
                   stream, "all_reduce", request);
}

collective_result_t collective_all_gather_stream(collective_comm_t* comm, const void* send,
                                                 void* recv, size_t count,
                                                 collective_dtype_t dtype, void* stream,
                                                 collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(collective_comm_size(comm)) : 0;
  return stream_op(comm, wire::OpKind::ALL_GATHER, send, b, recv, b * n, count, dtype,
                   COLLECTIVE_SUM, 0, stream, "all_gather", request);
}

collective_result_t collective_reduce_scatter_stream(collective_comm_t* comm, const void* send,
                                                     void* recv, size_t count,
                                                     collective_dtype_t dtype,
                                                     collective_redop_t redop, void* stream,
                                                     collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(collective_comm_size(comm)) : 0;
  return stream_op(comm, wire::OpKind::REDUCE_SCATTER, send, b * n, recv, b, count, dtype, redop,
                   0, stream, "reduce_scatter", request);
}

collective_result_t collective_broadcast_stream(collective_comm_t* comm, const void* send,
                                                void* recv, size_t count,
                                                collective_dtype_t dtype, int root, void* stream,
                                                collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  const bool is_root = comm != nullptr && collective_comm_rank(comm) == root;
  return stream_op(comm, wire::OpKind::BROADCAST, send, is_root ? b : 0, recv, b, count, dtype,
                   COLLECTIVE_SUM, root, stream, "broadcast", request);
}

collective_result_t collective_reduce_stream(collective_comm_t* comm, const void* send,
                                             void* recv, size_t count, collective_dtype_t dtype,
                                             collective_redop_t redop, int root, void* stream,
                                             collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  const bool is_root = comm != nullptr && collective_comm_rank(comm) == root;
  return stream_op(comm, wire::OpKind::REDUCE, send, b, recv, is_root ? b : 0, count, dtype, redop,
                   root, stream, "reduce", request);
}

collective_result_t collective_all_to_all_stream(collective_comm_t* comm, const void* send,
                                                 void* recv, size_t count,
                                                 collective_dtype_t dtype, void* stream,
                                                 collective_request_t** request) {
  const std::uint64_t b = elems(count, dtype);
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(collective_comm_size(comm)) : 0;
  return stream_op(comm, wire::OpKind::ALL_TO_ALL, send, b * n, recv, b * n, count, dtype,
                   COLLECTIVE_SUM, 0, stream, "all_to_all", request);
}

const char* collective_comm_gpu_path(collective_comm_t* comm) {
  if (comm == nullptr) return "no communicator";
  CommGpu& g = comm_gpu(comm);
  std::lock_guard lock(g.mu);
  return g.path.c_str();
}

collective_result_t collective_gpu_status(collective_client_t* client,
                                          collective_gpu_status_t* out) {
  if (client == nullptr || out == nullptr) {
    return fail(Code::invalid_argument, "collective_gpu_status: client and out must be set");
  }
  return guarded("collective_gpu_status", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initStatus();
    auto reply = client->conn->call(b, {}, Clock::now() + kControlTimeout);
    auto g = reply->message().getStatusReply().getGpu();
    *out = collective_gpu_status_t{};
    out->available = g.getAvailable() ? 1 : 0;
    copy_text(out->reason, sizeof out->reason, g.getReason().cStr());
    out->devices = g.getDevices().size();
    for (unsigned i = 0; i < g.getDevices().size() && i < 8; ++i) {
      copy_text(out->device_names[i], sizeof out->device_names[i], g.getDevices()[i].cStr());
    }
    copy_text(out->mps, sizeof out->mps, g.getMps().cStr());
    copy_text(out->mps_reason, sizeof out->mps_reason, g.getMpsReason().cStr());
    out->mappings = g.getMappings();
    out->mapped_bytes = g.getMappedBytes();
  });
}

}  // extern "C"

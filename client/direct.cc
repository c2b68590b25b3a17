// libcollective's own kernels on the caller's stream (client/direct.h).
#include "client/direct.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "client/client_internal.h"

namespace collectived::client {

namespace cu = gpu::cu;
using gpu::CudaDriver;
using gpu::ScopedContext;
using gpu::uuid_text;

namespace {

constexpr std::uint32_t kBlobMagic = 0x43444b32;  // "CDK2"
// Flag words first, then the data: the layout does not depend on the slot size.
constexpr std::uint64_t kFlagBytes = direct::flag_words * 8;
constexpr std::uint64_t kDataAt = (kFlagBytes + 255) / 256 * 256;
// Each block moves at least this much of a rank's block: small operations
// stay on one block (one flag exchange), large ones spread over kMaxBlocks.
// 32 KiB blocks, up to 128, beat 64 KiB ones (up to 64) from 256 KiB on;
// up to 256 blocks lost at 8-16 MiB (docs/gpu.md, "Measurements").
constexpr std::uint64_t kBytesPerBlock = 32 * 1024;

/// What each rank tells the others in each set-up round (through the broker, fixed size).
struct Blob {
  std::uint32_t magic;
  std::uint32_t want;  // 1: this rank can run the kernels
  std::uint32_t pid;
  std::uint64_t max_bytes;
  char node[64];
  char uuid[16];
  unsigned char handle[cu::kIpcHandleSize];  // cuIpcGetMemHandle of the scratch
  std::uint64_t two_step_bytes;               // gpu.two_step_bytes (0: never)
  std::uint32_t two_step_min_ranks;           // gpu.two_step_min_gpus
  char reason[164];                          // why not (want == 0)
};
static_assert(sizeof(Blob) == 344);

/// One round of the exchange through the daemon's broker (DirectJoin): every
/// rank's blob, or why the communicator's collectives go to the daemon.
/// Not an operation of the communicator: ranks on host memory never join.
std::vector<Blob> join(collective_comm_t* comm, std::uint32_t round, const Blob& mine,
                       std::string& declined) {
  Connection& conn = *comm_client(comm)->conn;
  capnp::MallocMessageBuilder b;
  auto j = b.initRoot<wire::Message>().initDirectJoin();
  j.setComm(comm_handle(comm));
  j.setRound(round);
  j.setBlob(capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(&mine), sizeof mine));
  // The broker answers by the operation deadline at the latest.
  auto reply = conn.call(b, {}, Clock::now() + conn.operation_deadline() + kDeadlineMargin);
  if (!reply->message().isDirectJoined()) {
    throw Error(Code::protocol, "DirectJoin on " + comm_where(comm) + ": unexpected answer from the daemon");
  }
  auto r = reply->message().getDirectJoined();
  declined = r.getDeclined().cStr();
  std::vector<Blob> all;
  if (!declined.empty()) return all;
  const auto n = static_cast<std::size_t>(collective_comm_size(comm));
  if (r.getBlobs().size() != n) {
    throw Error(Code::protocol, "DirectJoin on " + comm_where(comm) + ": " +
                                    std::to_string(r.getBlobs().size()) + " blobs for " +
                                    std::to_string(n) + " ranks");
  }
  all.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    auto d = r.getBlobs()[i];
    if (d.size() != sizeof(Blob)) {
      throw Error(Code::protocol, "DirectJoin on " + comm_where(comm) + ": rank " + std::to_string(i) +
                                      "'s blob has " + std::to_string(d.size()) + " bytes, not " +
                                      std::to_string(sizeof(Blob)));
    }
    std::memcpy(&all[i], d.begin(), sizeof(Blob));
  }
  return all;
}

/// The decision of step 1, the same on every rank: empty `why` where every
/// rank can run the kernels. Returns the slot size they agree on, and in
/// `two_step` the bytes per rank from which all-reduce and broadcast take two
/// steps (UINT64_MAX: never; the largest any rank's daemon asks for).
std::uint64_t decide(std::vector<Blob>& all, std::string& why, std::uint64_t& two_step) {
  const int n = static_cast<int>(all.size());
  std::uint64_t slot = UINT64_MAX;
  two_step = 0;
  for (const Blob& b : all) {
    const bool never = b.two_step_bytes == 0 || static_cast<std::uint64_t>(n) < b.two_step_min_ranks;
    two_step = std::max(two_step, never ? UINT64_MAX : b.two_step_bytes);
  }
  for (int r = 0; r < n && why.empty(); ++r) {
    Blob& b = all[static_cast<std::size_t>(r)];
    b.reason[sizeof b.reason - 1] = '\0';
    b.node[sizeof b.node - 1] = '\0';
    if (b.magic != kBlobMagic) {
      why = "rank " + std::to_string(r) + " runs another version of libcollective";
    } else if (b.want == 0) {
      why = "rank " + std::to_string(r) + ": " + b.reason;
    } else if (std::strncmp(b.node, all[0].node, sizeof b.node) != 0) {
      why = "ranks 0 and " + std::to_string(r) + " are on different nodes (" + all[0].node + ", " + b.node + ")";
    }
    for (int q = 0; q < r && why.empty(); ++q) {
      if (std::memcmp(all[static_cast<std::size_t>(q)].uuid, b.uuid, 16) == 0) {
        why = "ranks " + std::to_string(q) + " and " + std::to_string(r) + " share " +
              uuid_text(b.uuid) + " (processes sharing a GPU would time-slice it while waiting for each other)";
      }
    }
    slot = std::min<std::uint64_t>(slot, b.max_bytes);
  }
  return slot;
}

}  // namespace

struct DirectComm::Shared {
  std::shared_ptr<const CudaDriver> cu;
  cu::Context ctx = nullptr;
  cu::Module module = nullptr;
  cu::Function fn = nullptr;
  cu::DevicePtr scratch = 0;             // this rank's
  std::vector<cu::DevicePtr> mapped;     // every rank's scratch as mapped here (own: scratch)
  volatile unsigned long long* error = nullptr;  // host memory the kernels write
  cu::DevicePtr error_dev = 0;
  cu::Event chain = nullptr;             // the last operation's end
  std::mutex events_mu;
  std::vector<cu::Event> free_events;    // completions' events, reused
  std::vector<std::string> peers;        // "rank 1 (pid 123, GPU-..)"
  std::string where;                     // "communicator x (rank 0 of 2)"
  std::chrono::milliseconds timeout{30000};  // the node's deadlines.operation_ms
  /// collective_comm_set_timeout's values as run() met them: (first seq, ms;
  /// 0: the node's), appended when it changes, so that an error names the
  /// timeout its operation ran under.
  mutable std::mutex own_mu;
  std::vector<std::pair<std::uint64_t, std::int64_t>> own{{0, 0}};

  ~Shared() {
    try {
      ScopedContext scope(*cu, ctx);
      if (chain != nullptr) {
        cu->cuEventSynchronize(chain);  // kernels end by the deadline at worst
        cu->cuEventDestroy(chain);
      }
      for (cu::Event e : free_events) cu->cuEventDestroy(e);
      for (std::size_t r = 0; r < mapped.size(); ++r) {
        if (mapped[r] != 0 && mapped[r] != scratch) cu->cuIpcCloseMemHandle(mapped[r]);
      }
      if (scratch != 0) cu->cuMemFree(scratch);
      if (error != nullptr) cu->cuMemFreeHost(const_cast<unsigned long long*>(error));
      if (module != nullptr) cu->cuModuleUnload(module);
    } catch (const Error&) {
      // No context any more (the process is tearing CUDA down): nothing to free.
    }
  }

  cu::Event take_event() {
    {
      std::lock_guard lock(events_mu);
      if (!free_events.empty()) {
        cu::Event e = free_events.back();
        free_events.pop_back();
        return e;
      }
    }
    cu::Event e = nullptr;
    cu->check(cu->cuEventCreate(&e, cu::kEventDisableTiming), "cuEventCreate");
    return e;
  }
  void give_event(cu::Event e) {
    std::lock_guard lock(events_mu);
    free_events.push_back(e);
  }

  /// The failure recorded by the kernels, for operation `seq` (empty: none).
  std::string failure(std::uint64_t seq) const {
    const unsigned long long e = *error;
    if (e == 0 || (e >> 8) > seq) return {};
    const auto peer = static_cast<std::size_t>(e & 0xff) - 1;
    std::int64_t ms = 0;
    {
      std::lock_guard lock(own_mu);
      for (const auto& [from, t] : own) {
        if (from <= (e >> 8)) ms = t;
      }
    }
    const std::string node = std::to_string(timeout.count());
    const std::string within =
        ms > 0 ? std::to_string(ms) +
                     " ms (the communicator's timeout, collective_comm_set_timeout; "
                     "deadlines.operation_ms is " + node + ")"
               : node + " ms (deadlines.operation_ms)";
    return (peer < peers.size() ? peers[peer] : "rank " + std::to_string(peer)) +
           " did not reach operation " + std::to_string(e >> 8) + " within " + within +
           ": its process may have died or stopped calling collectives on " + where +
           ", which is unusable now (destroy it)";
  }
};

namespace {

class Completion final : public LocalCompletion {
 public:
  Completion(std::shared_ptr<DirectComm::Shared> s, cu::Event e, std::uint64_t seq, std::string what)
      : s_(std::move(s)), event_(e), seq_(seq), what_(std::move(what)) {}
  ~Completion() override {
    // An event may be recorded again while pending: it can go back at once.
    if (event_ != nullptr) s_->give_event(event_);
  }
  bool poll(std::chrono::milliseconds timeout, Code& code, std::string& message) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (unsigned spins = 0;; ++spins) {
      const cu::Result r = s_->cu->cuEventQuery(event_);
      if (r == cu::kSuccess) break;
      if (r != cu::kErrorNotReady) {
        code = Code::system;
        message = what_ + ": the GPU failed: " + s_->cu->error_text(r);
        return true;
      }
      if (std::chrono::steady_clock::now() >= until) return false;
      // Yield while the operation is likely short, then stop costing a core.
      if (spins < 2000) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spins < 20000 ? 50 : 1000));
      }
    }
    const std::string f = s_->failure(seq_);
    code = f.empty() ? Code::ok : Code::timeout;
    message = f.empty() ? "" : what_ + ": " + f;
    return true;
  }

 private:
  std::shared_ptr<DirectComm::Shared> s_;
  cu::Event event_;
  std::uint64_t seq_;
  std::string what_;
};

}  // namespace

std::unique_ptr<DirectComm> DirectComm::setup(collective_comm_t* comm,
                                              std::shared_ptr<const CudaDriver> driver,
                                              cu::Context ctx, const DirectPolicy& policy,
                                              const std::string& node, std::string& why) {
  const CudaDriver& cu = *driver;
  const int rank = collective_comm_rank(comm), n = collective_comm_size(comm);
  ScopedContext scope(cu, ctx);
  std::unique_ptr<DirectComm> d(new DirectComm);
  d->comm_ = comm;
  d->rank_ = rank;
  d->nranks_ = n;
  d->shared_ = std::make_shared<Shared>();
  Shared& s = *d->shared_;
  s.cu = std::move(driver);
  s.ctx = ctx;
  s.where = comm_where(comm);
  s.timeout = comm_client(comm)->conn->operation_deadline();

  // Step 1, nothing made yet (a communicator that will not use the kernels
  // makes no CUDA call here that could wait for the GPU): who is where, and
  // who may.
  Blob mine{};
  mine.magic = kBlobMagic;
  mine.pid = static_cast<std::uint32_t>(::getpid());
  mine.max_bytes = (policy.max_bytes + 255) / 256 * 256;
  mine.two_step_bytes = policy.two_step_bytes;
  mine.two_step_min_ranks = static_cast<std::uint32_t>(policy.two_step_min_ranks);
  copy_text(mine.node, sizeof mine.node, node.c_str());
  cu::Device dev = 0;
  cu.check(cu.cuCtxGetDevice(&dev), "cuCtxGetDevice");
  cu::Uuid uuid{};
  cu.check(cu.cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid");
  std::memcpy(mine.uuid, uuid.bytes, 16);
  std::string no;
  if (!policy.allowed) {
    no = policy.reason;
  } else if (direct_fatbin().empty()) {
    no = "libcollective was built without CUDA, so without its kernels";
  } else if (n < 2 || n > direct::kMaxRanks) {
    no = std::to_string(n) + " ranks (the client's kernels take 2 to " +
         std::to_string(direct::kMaxRanks) + ")";
  }
  mine.want = no.empty() ? 1 : 0;
  copy_text(mine.reason, sizeof mine.reason, no.c_str());
  std::vector<Blob> all = join(comm, 1, mine, why);
  if (!why.empty()) return nullptr;
  std::uint64_t two_step = UINT64_MAX;
  const std::uint64_t slot = decide(all, why, two_step);
  if (!why.empty()) return nullptr;
  for (int r = 0; r < n; ++r) {
    const Blob& b = all[static_cast<std::size_t>(r)];
    s.peers.push_back("rank " + std::to_string(r) + " (pid " + std::to_string(b.pid) + ", " +
                      uuid_text(b.uuid) + ")");
  }

  // Step 2: the kernels, the scratch and its handle. (cuModuleLoadData and
  // the allocations may wait for work queued on this GPU: the first
  // stream-ordered collective of such a communicator may block its caller
  // until the GPU is idle, as NCCL's first collective does.)
  no.clear();
  try {
    const auto fat = direct_fatbin();
    cu.check(cu.cuModuleLoadData(&s.module, fat.data()), "cuModuleLoadData (libcollective's kernels)");
    cu.check(cu.cuModuleGetFunction(&s.fn, s.module, "collectived_direct"), "cuModuleGetFunction");
    // Whole 2 MiB pages: a smaller cuMemAlloc may share its page with the
    // application's buffers, and the peers' IPC mapping of it would then
    // cover those too (the daemon later failed to map one of them as
    // "already mapped" in a run with 24 KiB of scratch).
    constexpr std::uint64_t kPage = 2u << 20;
    const std::uint64_t bytes =
        (kDataAt + direct::kSlots * static_cast<std::uint64_t>(n) * slot + kPage - 1) / kPage * kPage;
    cu.check(cu.cuMemAlloc(&s.scratch, bytes), "cuMemAlloc of " + std::to_string(bytes) + " bytes of scratch");
    // The flags start at 0, before any peer can see the handle.
    cu.check(cu.cuMemsetD8(s.scratch, 0, kFlagBytes), "cuMemsetD8 (flags)");
    cu.check(cu.cuStreamSynchronize(nullptr), "cuStreamSynchronize");
    cu::IpcMemHandle h{};
    cu.check(cu.cuIpcGetMemHandle(&h, s.scratch), "cuIpcGetMemHandle of the scratch");
    std::memcpy(mine.handle, h.data, sizeof h.data);
    void* host = nullptr;
    cu.check(cu.cuMemHostAlloc(&host, 64, cu::kMemHostAllocPortable | cu::kMemHostAllocDeviceMap),
             "cuMemHostAlloc (error word)");
    s.error = static_cast<volatile unsigned long long*>(host);
    *s.error = 0;
    cu.check(cu.cuMemHostGetDevicePointer(&s.error_dev, host, 0), "cuMemHostGetDevicePointer");
    cu.check(cu.cuEventCreate(&s.chain, cu::kEventDisableTiming), "cuEventCreate");
  } catch (const Error& e) {
    no = e.what();
  }
  mine.want = no.empty() ? 1 : 0;
  copy_text(mine.reason, sizeof mine.reason, no.c_str());
  all = join(comm, 2, mine, why);
  for (int r = 0; r < n && why.empty(); ++r) {
    Blob& b = all[static_cast<std::size_t>(r)];
    b.reason[sizeof b.reason - 1] = '\0';
    if (b.want == 0) why = "rank " + std::to_string(r) + ": " + b.reason;
  }
  if (!why.empty()) return nullptr;  // Shared's destructor releases what was made

  // Step 3: map every peer's scratch; all ranks must succeed.
  std::int32_t ok = 1;
  std::string local;
  s.mapped.assign(static_cast<std::size_t>(n), 0);
  for (int r = 0; r < n; ++r) {
    if (r == rank) {
      s.mapped[static_cast<std::size_t>(r)] = s.scratch;
      continue;
    }
    cu::IpcMemHandle h{};
    std::memcpy(h.data, all[static_cast<std::size_t>(r)].handle, sizeof h.data);
    const cu::Result res = cu.cuIpcOpenMemHandle(&s.mapped[static_cast<std::size_t>(r)], h,
                                                cu::kIpcMemLazyEnablePeerAccess);
    if (res != cu::kSuccess) {
      s.mapped[static_cast<std::size_t>(r)] = 0;
      ok = 0;
      local = "rank " + std::to_string(rank) + " could not map the scratch of " +
              s.peers[static_cast<std::size_t>(r)] + ": cuIpcOpenMemHandle: " + cu.error_text(res);
      break;
    }
  }
  mine.want = static_cast<std::uint32_t>(ok);
  copy_text(mine.reason, sizeof mine.reason, local.c_str());
  all = join(comm, 3, mine, why);
  if (!why.empty()) return nullptr;
  bool all_ok = true;
  for (const Blob& b : all) all_ok = all_ok && b.want != 0;
  if (!all_ok) {
    why = !local.empty() ? local
                         : "a rank could not map its peers' scratch (over NVLink or PCIe peer "
                           "access; that rank's error says why)";
    return nullptr;
  }
  d->slot_bytes_ = slot;
  d->two_step_bytes_ = two_step;
  d->description_ = "client kernels: " + std::to_string(n) + " ranks on " + std::to_string(n) +
                    " GPUs of node " + std::string(all[0].node) + ", up to " +
                    std::to_string(slot) + " bytes per rank" +
                    (two_step == UINT64_MAX ? std::string()
                                            : ", all-reduce and broadcast in two steps from " +
                                                  std::to_string(two_step) + " bytes");
  return d;
}

DirectComm::~DirectComm() = default;

void DirectComm::check_error_word() {
  const std::string f = shared_->failure(UINT64_MAX);
  if (!f.empty()) throw Error(Code::timeout, f);
}

std::unique_ptr<LocalCompletion> DirectComm::run(direct::Kind kind, const void* send, void* recv,
                                                 std::uint64_t count, int dtype, int redop,
                                                 int root, cu::Stream stream, bool completion,
                                                 const std::string& what) {
  Shared& s = *shared_;
  const CudaDriver& cu = *s.cu;
  std::lock_guard lock(mu_);
  check_error_word();
  ScopedContext scope(cu, s.ctx);
  cu::Context sctx = nullptr;
  cu.check(cu.cuStreamGetCtx(stream, &sctx), "cuStreamGetCtx of the caller's stream");
  if (sctx != s.ctx) {
    throw Error(Code::invalid_usage, "the stream belongs to another CUDA context than the one " +
                                         s.where + " was set up in (one GPU per rank)");
  }
  direct::Args a{};
  a.send = send;
  a.recv = recv;
  for (int r = 0; r < nranks_; ++r) {
    const cu::DevicePtr base = s.mapped[static_cast<std::size_t>(r)];
    a.flags[r] = reinterpret_cast<unsigned long long*>(base);
    a.data[r] = reinterpret_cast<char*>(base + kDataAt);
  }
  a.error = reinterpret_cast<unsigned long long*>(s.error_dev);
  a.seq = ++seq_;
  // The rank's own timeout (collective_comm_set_timeout) bounds its kernel's
  // wait for each peer, as the node's deadlines.operation_ms does otherwise.
  const std::int64_t own = collective_comm_timeout(comm_);
  {
    std::lock_guard own_lock(s.own_mu);
    if (s.own.back().second != own) s.own.emplace_back(a.seq, own);
  }
  const std::chrono::milliseconds timeout = own > 0 ? std::chrono::milliseconds(own) : s.timeout;
  a.timeout_ns = static_cast<unsigned long long>(timeout.count()) * 1000000ull;
  a.count = count;
  a.slot_bytes = slot_bytes_;
  a.two_step_bytes = two_step_bytes_;
  a.kind = kind;
  a.dtype = dtype;
  a.redop = redop;
  a.rank = rank_;
  a.nranks = nranks_;
  a.root = root;
  // The grid depends on the operation alone, the same on every rank.
  const std::uint64_t bytes = count * collective_dtype_size(static_cast<collective_dtype_t>(dtype));
  const auto grid = static_cast<unsigned>(
      std::clamp<std::uint64_t>((bytes + kBytesPerBlock - 1) / kBytesPerBlock, 1, direct::kMaxBlocks));
  // One kernel of this communicator at a time, in order, whatever streams
  // the caller uses: the slots' reuse depends on it (direct_abi.h).
  if (last_stream_ != nullptr && last_stream_ != stream) {
    cu.check(cu.cuStreamWaitEvent(stream, s.chain, 0), "cuStreamWaitEvent (previous operation)");
  }
  void* params[] = {&a};
  const cu::Result lr =
      cu.cuLaunchKernel(s.fn, grid, 1, 1, direct::kThreads, 1, 1, 0, stream, params, nullptr);
  if (lr != cu::kSuccess) {
    // The peers wait for this operation's flags until their deadline.
    *s.error = (a.seq << 8) | static_cast<unsigned long long>(rank_ + 1);
    cu.check(lr, "cuLaunchKernel (libcollective's kernel)");
  }
  cu.check(cu.cuEventRecord(s.chain, stream), "cuEventRecord");
  last_stream_ = stream;
  if (!completion) return nullptr;
  cu::Event e = s.take_event();
  const cu::Result er = cu.cuEventRecord(e, stream);
  if (er != cu::kSuccess) {
    s.give_event(e);
    cu.check(er, "cuEventRecord");
  }
  return std::make_unique<Completion>(shared_, e, a.seq, what);
}

}  // namespace collectived::client

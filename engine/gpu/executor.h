// The engine's view of GPUs: registration of client GPU memory and execution
// of matched collectives on GPU buffers. No CUDA types here: the engine builds
// without CUDA, and the daemon is handed an implementation (engine/gpu/runtime.cc
// with CUDA, runtime_none.cc without) by main().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "engine/op.h"
#include "engine/registry.h"
#include "ipc/error.h"
#include "ipc/fd.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine {
class Logger;
}

namespace collectived::engine::gpu {

/// How the client exported an allocation.
enum class MemoryKind : std::uint8_t {
  legacy_ipc = 0,  ///< cudaMalloc: cuIpcGetMemHandle of the allocation's base
  posix_fd = 1,    ///< cuMemCreate (VMM): cuMemExportToShareableHandle, fd by SCM_RIGHTS
  pool_fd = 2,     ///< cudaMallocAsync from a shareable pool: pool fd + exported pointer
};

/// One allocation of a posix_fd registration made of several (a buffer
/// spanning cuMemCreate allocations mapped back to back: PyTorch's
/// expandable segments).
struct VmmPiece {
  UniqueFd fd;
  std::uint64_t offset = 0;  ///< from the registration's base
  std::uint64_t size = 0;    ///< the allocation's bytes, mapped whole
};

/// One RegisterGpu request, as the daemon received it.
struct GpuRegisterArgs {
  MemoryKind kind = MemoryKind::legacy_ipc;
  std::string handle;       ///< 64 bytes: IPC handle or pool pointer export data
  std::uint64_t size = 0;   ///< bytes from the allocation's base (all pieces')
  std::string device_uuid;  ///< 16 bytes
  std::uint64_t buffer_id = 0;  ///< CU_POINTER_ATTRIBUTE_BUFFER_ID in the client
  UniqueFd fd;              ///< posix_fd / pool_fd
  /// posix_fd of several allocations: this request's pieces, in order (the
  /// next ones of the registration), and how many it has in all. 0: one
  /// allocation, `fd`.
  std::vector<VmmPiece> pieces;
  std::uint32_t piece_count = 0;
};

/// One rank's stream hand-off for one operation (opened IPC event, flag
/// word). Made by the executor from the request; the engine only carries it.
/// Destroying one whose operation never ran on the GPU releases the client's
/// stream anyway (its flag is written from the CPU), so that a failed or
/// refused operation never leaves a client stream waiting forever.
class RankSync {
 public:
  virtual ~RankSync() = default;
  std::uint64_t send_buffer_id = 0;  ///< the client's buffer ids at submission (stale check)
  std::uint64_t recv_buffer_id = 0;
  /// Staged by the client (GpuSyncArgs::client_staged): the operation's
  /// buffers are host memory the client registered, which its stream filled
  /// before the ready word and reads back after the done word.
  bool client_staged = false;
  /// Staged by the client, a reduce-scatter whose own segment the client
  /// combines on its GPU (GpuSyncArgs::own_segment_on_gpu).
  bool own_segment_on_gpu = false;
};

/// The wire's GpuSync fields.
struct GpuSyncArgs {
  std::string event_handle;  ///< 64 bytes
  std::uint32_t event_id = 0;
  std::uint32_t flag_word = 0;
  std::uint32_t ticket = 0;
  std::uint32_t ready_word = 0;  ///< used when event_handle is empty
  /// Across nodes: the client copies the input to host buffers of its own
  /// (the operation's send/recv) before the ready word and the output back
  /// after the done word; the executor only waits for the one and writes the
  /// other, from the CPU.
  bool client_staged = false;
  /// Staged by the client in pieces: its stream writes ticket - (pieces - 1)
  /// + q to the ready word once piece q (bytes [q * piece_bytes, ...) of the
  /// input) is in host memory. 1: one piece.
  std::uint32_t ready_pieces = 1;
  std::uint64_t piece_bytes = 0;
  std::uint32_t piece_first = 0;  ///< copied from this piece on, wrapping around
  /// The client copies the output back in pieces: piece q once the done
  /// word reaches ticket - (out_pieces - 1) + q. 1: once, at the ticket.
  std::uint32_t out_pieces = 1;
  std::uint64_t out_piece_bytes = 0;
  /// Staged by the client, a reduce-scatter over two nodes: the client did
  /// not stage its own segment of the input, and combines the other node's
  /// contribution (the output the daemon writes) with it on the GPU
  /// (engine::NodeCollective::own_contribution_elsewhere).
  bool own_segment_on_gpu = false;
  std::uint64_t send_buffer_id = 0;
  std::uint64_t recv_buffer_id = 0;
};

/// A matched collective on GPU buffers, per rank by index.
struct GpuCollective {
  std::string comm;  ///< communicator name (messages, stream choice)
  std::uint64_t seq = 0;
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  RedOp redop = RedOp::sum;
  std::uint64_t count = 0;
  int root = 0;
  std::vector<Span> send, recv;
  /// Null for ranks on other nodes (staged operations).
  std::vector<std::shared_ptr<RankSync>> sync;
  /// "rank r (pid P ...)" per rank: failures name the rank whose input never came.
  std::vector<std::string> who;
  /// The operation's deadline: past it the executor answers with an error
  /// naming the ranks whose input is not ready, releases the ranks' streams
  /// from the CPU, and never waits on the GPU from the engine's threads.
  Clock::time_point deadline = Clock::time_point::max();
  /// Leave the ranks' done words alone: a send/recv group's stream is
  /// released once, from the CPU, when the last holder of its RankSync drops
  /// it (after every item's GPU work). Used with kind p2p: run() copies
  /// send[0] to recv[1]; stage_in/stage_out stage one item of one rank.
  bool hold = false;
  /// Across nodes (stage_in): copy each rank's input to the host in pieces
  /// of about this many bytes (one, where the input is no larger), answer
  /// `ready` once the first piece of every rank is in, and tell GpuStage::in
  /// as each piece is in; the engine's host collective runs from stage_in on
  /// and waits for each piece before it reads it. 0: whole inputs before
  /// `ready`, and no GpuStage::in.
  std::uint64_t in_piece_bytes = 0;
  /// The pieces are copied from the one that holds this byte of the input
  /// on, wrapping around: the order in which the host collective reads them
  /// (first_input_read).
  std::uint64_t in_first_byte = 0;
};

/// A staged operation's inputs arriving in pieces (GpuCollective::
/// in_piece_bytes): piece k of each local rank's input staging is bytes
/// [k * piece, (k + 1) * piece). They are copied in the order first,
/// first + 1, ... (mod count). Written by the executor's completion thread,
/// read by the thread that runs the host collective.
struct InPieces {
  std::uint64_t piece = 0;
  std::uint32_t count = 0;
  std::uint32_t first = 0;
  /// The first `reached` pieces in copy order are in host memory in every
  /// rank's staging. 0 until the first is: until then the ranks' streams
  /// may not have reached the operation, and nothing may be written to
  /// their GPU buffers (stage_out_early).
  std::atomic<std::uint32_t> reached{0};
  /// How many pieces, in copy order, must be in for bytes [from, to) to be.
  std::uint32_t needed(std::uint64_t from, std::uint64_t to) const {
    std::uint32_t n = 0;
    for (std::uint64_t k = from / piece; k * piece < to && k < count; ++k) {
      n = std::max(n, static_cast<std::uint32_t>((k + count - first) % count) + 1);
    }
    return n;
  }
  /// Set where a piece failed (deadline, GPU error): the operation fails.
  std::atomic<bool> failed{false};

  /// Called once the first k + 1 pieces in copy order are in, or with the error.
  void arrived(std::uint32_t k, Code code, const std::string& why) {
    std::function<void()> w;
    {
      std::lock_guard lock(mu_);
      if (code != Code::ok) {
        if (!failed.load()) {
          code_ = code;
          why_ = why;
          failed.store(true, std::memory_order_release);
        }
      } else if (k + 1 > reached.load()) {
        reached.store(k + 1, std::memory_order_release);
      }
      w = wake_;
    }
    if (w) w();
  }
  /// A client's ready word: the value its stream writes there once a piece
  /// of its input is in host memory.
  struct ReadyMark {
    const std::atomic<std::uint32_t>* word = nullptr;
    std::uint32_t value = 0;
    /// Set (before it writes the word) where the daemon released the word
    /// itself, for a client that died or a deadline that passed: the value
    /// then says nothing of the input, and the completion thread reports
    /// the failure. Null: never.
    const std::atomic<bool>* forced = nullptr;
  };
  /// Where every local rank stages its input itself (GpuSync.clientStaged):
  /// per piece in copy order, the ranks' ready marks. Empty otherwise (the
  /// daemon's own copies: only the completion thread knows). The words are
  /// mapped while the operation runs (its rank syncs hold their flag pages,
  /// which are released off the event loop): poll() only then. Holding the
  /// pages here would let the last of them go wherever this goes.
  std::vector<std::vector<ReadyMark>> marks;

  /// Reads the ready marks (where there are) and counts the pieces they
  /// show in as reached, without waking anyone: for the thread that waits
  /// for the pieces, which then need not wait for the completion thread to
  /// see the same words, finish what it is doing and wake it. Any thread.
  void poll() {
    auto seen = [](const ReadyMark& m) {
      const std::uint32_t v = m.word->load(std::memory_order_acquire);
      // After the word: a forced value is read with its flag set.
      if (m.forced != nullptr && m.forced->load(std::memory_order_acquire)) return false;
      return ipc::word_reached(v, m.value);
    };
    std::uint32_t k = reached.load(std::memory_order_acquire);
    const std::uint32_t was = k;
    while (k < marks.size() && std::all_of(marks[k].begin(), marks[k].end(), seen)) ++k;
    if (k == was) return;
    std::lock_guard lock(mu_);
    if (k > reached.load()) reached.store(k, std::memory_order_release);
  }

  /// What to call when `reached` or `failed` changes (the host collective's
  /// executor).
  void on_change(std::function<void()> wake) {
    std::lock_guard lock(mu_);
    wake_ = std::move(wake);
  }
  std::pair<Code, std::string> error() {
    std::lock_guard lock(mu_);
    return {code_, why_};
  }

 private:
  std::mutex mu_;
  std::function<void()> wake_;
  Code code_ = Code::ok;
  std::string why_;
};

/// Host staging of one GPU collective on a communicator spanning nodes: pinned
/// host buffers per local rank, filled from the GPU (stage_in) and copied back
/// (stage_out). `send[r]` / `recv[r]` are host spans the engine's host
/// collectives across nodes run on (empty for remote ranks or where a rank
/// has no buffer). Keeps its GPU operation (mappings, stream hand-offs) alive.
class GpuStage {
 public:
  virtual ~GpuStage() = default;
  std::vector<Span> send, recv;
  /// What the engine's host spans point their `reg` at (aliasing the stage's
  /// lifetime): an operation running on the staging keeps it alive.
  Registration host{};
  /// Set where the inputs arrive in pieces (GpuCollective::in_piece_bytes):
  /// the host collective may start at once. Null: every input was in host
  /// memory before `ready`.
  std::shared_ptr<InPieces> in;
};

/// One rank's GPU collective on a communicator spanning nodes, cut into
/// chunks that the engine runs as consecutive operations (see make_chunked).
struct ChunkedArgs {
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  std::uint64_t count = 0;  ///< the whole operation's count
  int nranks = 0;
  int rank = 0;
  int root = 0;
  Span send, recv;  ///< the whole operation's GPU buffers (empty where the rank has none)
  std::vector<std::uint64_t> first;  ///< element offset of each chunk; chunk i has
                                     ///< first[i+1] - first[i] elements (first.back() == count)
};

struct GpuStatus {
  bool available = false;
  std::string reason;                ///< why not, or the driver version
  std::vector<std::string> devices;  ///< "0: NVIDIA H100 80GB HBM3 (GPU-<uuid>)"
  std::string mps;                   ///< managed | external | off
  std::string mps_reason;
  bool mps_active = false;           ///< an MPS control daemon serves the node's contexts
  std::uint32_t mappings = 0;        ///< open client allocations
  std::uint64_t mapped_bytes = 0;
};

class GpuExecutor {
 public:
  virtual ~GpuExecutor() = default;

  virtual GpuStatus status() const = 0;

  /// Opens (or finds in the cache) a client's allocation. Throws Error naming
  /// the allocation kind and the reason. A registration of several pieces
  /// comes in several requests of the session, one after the other: null
  /// until its last piece is in (a request that starts another, an error or
  /// client_gone drops what was mapped of it).
  virtual std::shared_ptr<DeviceMemory> open(std::uint64_t session, GpuRegisterArgs args) = 0;

  /// Maps a client's flag page (memfd with F_SEAL_SHRINK): the words its
  /// streams wait on. One per session; a second replaces the first.
  virtual void attach_flags(std::uint64_t session, UniqueFd memfd, std::uint64_t bytes) = 0;

  /// Opens the event (cached per session and event id) and binds the flag word.
  virtual std::shared_ptr<RankSync> make_sync(std::uint64_t session, const GpuSyncArgs& args) = 0;

  /// The session ended: drop its events and flag page (mappings are dropped
  /// with their registrations).
  virtual void client_gone(std::uint64_t session) = 0;

  /// Enqueues `op` on the daemon's streams and returns; `done` runs once
  /// (on the executor's completion thread) when the GPU finished it, with
  /// Code::ok or the error. Called under the engine's lock, in each
  /// communicator's order: must not block on the GPU.
  virtual void run(GpuCollective op, std::function<void(Code, std::string)> done) = 0;

  /// Across nodes, step 1: allocates (from a cache) pinned host staging for
  /// every local rank of `op`, enqueues on the GPUs "wait for the rank's
  /// input, copy it to the host", and returns. `ready` runs once (executor's
  /// completion thread) when every input is in host memory, or with the error
  /// (deadline: naming the ranks whose input never came; a client died).
  /// Called under the engine's lock: never blocks on the GPU.
  virtual std::shared_ptr<GpuStage> stage_in(GpuCollective op,
                                             std::function<void(Code, std::string)> ready) = 0;
  /// Across nodes, pipelined: one stream hand-off per chunk of `chunked` (the
  /// engine runs each as an ordinary staged operation of the chunk's count).
  /// The first chunk's stage_in copies every chunk's input to pinned host
  /// staging at once (one event per chunk, so chunk i's exchange between
  /// nodes starts as soon as its own copy is done and overlaps the copies of
  /// the later chunks); each chunk's stage_out copies its part of the output
  /// back, in the whole operation's layout (strided for all-gather,
  /// reduce-scatter and all-to-all); only the last chunk releases the
  /// client's stream.
  virtual std::vector<std::shared_ptr<RankSync>> make_chunked(std::uint64_t session,
                                                              const GpuSyncArgs& args,
                                                              ChunkedArgs chunked) = 0;
  /// Bytes of one rank's count per chunk for operations across nodes (0: not
  /// cut): the profile's gpu.stage_chunk_bytes. Every daemon of a cluster must
  /// use the same value.
  virtual std::uint64_t stage_chunk_bytes() const = 0;

  /// Across nodes, during the host collective: bytes [offset, offset +
  /// bytes) of local rank `rank`'s output staging (stage.recv[rank]) are
  /// final (NodeChannel::written). Enqueues their copy back to the GPU at
  /// once, so that it overlaps the rest of the exchange; stage_out then
  /// copies only the rest. Called from the thread that runs the host
  /// collective, never for overlapping ranges; never blocks on the GPU.
  /// Ignored where the output is not copied back, before the first piece of
  /// the inputs is in (the rank's stream may not have reached the
  /// operation), and by default.
  virtual void stage_out_early(GpuStage& stage, int rank, std::uint64_t offset, std::uint64_t bytes) {
    (void)stage, (void)rank, (void)offset, (void)bytes;
  }
  /// Across nodes, step 2: the host collective filled stage->recv; enqueues
  /// the copies back to the GPU buffers and the release of every local rank's
  /// stream; `done` runs once when the GPU finished (or at the deadline).
  virtual void stage_out(std::shared_ptr<GpuStage> stage,
                         std::function<void(Code, std::string)> done) = 0;
};

/// With CUDA: probes the driver and devices (never throws: without a GPU the
/// executor answers every request with an error saying why). Without CUDA:
/// an executor that says the daemon was built without it.
struct GpuOptions {
  std::string mps = "off";  ///< profile gpu.mps: managed | external | off
  std::uint64_t stage_chunk_bytes = 0;  ///< profile gpu.stage_chunk_bytes (0: never cut)
  /// profile gpu.copy_engine_min_bytes: copies between GPUs of at least this
  /// many bytes run on the copy engines (0: always a copy kernel).
  std::uint64_t copy_engine_min_bytes = 0;
  /// profile gpu.two_step_min_gpus: a broadcast split over this many GPUs or
  /// more takes two steps.
  int two_step_min_gpus = 3;
  /// Bytes per rank up to which one GPU runs an operation inside the node
  /// (one-shot); 0: the built-in limits (local_path.h). A test hook.
  std::uint64_t one_shot_bytes = 0;
  /// Synchronize after each step and name the step that failed (diagnosis).
  bool debug_sync = false;
};
std::unique_ptr<GpuExecutor> make_gpu_executor(Logger& log, const GpuOptions& options);

}  // namespace collectived::engine::gpu

// One rank's side of the stream hand-off (docs/gpu.md): the client's flag
// page, its interprocess event, and the RankSync the engine holds per rank of
// an operation; and a pipelined staged operation's per-rank staging.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/gpu/cuda_check.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/graveyard.h"
#include "engine/gpu/pinned_pool.h"
#include "engine/host_mapping.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine::gpu {

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

}  // namespace collectived::engine::gpu

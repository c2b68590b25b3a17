#include "engine/gpu/sessions.h"

#include <cstring>
#include <string>

namespace collectived::engine::gpu {
namespace {

// An input staged by its client arrives in at most this many pieces.
constexpr std::uint32_t kMaxClientPieces = 64;

}  // namespace

void Sessions::attach_flags(std::uint64_t session, UniqueFd memfd, std::uint64_t bytes) {
  if (bytes < 4 || bytes > (1 << 20) || bytes % 4 != 0) {
    throw Error(Code::invalid_argument,
                "flag page of " + std::to_string(bytes) + " bytes (4 B .. 1 MiB, whole words)");
  }
  auto page = std::make_shared<FlagPage>();
  page->mapping = HostMapping::map_memfd(std::move(memfd), bytes);
  cudaSetDevice(s_.devices.front().ordinal);
  check_rt(cudaHostRegister(page->mapping.data(), page->mapping.size(),
                            cudaHostRegisterPortable | cudaHostRegisterMapped),
           "cudaHostRegister of the client's flag page");
  page->registered = true;
  void* dptr = nullptr;
  check_rt(cudaHostGetDevicePointer(&dptr, page->mapping.data(), 0),
           "cudaHostGetDevicePointer of the client's flag page");
  page->device = reinterpret_cast<cu::DevicePtr>(dptr);
  std::lock_guard lock(s_.mu);
  sessions_[session].flags = std::move(page);
}

std::shared_ptr<RankSync> Sessions::make_sync(std::uint64_t session, const GpuSyncArgs& a) {
  auto sync = std::make_shared<Sync>();
  sync->send_buffer_id = a.send_buffer_id;
  sync->recv_buffer_id = a.recv_buffer_id;
  std::lock_guard lock(s_.mu);
  Session& s = sessions_[session];
  if (!s.flags) {
    throw Error(Code::invalid_usage, "GPU operation before the client attached its flag page");
  }
  if (a.flag_word >= s.flags->words()) {
    throw Error(Code::invalid_argument,
                "flag word " + std::to_string(a.flag_word) + " outside the client's flag page");
  }
  // From here on the sync releases the client's stream if it is dropped.
  sync->flags = s.flags;
  sync->word = a.flag_word;
  sync->ticket = a.ticket;
  sync->session = session;
  sync->graveyard = s_.graveyard;
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
      throw Error(Code::invalid_argument, "an input staged by the client in " +
                                              std::to_string(a.ready_pieces) + " pieces of " +
                                              std::to_string(a.piece_bytes) + " bytes from piece " +
                                              std::to_string(a.piece_first) + " (1 to " +
                                              std::to_string(kMaxClientPieces) + " pieces)");
    }
    sync->pieces = a.ready_pieces;
    sync->piece_bytes = a.piece_bytes;
    sync->piece_first = a.piece_first;
  }
  if (a.client_staged && a.out_pieces > 1) {
    if (a.out_pieces > kMaxClientPieces || a.out_piece_bytes == 0) {
      throw Error(Code::invalid_argument, "an output copied back by the client in " +
                                              std::to_string(a.out_pieces) + " pieces of " +
                                              std::to_string(a.out_piece_bytes) + " bytes (1 to " +
                                              std::to_string(kMaxClientPieces) + " pieces)");
    }
    sync->out_pieces = a.out_pieces;
    sync->out_piece_bytes = a.out_piece_bytes;
  }
  if (a.event_handle.empty()) {
    // The client's stream marks its input ready on a flag word.
    if (a.ready_word >= s.flags->words()) {
      throw Error(Code::invalid_argument,
                  "ready word " + std::to_string(a.ready_word) + " outside the client's flag page");
    }
    sync->ready_word = a.ready_word;
    return sync;
  }
  if (a.event_handle.size() != cu::kIpcHandleSize) {
    throw Error(Code::invalid_argument,
                "IPC event handle of " + std::to_string(a.event_handle.size()) + " bytes");
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
    cudaSetDevice(s_.devices.front().ordinal);
    check_rt(cudaIpcOpenEventHandle(&opened->event, h), "cudaIpcOpenEventHandle");
    ev = std::move(opened);
  }
  sync->event = ev;
  return sync;
}

std::vector<std::shared_ptr<RankSync>> Sessions::make_chunked(std::uint64_t session,
                                                              const GpuSyncArgs& args,
                                                              ChunkedArgs chunked) {
  if (chunked.first.size() < 2 || chunked.first.front() != 0 ||
      chunked.first.back() != chunked.count) {
    throw Error(Code::internal, "bad chunks of a staged GPU operation");
  }
  auto pipe = std::make_shared<ChunkPipe>();
  pipe->pool = s_.pinned;
  pipe->graveyard = s_.graveyard;
  pipe->es = dtype_size(chunked.dtype);
  const auto n = static_cast<std::uint64_t>(chunked.nranks);
  pipe->smul = chunked.kind == OpKind::reduce_scatter || chunked.kind == OpKind::all_to_all ? n : 1;
  pipe->rmul = chunked.kind == OpKind::all_gather || chunked.kind == OpKind::all_to_all ? n : 1;
  const Span& any = chunked.recv.reg ? chunked.recv : chunked.send;
  pipe->dev = any.reg && any.reg->device ? any.reg->device->device() : s_.devices.front().ordinal;
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

void Sessions::forget_locked(std::uint64_t session) {
  if (auto it = sessions_.find(session); it != sessions_.end()) {
    s_.graveyard->bury(std::move(it->second.flags));
    for (auto& [id, ev] : it->second.events) s_.graveyard->bury(std::move(ev));
    sessions_.erase(it);
  }
}

}  // namespace collectived::engine::gpu

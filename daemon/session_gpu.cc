// A client session's GPU requests: registration of GPU allocations, the flag
// page its streams wait on, and the stream hand-off of GPU collectives.
#include <algorithm>
#include <mutex>

#include "daemon/server.h"
#include "daemon/session.h"
#include "engine/dtype.h"

namespace collectived::daemon {

namespace {
std::string data_text(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}

engine::gpu::GpuSyncArgs sync_args(wire::GpuSync::Reader req) {
  engine::gpu::GpuSyncArgs a;
  a.event_handle = data_text(req.getEventHandle());
  a.event_id = req.getEventId();
  a.flag_word = req.getFlagWord();
  a.ticket = req.getTicket();
  a.ready_word = req.getReadyWord();
  a.send_buffer_id = req.getSendBufferId();
  a.recv_buffer_id = req.getRecvBufferId();
  a.client_staged = req.getClientStaged();
  a.ready_pieces = std::max<std::uint32_t>(1, req.getReadyPieces());
  a.piece_bytes = req.getPieceBytes();
  a.piece_first = req.getPieceFirst();
  a.out_pieces = std::max<std::uint32_t>(1, req.getOutPieces());
  a.out_piece_bytes = req.getOutPieceBytes();
  a.own_segment_on_gpu = req.getOwnSegmentOnGpu();
  return a;
}

/// One client request made of several engine operations (the chunks of a GPU
/// collective across nodes): answered once, when every chunk is, with the
/// first error if one failed (the outputs are then undefined).
class ChunkAnswers final : public engine::CompletionSink {
 public:
  ChunkAnswers(std::shared_ptr<engine::CompletionSink> sink, std::size_t chunks)
      : sink_(std::move(sink)), left_(chunks) {}
  void complete(std::uint64_t request, engine::Result result) override {
    engine::Result out;
    {
      std::lock_guard lock(mu_);
      // The earliest chunk's error (later chunks often fail because of it),
      // else the first chunk's answer.
      const bool failed = result.code != Code::ok;
      if (!seen_ || (failed && !failed_) || (failed == failed_ && result.seq < answer_.seq)) {
        answer_ = std::move(result);
        failed_ = failed;
      }
      seen_ = true;
      if (--left_ != 0) return;
      out = std::move(answer_);
    }
    sink_->complete(request, std::move(out));
  }

 private:
  std::shared_ptr<engine::CompletionSink> sink_;
  std::mutex mu_;
  std::size_t left_;
  bool failed_ = false;
  bool seen_ = false;
  engine::Result answer_;
};
}  // namespace

void ClientSession::handle_register_gpu(std::uint64_t id, wire::RegisterGpu::Reader req,
                                        std::vector<UniqueFd>& fds) {
  engine::gpu::GpuRegisterArgs a;
  switch (req.getKind()) {
    case wire::GpuMemoryKind::LEGACY_IPC: a.kind = engine::gpu::MemoryKind::legacy_ipc; break;
    case wire::GpuMemoryKind::POSIX_FD: a.kind = engine::gpu::MemoryKind::posix_fd; break;
    case wire::GpuMemoryKind::POOL_FD: a.kind = engine::gpu::MemoryKind::pool_fd; break;
    default: throw Error(Code::invalid_argument, "unknown GPU memory kind");
  }
  // Several allocations mapped back to back: one descriptor per piece.
  const auto pieces = req.getPieces();
  const bool several = a.kind == engine::gpu::MemoryKind::posix_fd && req.getPieceCount() != 0;
  const std::size_t want = a.kind == engine::gpu::MemoryKind::legacy_ipc ? 0
                           : several                                     ? pieces.size()
                                                                         : 1;
  if (several && want == 0) {
    throw Error(Code::invalid_argument, "RegisterGpu of " + std::to_string(req.getPieceCount()) +
                                            " pieces carries none");
  }
  if (fds.size() != want) {
    throw Error(Code::invalid_argument, "this GPU memory kind takes " + std::to_string(want) +
                                            " descriptors, got " + std::to_string(fds.size()));
  }
  if (several) {
    a.piece_count = req.getPieceCount();
    for (unsigned i = 0; i < pieces.size(); ++i) {
      a.pieces.push_back({std::move(fds[i]), pieces[i].getOffset(), pieces[i].getSize()});
    }
  } else if (want == 1) {
    a.fd = std::move(fds[0]);
  }
  a.handle = data_text(req.getHandle());
  a.size = req.getSize();
  a.device_uuid = data_text(req.getDeviceUuid());
  a.buffer_id = req.getBufferId();
  if (a.size == 0) throw Error(Code::invalid_argument, "GPU allocation of 0 bytes");
  auto memory = host_.gpu().open(id_, std::move(a));
  if (!memory) {
    // More pieces to come (RegisterGpu.pieces): answered without a handle.
    capnp::MallocMessageBuilder b;
    auto m = b.initRoot<wire::Message>();
    m.setId(id);
    m.initRegistered().setHandle(0);
    send(ipc::encode_frame(b));
    return;
  }
  const std::uint64_t handle = host_.registry().add_device(id_, memory);
  host_.logger().debug("gpu_registered", {{"session", id_},
                                          {"handle", handle},
                                          {"bytes", memory->size()},
                                          {"device", memory->device()},
                                          {"pieces", std::max<std::uint32_t>(1, req.getPieceCount())}});
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto r = m.initRegistered();
  r.setHandle(handle);
  r.setSize(memory->size());
  send(ipc::encode_frame(b));
}

void ClientSession::handle_attach_gpu(std::uint64_t id, wire::AttachGpu::Reader req,
                                      std::vector<UniqueFd>& fds) {
  if (fds.size() != 1) {
    throw Error(Code::invalid_argument,
                "AttachGpu expects one memfd descriptor, got " + std::to_string(fds.size()));
  }
  host_.gpu().attach_flags(id_, std::move(fds[0]), req.getBytes());
  const auto& g = host_.profile().gpu;
  const auto st = host_.gpu().status();
  // The client's own kernels save the two hand-offs between its stream and
  // the daemon's (~35 us per operation without MPS, a few us under it).
  bool on = g.client_kernels == "on";
  std::string why;
  if (g.client_kernels == "off") {
    why = "gpu.client_kernels is off: the daemon runs every GPU collective";
  } else if (on) {
    why = "gpu.client_kernels is on";
  } else if (st.mps_active) {
    why = "gpu.client_kernels is auto and MPS is in force (hand-offs to the daemon are cheap): "
          "the daemon runs every GPU collective";
  } else {
    on = true;
    why = "gpu.client_kernels is auto and MPS is not in force";
  }
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto a = m.initAttachedGpu();
  a.setClientKernels(on);
  a.setReason(why.c_str());
  a.setMaxBytes(g.client_kernel_max_bytes);
  a.setTwoStepMinGpus(static_cast<std::uint32_t>(g.two_step_min_gpus));
  a.setTwoStepBytes(g.two_step_bytes);
  // An operation the client stages is never cut in chunks (every daemon of
  // the cluster cuts above the same gpu.stage_chunk_bytes).
  std::uint64_t stage_max = g.client_stage_max_bytes;
  if (g.stage_chunk_bytes != 0) stage_max = std::min(stage_max, g.stage_chunk_bytes);
  a.setClientStageMaxBytes(stage_max);
  // A staged reduce-scatter over two nodes may leave the rank's own segment
  // on its GPU where this daemon's reduce-scatter between them is pairwise.
  a.setOwnSegmentOnGpu(host_.engine().reduce_scatter_own_elsewhere(2));
  send(ipc::encode_frame(b));
}

std::shared_ptr<engine::gpu::RankSync> ClientSession::gpu_sync(wire::GpuSync::Reader req) {
  return host_.gpu().make_sync(id_, sync_args(req));
}

engine::ClientRef ClientSession::chunked_ref(const char* event, std::uint64_t comm,
                                             std::uint64_t count, std::size_t chunks,
                                             bool from_worker) {
  host_.logger().debug(event, {{"session", id_}, {"comm", comm}, {"count", count}, {"chunks", chunks}});
  engine::ClientRef ref = client_ref(from_worker);
  // The chunks' answers are gathered into one answer to the client.
  ref.sink = std::make_shared<ChunkAnswers>(sink_, chunks);
  return ref;
}

bool ClientSession::submit_chunked(std::uint64_t id, wire::Collective::Reader req,
                                   bool from_worker) {
  using engine::OpKind;
  auto& gpu = host_.gpu();
  const std::uint64_t chunk_bytes = gpu.stage_chunk_bytes();
  if (chunk_bytes == 0) return false;
  // Every rank of an operation must cut it the same way, whatever memory its
  // buffers are in: a communicator may pair host-buffer ranks on one node with
  // GPU ranks on another. Only the operations whose chunks are contiguous
  // pieces of every rank's buffers are cut (host ranks then run them as
  // ordinary host operations on offsets); all-gather, reduce-scatter and
  // all-to-all are never cut (a host rank cannot run their strided chunks).
  OpKind kind;
  switch (req.getKind()) {
    case wire::OpKind::ALL_REDUCE: kind = OpKind::all_reduce; break;
    case wire::OpKind::BROADCAST: kind = OpKind::broadcast; break;
    case wire::OpKind::REDUCE: kind = OpKind::reduce; break;
    default: return false;
  }
  const bool on_gpu = req.hasGpu();
  if (on_gpu && req.getGpu().getClientStaged()) {
    // The client stages only what is not cut (AttachedGpu.clientStageMaxBytes).
    const auto dt = engine::dtype_from_int(req.getDtype());
    if (dt && req.getCount() > chunk_bytes / engine::dtype_size(*dt)) {
      throw Error(Code::invalid_argument,
                  "an operation staged by the client is larger than gpu.stage_chunk_bytes (" +
                      std::to_string(chunk_bytes) +
                      " bytes per rank), which every daemon cuts in chunks");
    }
    return false;
  }
  // Whatever is wrong with the request, the engine says it for the whole
  // operation: anything unusual is not cut.
  const auto dtype = engine::dtype_from_int(req.getDtype());
  if (!dtype) return false;
  const std::uint64_t es = engine::dtype_size(*dtype);
  const std::uint64_t count = req.getCount();
  if (count == 0 || count > (std::uint64_t{1} << 40) / es || count * es <= chunk_bytes) return false;
  const auto shape = host_.engine().comm_shape(id_, req.getComm());
  if (!shape || shape->nodes < 2) return false;
  const std::uint64_t n = shape->nranks;
  const auto rank = static_cast<std::int32_t>(shape->rank);
  const std::int32_t root = req.getRoot();
  const bool rooted = kind == OpKind::broadcast || kind == OpKind::reduce;
  if (rooted && (root < 0 || static_cast<std::uint64_t>(root) >= n)) return false;
  const std::uint64_t one = count * es;
  std::uint64_t send_bytes = one, recv_bytes = one;
  switch (kind) {
    case OpKind::all_gather: recv_bytes = one * n; break;
    case OpKind::reduce_scatter: send_bytes = one * n; break;
    case OpKind::all_to_all: send_bytes = recv_bytes = one * n; break;
    case OpKind::broadcast: if (rank != root) send_bytes = 0; break;
    case OpKind::reduce: if (rank != root) recv_bytes = 0; break;
    default: break;
  }
  const engine::BufferArg sa{req.getSend().getHandle(), req.getSend().getOffset()};
  const engine::BufferArg ra{req.getRecv().getHandle(), req.getRecv().getOffset()};
  if (!on_gpu) {
    // Host buffers: K ordinary operations on pieces of the buffers (the
    // engine checks each), answered once.
    const std::uint64_t per = std::max<std::uint64_t>(64, chunk_bytes / es / 64 * 64);
    const std::size_t chunks = static_cast<std::size_t>((count + per - 1) / per);
    if (chunks < 2) return false;
    const engine::ClientRef ref = chunked_ref("host_chunked", req.getComm(), count, chunks, from_worker);
    for (std::uint64_t at = 0; at < count; at += per) {
      engine::CollectiveArgs a;
      a.kind = kind;
      a.dtype = req.getDtype();
      a.redop = req.getRedop();
      a.count = std::min(per, count - at);
      a.root = root;
      a.deadline = engine::deadline_from_wire(req.getDeadlineMs());
      a.send = sa;
      a.recv = ra;
      if (send_bytes != 0) a.send.offset += at * es;
      if (recv_bytes != 0) a.recv.offset += at * es;
      host_.engine().collective(ref, id, req.getComm(), a);
    }
    return true;
  }
  engine::gpu::ChunkedArgs c;
  try {
    auto span = [&](const engine::BufferArg& b, std::uint64_t bytes) -> engine::Span {
      if (bytes == 0) return {};
      auto reg = host_.registry().find_range(id_, b.handle, b.offset, bytes);
      if (!reg->device) throw Error(Code::invalid_argument, "host memory");
      std::byte* p = reg->data() + b.offset;
      return engine::Span{std::move(reg), p, bytes};
    };
    c.send = span(sa, send_bytes);
    c.recv = span(ra, recv_bytes);
  } catch (const Error&) {
    return false;
  }
  // The layouts in place (the engine checks them per chunk, on chunk-sized
  // spans placed so that its in-place rule holds for the chunk).
  const bool same = c.send.reg && c.recv.reg && c.send.reg == c.recv.reg;
  const bool ag_in_place = same && kind == OpKind::all_gather && c.send.ptr == c.recv.ptr + rank * one;
  const bool rs_in_place = same && kind == OpKind::reduce_scatter && c.recv.ptr == c.send.ptr + rank * one;
  if (same) {
    const bool overlap = c.send.ptr < c.recv.ptr + c.recv.bytes && c.recv.ptr < c.send.ptr + c.send.bytes;
    if (overlap && !ag_in_place && !rs_in_place && c.send.ptr != c.recv.ptr) return false;
    if (overlap && c.send.ptr == c.recv.ptr &&
        (kind == OpKind::all_gather || kind == OpKind::reduce_scatter) && rank != 0) {
      return false;
    }
  }
  // Chunks of whole 64-element units (aligned copies), the same on every node.
  const std::uint64_t per = std::max<std::uint64_t>(64, chunk_bytes / es / 64 * 64);
  for (std::uint64_t at = 0; at < count; at += per) c.first.push_back(at);
  c.first.push_back(count);
  const std::size_t chunks = c.first.size() - 1;
  if (chunks < 2) return false;
  const std::vector<std::uint64_t> first = c.first;
  c.kind = kind;
  c.dtype = *dtype;
  c.count = count;
  c.nranks = static_cast<int>(n);
  c.rank = rank;
  c.root = root;
  auto syncs = gpu.make_chunked(id_, sync_args(req.getGpu()), std::move(c));

  const engine::ClientRef ref = chunked_ref("gpu_chunked", req.getComm(), count, chunks, from_worker);
  for (std::size_t i = 0; i < chunks; ++i) {
    const std::uint64_t at = first[i], ci = first[i + 1] - first[i];
    engine::CollectiveArgs a;
    a.kind = kind;
    a.dtype = req.getDtype();
    a.redop = req.getRedop();
    a.count = ci;
    a.root = root;
    a.deadline = engine::deadline_from_wire(req.getDeadlineMs());
    // What the engine validates: chunk-sized spans inside the whole buffers
    // (the executor copies the chunk's elements in the whole layout).
    a.send = sa;
    a.recv = ra;
    switch (kind) {
      case OpKind::all_gather:
        a.send.offset += at * es;
        if (ag_in_place) a.recv.offset += (rank * (count - ci) + at) * es;
        break;
      case OpKind::reduce_scatter:
        a.recv.offset += at * es;
        if (rs_in_place) a.send.offset += (rank * (count - ci) + at) * es;
        break;
      case OpKind::all_to_all: break;
      default:
        a.send.offset += at * es;
        a.recv.offset += at * es;
        break;
    }
    a.gpu = syncs[i];
    host_.engine().collective(ref, id, req.getComm(), a);
  }
  return true;
}

void ClientSession::handle_direct_join(std::uint64_t id, wire::DirectJoin::Reader req) {
  const auto shape = host_.engine().comm_shape(id_, req.getComm());
  if (!shape) {
    throw Error(Code::not_found, "DirectJoin: communicator handle " + std::to_string(req.getComm()) +
                                     " is not one of this client's");
  }
  const auto blob = req.getBlob();
  if (blob.size() > 1024 || req.getRound() < 1 || req.getRound() > 3) {
    throw Error(Code::invalid_argument, "DirectJoin: round " + std::to_string(req.getRound()) +
                                            " with " + std::to_string(blob.size()) +
                                            " bytes (rounds 1-3, at most 1024 bytes)");
  }
  std::weak_ptr<ClientSession> self = weak_from_this();
  const std::uint64_t handle = req.getComm();
  host_.direct_broker().join(
      shape->id, req.getRound(), shape->rank, shape->nranks, shape->nodes, shape->next_seq, id_,
      std::string(reinterpret_cast<const char*>(blob.begin()), blob.size()),
      [self, id, handle](const std::vector<std::string>& blobs, const std::string& declined) {
        auto s = self.lock();
        if (!s) return;
        {
          std::lock_guard lock(s->direct_decided_mu_);
          s->direct_decided_.insert(handle);
        }
        capnp::MallocMessageBuilder b;
        auto m = b.initRoot<wire::Message>();
        m.setId(id);
        auto j = m.initDirectJoined();
        auto list = j.initBlobs(static_cast<unsigned>(blobs.size()));
        for (unsigned i = 0; i < blobs.size(); ++i) {
          list.set(i, capnp::Data::Reader(reinterpret_cast<const capnp::byte*>(blobs[i].data()),
                                          blobs[i].size()));
        }
        j.setDeclined(declined.c_str());
        s->send(ipc::encode_frame(b));
      });
}

}  // namespace collectived::daemon

#include "engine/gpu/staged_path.h"

#include <algorithm>
#include <chrono>

#include "engine/gpu/cuda_check.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine::gpu {
namespace {

/// Staged by the client with its output copied back in pieces: bytes
/// [offset, offset + bytes) of rank r's output are final in its host
/// staging. Where that completes pieces 0 .. q, the done word goes to
/// piece q's value, and the client's stream copies them back while the
/// exchange goes on (it waits for each piece's value in turn).
void client_out_early(Stage& st, const Sync& s, int r, std::uint64_t offset, std::uint64_t bytes) {
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
bool copied_back(const GpuCollective& op, int r) {
  return !(op.kind == OpKind::reduce && r != op.root) &&
         !(op.kind == OpKind::broadcast && r == op.root);
}
/// Rank r's input and output are both GPU memory of one (non-zero) size.
bool same_size_spans(const GpuCollective& op, int r) {
  const Span& s = op.send[static_cast<std::size_t>(r)];
  const Span& d = op.recv[static_cast<std::size_t>(r)];
  return s.reg != nullptr && d.reg != nullptr && s.bytes == d.bytes && s.bytes != 0;
}
/// Whether rank r's buffers of a staged operation are one (send == recv)
/// for an operation whose input and output have the same size.
bool staged_in_place(const GpuCollective& op, int r) {
  const bool same_size_kind =
      op.kind == OpKind::all_reduce || op.kind == OpKind::broadcast || op.kind == OpKind::reduce;
  return same_size_kind && same_size_spans(op, r) &&
         op.send[static_cast<std::size_t>(r)].ptr == op.recv[static_cast<std::size_t>(r)].ptr;
}
/// Whether rank r's host staging is one buffer for input and output: in
/// place on the GPU, or out of place for an all-reduce or broadcast (their
/// input is read once, their output has its size). Not an out-of-place
/// reduce: the host's in-place reduce is the slower one (2 H200, 2
/// daemons over TCP: 4 and 16 MiB 0.78-0.82x in place).
bool host_in_place(const GpuCollective& op, int r) {
  if (staged_in_place(op, r)) return true;
  const bool kind = op.kind == OpKind::all_reduce || op.kind == OpKind::broadcast;
  return kind && same_size_spans(op, r);
}

// Inputs in pieces (GpuCollective::in_piece_bytes): every rank that
// copies an input copies one of the same size (not none), and none is a
// chunk of a pipelined operation. One piece is enough: the engine then
// starts the host collective at once, which waits for it
// (GpuStage::in).
bool copies_input(const GpuCollective& op, int r) {
  return op.sync[r] && op.send[r].bytes != 0 && !(op.kind == OpKind::broadcast && r != op.root);
}

}  // namespace

std::shared_ptr<GpuStage> StagedPath::stage_in(GpuCollective op,
                                               std::function<void(Code, std::string)> ready) {
  const int n = static_cast<int>(op.sync.size());
  auto st = std::make_shared<Stage>(s_.pinned, s_.graveyard);
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
  const bool by_client = stage_buffers(op, st.get());
  std::uint64_t piece = 0;
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
    client_pieces = by_client_pieces(op, st.get(), p, pieces);
  }
  if (op.in_piece_bytes != 0 && !op.hold && !by_client)
    by_daemon_pieces(op, st.get(), p, piece, pieces);
  // Piece k >= 1 of every rank: an operation of its own for the completion
  // thread, which tells st->in when it is in.
  std::vector<Pending> later(pieces > 1 ? pieces - 1 : 0);
  std::lock_guard lock(s_.mu);
  enqueue_inputs_locked(op, st.get(), p, later, client_pieces, piece, pieces);
  p.syncs = op.sync;
  if (by_client && s_.log.enabled(config::LogLevel::debug)) {
    s_.log.debug("gpu_client_staged",
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
  later.insert(later.begin(), std::move(p));
  completion_.queue_locked(std::move(later));
  return st;
}

bool StagedPath::stage_buffers(const GpuCollective& op, Stage* st) {
  const int n = static_cast<int>(op.sync.size());
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
  return by_client;
}

std::vector<StagedPath::ReadyWords> StagedPath::by_client_pieces(const GpuCollective& op, Stage* st,
                                                                 Pending& p,
                                                                 std::uint32_t& pieces) {
  const int n = static_cast<int>(op.sync.size());
  std::uint64_t in_bytes = 0;
  std::vector<ReadyWords> client_pieces;
  bool all = true, uniform = true;
  std::uint32_t k = 0, first = 0;
  std::uint64_t pb = 0;
  for (int r = 0; r < n; ++r) {
    const auto* cs = static_cast<const Sync*>(op.sync[r].get());
    if (cs == nullptr) continue;
    all = all && cs->client_staged;
    if (!copies_input(op, r)) continue;
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
        client_pieces[q].emplace_back(cs, copies_input(op, r) ? cs->piece_value(q) : cs->ticket);
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
  return client_pieces;
}

void StagedPath::by_daemon_pieces(const GpuCollective& op, Stage* st, Pending& p,
                                  std::uint64_t& piece, std::uint32_t& pieces) {
  const int n = static_cast<int>(op.sync.size());
  std::uint64_t in_bytes = 0;
  bool uniform = true;
  for (int r = 0; r < n; ++r) {
    if (op.sync[r] && static_cast<Sync*>(op.sync[r].get())->pipe) uniform = false;
    if (!copies_input(op, r)) continue;
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
    st->in->first =
        static_cast<std::uint32_t>(std::min<std::uint64_t>(op.in_first_byte / piece, pieces - 1));
    // Piece 0 of every rank is `p`: it tells st->in too (with its
    // deadline's error, naming the ranks whose input never came).
    p.done = [in = st->in, ready = std::move(p.done)](Code code, std::string why) {
      in->arrived(0, code, why);
      ready(code, std::move(why));
    };
  }
}

void StagedPath::enqueue_inputs_locked(const GpuCollective& op, Stage* st, Pending& p,
                                       std::vector<Pending>& later,
                                       const std::vector<ReadyWords>& client_pieces,
                                       std::uint64_t piece, std::uint32_t pieces) {
  const int n = static_cast<int>(op.sync.size());
  auto take_event = [&](int dev) {
    cudaEvent_t e = s_.devices.take_event_locked(dev);
    p.events.emplace_back(dev, e);
    return e;
  };
  const int front = s_.devices.front().ordinal;
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
    cudaStream_t stream = s_.devices[dev].streams[st->slot];
    if (s->event) {
      if (dev != front) {
        throw Error(Code::invalid_argument,
                    "GPU operation across nodes with an IPC event hand-off on GPU " +
                        std::to_string(dev) + ": the client library uses ready words; update it");
      }
      check_rt(cudaStreamWaitEvent(stream, s->event->event, 0), "cudaStreamWaitEvent");
    } else {
      s_.cu->check(s_.cu->cuStreamWaitValue32(
                       reinterpret_cast<cu::Stream>(stream),
                       s->flags->device + 4 * static_cast<cu::DevicePtr>(s->ready_word), s->ticket,
                       cu::kStreamWaitValueGeq),
                   "cuStreamWaitValue32 on " + op.who[r] + "'s ready word");
    }
    // A broadcast's input is read at its root only. In pieces, each
    // followed by an event, in the order the host collective reads them
    // (from in->first on): the exchange starts after the first and reads
    // each later one once its event is reached, so the copies overlap it.
    bool tailed = false;
    if (copies_input(op, r)) {
      const std::byte* src = on_device(gs, dev);
      for (std::uint32_t q = 0; q < pieces; ++q) {
        const std::uint64_t at = pieces > 1 ? ((st->in->first + q) % pieces) * piece : 0;
        const std::uint64_t len = std::min(gs.bytes - at, pieces > 1 ? piece : gs.bytes);
        check_rt(
            cudaMemcpyAsync(st->send[r].ptr + at, src + at, len, cudaMemcpyDeviceToHost, stream),
            "copy of " + op.who[r] + "'s input to host staging");
        cudaEvent_t e = q == 0 ? take_event(dev) : s_.devices.take_event_locked(dev);
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
}

void StagedPath::stage_out(std::shared_ptr<GpuStage> gstage,
                           std::function<void(Code, std::string)> done) {
  auto* st = static_cast<Stage*>(gstage.get());
  const GpuCollective& op = st->op;
  const int n = static_cast<int>(op.sync.size());
  Pending p;
  p.done = std::move(done);
  // The copies back wait for nothing; the operation's own deadline may be
  // close after the exchange between nodes, so give them time of their own.
  p.deadline = std::max(op.deadline, Clock::now() + std::chrono::seconds(30));
  p.who = op.who;
  std::lock_guard lock(s_.mu);
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
      out_chunk_locked(op, st, s, r, p);
      continue;
    }
    const int dev = gr.reg   ? gr.reg->device->device()
                    : gs.reg ? gs.reg->device->device()
                             : s_.devices.front().ordinal;
    cudaSetDevice(dev);
    cudaStream_t stream = s_.devices[dev].out_streams[st->slot];
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
      cudaEvent_t tail = s_.devices.take_event_locked(dev);
      p.events.emplace_back(dev, tail);
      check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
      p.tails.emplace_back(dev, tail);
      continue;
    }
    const cu::DevicePtr word = s->flags->device + 4 * static_cast<cu::DevicePtr>(s->word);
    s_.cu->check(s_.cu->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream), word, s->ticket,
                                             cu::kStreamWriteValueDefault),
                 "cuStreamWriteValue32 (release " + op.who[r] + "'s stream)");
    s->released = true;
    cudaEvent_t tail = s_.devices.take_event_locked(dev);
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
  completion_.queue_locked(std::move(p));
}

void StagedPath::out_chunk_locked(const GpuCollective& op, Stage* st, Sync* s, int r, Pending& p) {
  const ChunkPipe& pp = *s->pipe;
  cudaSetDevice(pp.dev);
  cudaStream_t stream = s_.devices[pp.dev].out_streams[st->slot];
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
    s_.cu->check(s_.cu->cuStreamWriteValue32(reinterpret_cast<cu::Stream>(stream), word, s->ticket,
                                             cu::kStreamWriteValueDefault),
                 "cuStreamWriteValue32 (release " + op.who[r] + "'s stream)");
  }
  s->released = true;
  cudaEvent_t tail = s_.devices.take_event_locked(pp.dev);
  p.events.emplace_back(pp.dev, tail);
  check_rt(cudaEventRecord(tail, stream), "cudaEventRecord");
  p.tails.emplace_back(pp.dev, tail);
}

void StagedPath::stage_out_early(GpuStage& gstage, int r, std::uint64_t offset,
                                 std::uint64_t bytes) {
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
  std::lock_guard lock(s_.mu);
  cudaSetDevice(dev);
  // The out stream: never behind a stream that waits for a client's next
  // input.
  cudaStream_t stream = s_.devices[dev].out_streams[st.slot];
  check_rt(cudaMemcpyAsync(on_device(gr, dev) + offset, st.recv[r].ptr + offset, bytes,
                           cudaMemcpyHostToDevice, stream),
           "early copy of " + op.who[r] + "'s output from host staging");
  auto e = std::find_if(st.early_events.begin(), st.early_events.end(),
                        [&](const auto& de) { return de.first == dev; });
  if (e == st.early_events.end()) {
    e = st.early_events.insert(st.early_events.end(), {dev, s_.devices.take_event_locked(dev)});
  }
  check_rt(cudaEventRecord(e->second, stream), "cudaEventRecord");
  st.early[r].emplace_back(offset, bytes);
}

void StagedPath::start_pipe(ChunkPipe& pp, const Sync& s, std::size_t slot,
                            const std::string& who) {
  if (pp.started) return;
  const int front = s_.devices.front().ordinal;
  cudaSetDevice(pp.dev);
  cudaStream_t stream = s_.devices[pp.dev].streams[slot];
  if (s.event) {
    if (pp.dev != front) {
      throw Error(Code::invalid_argument,
                  "GPU operation across nodes with an IPC event hand-off on GPU " +
                      std::to_string(pp.dev) + ": the client library uses ready words; update it");
    }
    check_rt(cudaStreamWaitEvent(stream, s.event->event, 0), "cudaStreamWaitEvent");
  } else {
    s_.cu->check(
        s_.cu->cuStreamWaitValue32(reinterpret_cast<cu::Stream>(stream),
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

}  // namespace collectived::engine::gpu

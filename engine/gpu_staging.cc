// The glue between matching and the GPU executor (engine/gpu/executor.h).
// Inside the node the executor runs a GPU collective or send/recv pair on the
// ranks' streams; across nodes (and for a GPU rank paired with a host one)
// the GPU side goes through pinned host staging: the executor copies inputs
// to the host, the host algorithms run on the staging, and the executor
// copies outputs back before the ranks' streams are released.
#include <mutex>

#include "engine/engine_core.h"
#include "ipc/stage_pieces.h"

namespace collectived::engine {

/// `done(code, message)` delivers `answers` (failed unless ok); an Error
/// thrown by `start` fails them into `out` at once.
template <typename Start>
void Engine::Impl::answer_when_done(const std::shared_ptr<Deliveries>& answers, std::uint64_t seq,
                                    Deliveries& out, Start&& start) {
  try {
    start(std::function<void(Code, std::string)>([answers, seq](Code code, std::string message) {
      if (code != Code::ok) {
        for (auto& d : *answers) d.result = error(code, message, seq);
      }
      deliver(*answers);
    }));
  } catch (const Error& e) {
    for (auto& d : *answers) {
      d.result = error(e.code(), e.what(), seq);
      out.push_back(std::move(d));
    }
  }
}

void Engine::Impl::drop_gpu(Locked, Group& g) {
  if (!g.gpu_sync) return;
  g.gpu_sync.reset();
  for (auto& item : g.items) {
    item.gpu_stage.reset();
    if (item.staged || item.staging) item.span = {};
  }
}

// The slot leaves the queues at once (the next operation may be enqueued
// behind it, stream order keeps them in order), and the answers wait for
// the GPU.
void Engine::Impl::start_gpu_slot(Locked lk, const std::shared_ptr<Comm>& cp, Slot& slot,
                                  Deliveries& out) {
  Comm& comm = *cp;
  gpu::GpuCollective op;
  op.comm = comm.name;
  op.seq = slot.seq;
  op.kind = slot.desc.kind;
  op.dtype = slot.desc.dtype;
  op.redop = slot.desc.redop;
  op.count = slot.desc.count;
  op.root = slot.desc.root;
  op.deadline = slot.deadline;
  for (int r = 0; r < comm.nranks; ++r) {
    const Part& part = slot.parts[r];
    op.send.push_back(part.send);
    op.recv.push_back(part.recv);
    op.sync.push_back(part.gpu_sync);
    op.who.push_back(comm.who(r));
  }
  const std::uint64_t seq = slot.seq;
  if (comm.spans_nodes()) {
    start_gpu_staged(lk, cp, slot, std::move(op), out);
    return;
  }
  auto answers = std::make_shared<Deliveries>();
  complete_slot(lk, comm, seq, *answers);
  answer_when_done(answers, seq, out, [&](auto done) { gpu->run(std::move(op), std::move(done)); });
}


/// The local ranks' inputs go to pinned host staging (the executor's GPU
/// copies), the engine's host collective across nodes runs on the staging
/// (run_across_nodes), and complete_slot hands the answers to the executor,
/// which copies the outputs back and releases the ranks' streams before
/// they go out.
void Engine::Impl::start_gpu_staged(Locked lk, const std::shared_ptr<Comm>& cp, Slot& slot,
                                    gpu::GpuCollective op, Deliveries& out) {
  const std::uint64_t seq = slot.seq;
  std::weak_ptr<Comm> weak = cp;
  slot.stage_queued = Clock::now();
  if (slot.run.in_pieces) {
    // Where the host collective waits for each piece of the input before it
    // reads it (NodeRun::in_pieces, decided with the plan), the exchange
    // starts once the first piece is in and the copies of the others overlap
    // it: pieces of an eighth of the input, at least 512 KiB (a copy of less
    // runs below the link's speed, and each piece costs a copy call and an
    // event under the lock).
    const std::uint64_t one = op.count * dtype_size(op.dtype);
    const std::uint64_t in = one * (op.kind == OpKind::reduce_scatter ? cp->nranks : 1);
    op.in_piece_bytes = ipc::stage_piece_bytes(in);  // the client's rule too
    op.in_first_byte = slot.run.first_read;
  }
  // Host spans on the staging: the host collective's buffers.
  auto on_staging = [](Slot& s, int nranks) {
    const auto& st = s.gpu_stage;
    for (int r = 0; r < nranks; ++r) {
      if (!s.parts[r].present) continue;
      auto host = [&](const Span& h) {
        return Span{std::shared_ptr<Registration>(st, &st->host), h.ptr, h.bytes};
      };
      s.parts[r].send = host(st->send[r]);
      s.parts[r].recv = host(st->recv[r]);
    }
  };
  try {
    slot.gpu_stage = gpu->stage_in(std::move(op), [this, weak, seq, on_staging](Code code, std::string why) {
      auto comm = weak.lock();
      if (!comm) return;
      locked([&](Locked lk2, Deliveries& done, Tasks& next) {
        auto it = comm->slots.find(seq);
        if (it == comm->slots.end() || it->second.failed || !it->second.gpu_stage) return;
        Slot& s = it->second;
        if (code != Code::ok) {
          send_slot_failed(lk2, *comm, seq, code, why);
          log.warn("operation_failed", {{"comm", comm->name},
                                        {"seq", seq},
                                        {"op", to_string(s.desc.kind)},
                                        {"reason", why}});
          fail_slot(lk2, *comm, s, code, why, done);
          end_slot(lk2, *comm, it);
          progress(lk2, comm, done, next);
        } else {
          // The host collective runs on the staging; the GPU spans stay
          // alive in the stage until the outputs are copied back.
          s.staged_in = Clock::now();
          if (!s.gpu_stage->in) {  // with pieces it started at stage_in (below)
            on_staging(s, comm->nranks);
            start_across_nodes(lk2, comm, seq);
          }
        }
      });
    });
    if (slot.gpu_stage->in) {
      // The inputs arrive in pieces and the host collective waits for each
      // before it reads it (NodeChannel::reading), the first too: it starts
      // now. Its ready-to-receive messages and posted buffers then go out
      // while the GPU still waits for the ranks' streams and copies the
      // first piece, and a node whose inputs come in later than the other's
      // finds the other ready. Started after the first piece, each
      // operation would pay that round trip after its copies (45-60 us of
      // a 1 MiB staged all-gather).
      on_staging(slot, cp->nranks);
      start_across_nodes(lk, cp, seq);
    }
  } catch (const Error& e) {
    send_slot_failed(lk, *cp, seq, e.code(), e.what());
    auto it = cp->slots.find(seq);
    fail_slot(lk, *cp, slot, e.code(), e.what(), out);
    if (it != cp->slots.end()) end_slot(lk, *cp, it);
  }
}

void Engine::Impl::stage_out_slot(Locked, Comm& comm, Slot& slot, Deliveries staged,
                                  Deliveries& out) {
  const std::uint64_t seq = slot.seq;
  auto answers = std::make_shared<Deliveries>(std::move(staged));
  answer_when_done(answers, seq, out, [&](auto done) {
    if (!log.enabled(config::LogLevel::debug)) {
      gpu->stage_out(std::move(slot.gpu_stage), std::move(done));
      return;
    }
    // Where a staged operation's time goes: the copies in (from queueing,
    // so with the wait for the ranks' inputs), the exchange, the copies out.
    const auto us = [](Clock::duration d) {
      return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    };
    // `at_us`: when it was queued, on the steady clock (CLOCK_MONOTONIC),
    // which the daemons of one host share: daemons that stand for nodes
    // on one machine can be lined up (which node came in late).
    const auto exchanged = Clock::now();
    gpu->stage_out(std::move(slot.gpu_stage),
                   [this, done = std::move(done), name = comm.name, seq, kind = slot.desc.kind,
                    at = us(slot.stage_queued.time_since_epoch()),
                    in = us(slot.staged_in - slot.stage_queued), across = us(exchanged - slot.staged_in),
                    start = us(slot.across_started - slot.staged_in), exchanged,
                    us](Code code, std::string why) {
                     log.debug("gpu_staged", {{"comm", name},
                                              {"seq", seq},
                                              {"op", to_string(kind)},
                                              {"at_us", at},
                                              {"in_us", in},
                                              {"exchange_us", across},
                                              // of which: until the node thread ran it
                                              // (negative: it started before the inputs
                                              // were in, GpuStage::in)
                                              {"start_us", start},
                                              {"out_us", us(Clock::now() - exchanged)}});
                     done(code, std::move(why));
                   });
  });
}

void Engine::Impl::stage_back_group(Locked lk, Group& g, Result res, Deliveries& out) {
  std::vector<std::shared_ptr<gpu::GpuStage>> back;
  for (auto& item : g.items) {
    if (item.staged && !item.is_send && item.gpu_stage) back.push_back(item.gpu_stage);
  }
  if (back.empty()) {
    out.push_back({g.sink, g.request, std::move(res)});
    drop_gpu(lk, g);
    return;
  }
  auto answers = std::make_shared<Deliveries>();
  answers->push_back({g.sink, g.request, std::move(res)});
  struct Left {
    std::mutex mu;
    std::size_t n;
    Code code = Code::ok;
    std::string why;
  };
  auto left = std::make_shared<Left>();
  left->n = back.size();
  const std::uint64_t seq = g.seq;
  drop_gpu(lk, g);  // the stages below hold the hand-off until their copies are done
  answer_when_done(answers, seq, out, [&](auto done) {
    for (auto& st : back) {
      gpu->stage_out(st, [left, done](Code code, std::string why) {
        std::unique_lock lock(left->mu);
        if (code != Code::ok && left->code == Code::ok) {
          left->code = code;
          left->why = std::move(why);
        }
        if (--left->n != 0) return;
        lock.unlock();
        done(left->code, left->why);
      });
    }
  });
}

/// The executor's operation for point-to-point bytes of `comm`'s group
/// `seq`, holding the ranks' hand-off until the last RankSync drops.
gpu::GpuCollective Engine::Impl::gpu_p2p_op(const Comm& comm, std::uint64_t seq,
                                            std::uint64_t bytes, Clock::time_point deadline) {
  gpu::GpuCollective op;
  op.comm = comm.name;
  op.seq = seq;
  op.kind = OpKind::p2p;
  op.dtype = DType::uint8;
  op.count = bytes;
  op.deadline = deadline;
  op.hold = true;
  return op;
}

/// A send/recv pair inside the node on GPU buffers: the executor copies
/// the sender's buffer into the receiver's over the peer mapping, after
/// both ranks' inputs are ready on their streams.
void Engine::Impl::start_gpu_pair(Locked lk, const std::shared_ptr<Comm>& cp,
                                  const std::shared_ptr<Group>& sender,
                                  const std::shared_ptr<Group>& receiver, P2PItem& send,
                                  P2PItem& recv, Deliveries& out) {
  Comm& comm = *cp;
  gpu::GpuCollective op = gpu_p2p_op(comm, sender->seq, send.span.bytes,
                                     std::min(sender->deadline, receiver->deadline));
  op.send = {send.span, Span{}};
  op.recv = {Span{}, recv.span};
  op.sync = {sender->gpu_sync, receiver->gpu_sync};
  op.who = {comm.who(sender->rank), comm.who(receiver->rank)};
  std::weak_ptr<Comm> weak = cp;
  try {
    gpu->run(std::move(op), [this, weak, sender, receiver](Code code, std::string why) {
      auto live = weak.lock();
      if (!live) return;
      locked([&](Locked lk2, Deliveries& out2, Tasks& tasks2) {
        if (code != Code::ok) {
          const std::string reason = "send from rank " + std::to_string(sender->rank) +
                                     " to rank " + std::to_string(receiver->rank) +
                                     " on GPU buffers failed: " + why;
          fail_group(lk2, *live, *sender, code, reason, out2);
          if (receiver != sender) fail_group(lk2, *live, *receiver, code, reason, out2);
        } else {
          item_done(lk2, *live, *sender, out2);
          item_done(lk2, *live, *receiver, out2);
        }
        progress(lk2, live, out2, tasks2);
      });
    });
  } catch (const Error& e) {
    fail_group(lk, comm, *sender, e.code(), e.what(), out);
    if (receiver != sender) fail_group(lk, comm, *receiver, e.code(), e.what(), out);
  }
}

/// A GPU group's item with a peer on another node: the executor waits for
/// the rank's stream and copies a send's data to pinned host staging (a
/// receive gets staging of its size); then the item runs as a host one.
void Engine::Impl::stage_gpu_item(Locked lk, const std::shared_ptr<Comm>& cp,
                                  const std::shared_ptr<Group>& g, std::size_t k, Deliveries& out) {
  Comm& comm = *cp;
  P2PItem& item = g->items[k];
  item.staging = true;
  gpu::GpuCollective op = gpu_p2p_op(comm, g->seq, item.span.bytes, g->deadline);
  op.send = {item.is_send ? item.span : Span{}};
  op.recv = {item.is_send ? Span{} : item.span};
  op.sync = {g->gpu_sync};
  op.who = {comm.who(g->rank)};
  std::weak_ptr<Comm> weak = cp;
  auto host_span = [](P2PItem& it) {
    const auto& st = it.gpu_stage;
    const Span& h = it.is_send ? st->send[0] : st->recv[0];
    it.span = Span{std::shared_ptr<Registration>(st, &st->host), h.ptr, h.bytes};
    it.staged = true;
  };
  try {
    item.gpu_stage = gpu->stage_in(std::move(op), [this, weak, g, k, host_span](Code code, std::string why) {
      auto live = weak.lock();
      if (!live) return;
      locked([&](Locked lk2, Deliveries& out2, Tasks& tasks2) {
        if (g->failed || g->answered) return;
        P2PItem& it = g->items[k];
        if (code != Code::ok || !it.gpu_stage) {
          fail_group(lk2, *live, *g, code == Code::ok ? Code::internal : code,
                     (it.is_send ? "send to rank " : "recv from rank ") +
                         std::to_string(it.peer) + " on GPU buffers: " + why,
                     out2);
        } else if (it.is_send) {
          host_span(it);  // its data is on the host now
        } else {
          it.ready = true;  // its copy back may go once it has arrived
          finish_group(lk2, *live, *g, out2);
        }
        progress(lk2, live, out2, tasks2);
      });
    });
    // A receive takes the data into its staging as soon as it arrives (an
    // eager sender may leave the communicator right after sending).
    if (!item.is_send) host_span(item);
  } catch (const Error& e) {
    fail_group(lk, comm, *g, e.code(), e.what(), out);
  }
}

}  // namespace collectived::engine

// Operations of communicators whose ranks live on several nodes. Local ranks
// meet as on one node (sequence numbers, queues); when all of this node's
// ranks are in, the operation runs on the communicator's executor (a fiber on
// the node thread, engine/node_executor.h): engine/node_algorithms.h, whose
// messages are `data` keyed by (seq, tag, sender node) and carry the sender's
// view of the operation, so that a mismatch is named on every node. A failure
// is told to the other nodes (`slotFailed` for one operation, `broken` for
// the communicator). Point-to-point items with a peer on another node go as
// single `data` messages.
#include <algorithm>
#include <cstring>
#include <set>
#include <thread>

#include "engine/engine_channel.h"
#include "engine/engine_core.h"

namespace collectived::engine {

Engine::Impl::~Impl() {
  std::vector<std::shared_ptr<Executor>> execs;
  {
    EngineLock lock(mu);
    stopping = true;
    for (const auto& w : nodes.executors) {
      if (auto ex = w.lock()) execs.push_back(ex);
    }
  }
  // The own node thread (tests) may be inside a fiber: let it finish what it
  // runs and stop. The daemon's event loop has returned by now.
  nodes.runner->shut();
  // Suspended fibers see `stopping` when resumed, fail their operation and
  // unwind (their stacks hold mappings and buffers). Queued jobs run the same
  // way and answer "stopping". A fiber waiting for a pass on the worker pool
  // (NodeChannel::compute) goes on once the pass is done.
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < give_up) {
    bool any = false;
    for (auto& ex : execs) {
      bool queued;
      {
        std::lock_guard l(ex->mu);
        queued = !ex->jobs.empty();
      }
      if (!ex->fiber && !queued) continue;
      any = true;
      Executor::drive(ex);
    }
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Engine::Impl::wake_executors(Locked) {
  // Every executor, also those of communicators already released whose last
  // operation still runs (it waits for its deadline).
  std::erase_if(nodes.executors, [](const std::weak_ptr<Executor>& w) {
    auto ex = w.lock();
    if (ex) Executor::wake(ex);
    return !ex;
  });
}

void Engine::Impl::attach_nodes(Locked, const std::shared_ptr<Comm>& cp) {
  Comm& comm = *cp;
  auto& ref = nodes.inboxes[comm.uid];
  if (!ref.first) ref.first = std::make_shared<Inbox>();
  ref.first->claimed = true;
  ref.second = cp;
  comm.inbox = ref.first;
  if (comm.inbox->broken) comm.broken = comm.inbox->broken;
  comm.exec = std::make_shared<Executor>();
  comm.exec->runner = nodes.runner;
  comm.exec->comm = comm.name;
  comm.inbox->exec = comm.exec;
  nodes.executors.push_back(comm.exec);
}

void Engine::Impl::release_nodes(Locked, Comm& comm) {
  if (!comm.spans_nodes()) return;
  auto it = nodes.inboxes.find(comm.uid);
  if (it != nodes.inboxes.end() && it->second.first == comm.inbox) nodes.inboxes.erase(it);
  comm.inbox->msgs.clear();
  comm.inbox->p2p.clear();
  comm.inbox->bytes = 0;
}

void Engine::Impl::purge_inbox(Locked, Comm& comm, std::uint64_t seq) {
  Inbox& in = *comm.inbox;
  for (auto it = in.msgs.lower_bound({seq, 0, 0}); it != in.msgs.end() && std::get<0>(it->first) == seq;) {
    in.bytes -= it->second.payload.storage.size();
    it = in.msgs.erase(it);
  }
  in.failed.erase(seq);
}

// ---- sending -----------------------------------------------------------------------------

void Engine::Impl::send_node(const std::string& address, OutMessage message,
                             NodeTransport::Done also) {
  NodeTransport* t = nodes.transport.load();
  if (!t) {
    if (also) also(Code::unavailable, "no transport between nodes");
    return;
  }
  t->send(address, std::move(message), [this, address, also = std::move(also)](Code code, const std::string& why) {
    if (also) also(code, why);
    if (code == Code::ok) return;
    // The node cannot be reached: what depends on it fails now, naming it,
    // rather than at its deadline.
    log.warn("node_send_failed", {{"peer", address}, {"reason", why}});
    locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
      handle_node_down(lk, address, "", why, out, tasks);
    });
  });
}

void Engine::Impl::send_broken(Locked, Comm& comm, Code code, const std::string& reason,
                               std::uint64_t floor) {
  for (int j = 0; j < static_cast<int>(comm.node_address.size()); ++j) {
    if (j == comm.my_node) continue;
    send_node(comm.node_address[j],
              broken_message(options.rendezvous_address, comm.uid, code, reason, floor));
  }
}

void Engine::Impl::send_slot_failed(Locked, Comm& comm, std::uint64_t seq, Code code,
                                    const std::string& reason) {
  for (int j = 0; j < static_cast<int>(comm.node_address.size()); ++j) {
    if (j == comm.my_node) continue;
    send_node(comm.node_address[j],
              slot_failed_message(options.rendezvous_address, comm.uid, seq, code, reason));
  }
}

NodeRun Engine::Impl::plan_node_run(const Comm& comm, const Desc& desc,
                                    const NodeAlgorithmOptions& options) {
  const int nodes = static_cast<int>(comm.node_address.size());
  NodeRun run;
  run.plan = node_plan(desc.kind, desc.count, desc.dtype, comm.nranks, nodes, options);
  // Every rank of this node counts, whatever its memory: the host collective
  // runs over all of them.
  const std::uint64_t one = desc.count * dtype_size(desc.dtype);
  run.in_pieces =
      reads_input_in_pieces(desc.kind, one, comm.nranks, comm.local_count, nodes, options);
  // Where to start copying the input in: staging only (it allocates).
  if (run.in_pieces && desc.gpu) {
    run.first_read = first_input_read(desc.kind, desc.count, desc.dtype, comm.node_of_rank,
                                      comm.my_node, nodes, options);
  }
  return run;
}

bool Engine::Impl::check_remote_desc(Locked lk, Comm& comm, std::uint64_t seq, Deliveries& out) {
  auto sit = comm.slots.find(seq);
  if (sit == comm.slots.end() || !sit->second.has_desc || sit->second.failed) return true;
  Slot& slot = sit->second;
  for (auto it = comm.inbox->msgs.lower_bound({seq, 0, 0});
       it != comm.inbox->msgs.end() && std::get<0>(it->first) == seq; ++it) {
    const NodeIn& in = it->second;
    std::string why;
    if (!(in.desc == slot.desc)) {
      why = desc_mismatch(comm, seq, slot.desc_rank, slot.desc, in.desc_rank, in.desc);
    } else if (in.plan.known() && slot.run.plan.known() && !(in.plan == slot.run.plan)) {
      why = plan_mismatch(comm, seq, slot.desc, slot.run.plan, std::get<2>(it->first), in.plan);
    } else {
      continue;
    }
    send_slot_failed(lk, comm, seq, Code::mismatch, why);
    comm.inbox->failed[seq] = error(Code::mismatch, why, seq);
    notify(*comm.inbox);
    if (!slot.started) {
      fail_slot(lk, comm, slot, Code::mismatch, why, out);
      if (slot.arrived >= comm.local_count) end_slot(lk, comm, sit);
    }
    return false;
  }
  return true;
}

void Engine::Impl::start_across_nodes(Locked, const std::shared_ptr<Comm>& cp, std::uint64_t seq) {
  {
    std::lock_guard l(cp->exec->mu);
    cp->exec->jobs.push_back([this, cp, seq] { run_across_nodes(cp, seq); });
  }
  Executor::wake(cp->exec);
}

/// One operation between nodes as its executor runs it: what it took from
/// the slot under the lock, and how it ended.
struct Engine::Impl::AcrossOp {
  NodeCollective op;
  Desc desc;
  int desc_rank = 0;
  Clock::time_point deadline;
  std::string expiry;  // how errors name the deadline
  std::vector<Span> keep;  // holds the mappings while the operation runs
  std::vector<std::int32_t> mine;  // split: (rank, color, key) of local ranks
  std::shared_ptr<gpu::GpuStage> stage;  // a staged GPU operation's host staging
  std::shared_ptr<const NodeAlgorithmOptions> algorithms;  // as submitted (Slot::algorithms)
  NodeRun run;
  // Staged: the local ranks' output and input staging.
  std::vector<EngineChannel::Staging> outs, ins;
  // The outcome.
  Code code = Code::ok;
  std::string why;
  bool remote_failure = false;  // told by another node (not to be told back)
  std::vector<std::pair<int, int>> color_key;  // split: every rank's
};

void Engine::Impl::run_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq) {
  AcrossOp a;
  {
    EngineLock lock(mu);
    if (!prepare_across(lock.token(), *cp, seq, a)) return;
  }
  exchange_across(cp, seq, a);
  locked(
      [&](Locked lk, Deliveries& out, Tasks& next) { finish_across(lk, cp, seq, a, out, next); });
}

/// Takes what the operation needs from its slot; false: nothing to run.
bool Engine::Impl::prepare_across(Locked lk, Comm& comm, std::uint64_t seq, AcrossOp& a) {
  auto it = comm.slots.find(seq);
  if (it == comm.slots.end() || it->second.failed) return false;
  Slot& slot = it->second;
  a.desc = slot.desc;
  a.desc_rank = slot.desc_rank;
  a.deadline = slot.deadline;
  a.expiry = deadline_text(lk, slot.timeout, slot.timeout_rank);
  a.algorithms = slot.algorithms ? slot.algorithms : nodes.algorithms;
  a.run = slot.run;
  slot.across_started = Clock::now();
  NodeCollective& op = a.op;
  op.kind = a.desc.kind;
  op.dtype = a.desc.dtype;
  op.redop = a.desc.redop;
  op.count = a.desc.count;
  op.root = a.desc.root;
  op.nranks = comm.nranks;
  op.node_of_rank = comm.node_of_rank;
  for (int r = 0; r < comm.nranks; ++r) {
    if (comm.members[r].remote) continue;
    const Part& p = slot.parts[r];
    op.local.push_back(LocalBuffers{r, p.send.ptr, p.send.bytes, p.recv.ptr, p.recv.bytes});
    if (p.gpu_sync && p.gpu_sync->own_segment_on_gpu) op.own_contribution_elsewhere = true;
    a.keep.push_back(p.send);
    a.keep.push_back(p.recv);
    a.mine.insert(a.mine.end(), {r, p.color, p.key});
    if (slot.gpu_stage && p.recv.ptr != nullptr) a.outs.push_back({p.recv.ptr, p.recv.bytes, r});
    if (slot.gpu_stage && p.send.ptr != nullptr) a.ins.push_back({p.send.ptr, p.send.bytes, r});
  }
  a.stage = slot.gpu_stage;
  return true;
}

namespace {

/// A split across nodes: every node sends its ranks' (rank, color, key).
std::vector<std::pair<int, int>> exchange_split(NodeChannel& ch, int nranks,
                                                const std::vector<std::int32_t>& mine) {
  const auto all =
      node_exchange(ch, std::as_bytes(std::span<const std::int32_t>(mine)), std::uint64_t{1} << 56);
  std::vector<std::pair<int, int>> color_key(nranks, {-1, 0});
  for (const auto& bytes : all) {
    std::vector<std::int32_t> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), v.size() * 4);
    for (std::size_t k = 0; k + 2 < v.size(); k += 3) {
      if (v[k] < 0 || v[k] >= nranks) throw Error(Code::protocol, "bad split entry");
      color_key[v[k]] = {v[k + 1], v[k + 2]};
    }
  }
  return color_key;
}

}  // namespace

/// Runs the operation with the other nodes (on the executor's fiber, without
/// the lock); the outcome goes into `a`.
void Engine::Impl::exchange_across(const std::shared_ptr<Comm>& cp, std::uint64_t seq,
                                   AcrossOp& a) {
  Comm& comm = *cp;
  EngineChannel ch(*this, cp, seq, a.desc, a.run.plan, a.algorithms->input_poll, a.desc_rank,
                   a.deadline, std::move(a.expiry), options.operation_deadline);
  // Sends read the ranks' buffers in place; should the operation fail before
  // they are done, their mappings stay until then.
  ch.keep_alive(std::make_shared<const std::vector<Span>>(a.keep));
  const auto& stage = a.stage;
  if (stage && stage->in) {
    // The inputs are still arriving, piece by piece: the algorithm waits for
    // each before it reads it (NodeChannel::reading), woken from the GPU
    // executor's completion thread.
    ch.in_pieces = stage->in;
    ch.inputs = std::move(a.ins);
    stage->in->on_change([weak = std::weak_ptr<Executor>(cp->exec)] {
      if (auto ex = weak.lock()) Executor::wake(ex);
    });
  }
  if (stage && gpu != nullptr) {
    // Each chunk of an output that is final goes back to its GPU now, while
    // the rest of the exchange runs (docs/gpu.md, "Across nodes").
    ch.on_written = [this, stage, outs = std::move(a.outs)](const std::byte* p, std::uint64_t n) {
      for (const EngineChannel::Staging& o : outs) {
        if (p >= o.base && p + n <= o.base + o.bytes) {
          gpu->stage_out_early(*stage, o.rank, static_cast<std::uint64_t>(p - o.base), n);
          return;
        }
      }
    };
  }
  try {
    if (a.desc.kind == OpKind::split) {
      a.color_key = exchange_split(ch, comm.nranks, a.mine);
    } else {
      const NodeCollective& op = a.op;
      if (log.enabled(config::LogLevel::debug)) {
        // all-gather chooses by what each node ends up with.
        const std::uint64_t bytes = op.count * dtype_size(op.dtype) *
                                    (op.kind == OpKind::all_gather ? op.nranks : 1);
        log.debug("node_operation", {{"comm", comm.name},
                                     {"seq", seq},
                                     {"op", to_string(op.kind)},
                                     {"bytes", bytes},
                                     {"nodes", comm.node_address.size()},
                                     {"parallel_passes", ch.parallelism()},
                                     {"algorithm", a.run.plan.name()},
                                     {"chunk_bytes", a.run.plan.chunk}});
      }
      run_node_collective(ch, op, a.run.plan, *a.algorithms, 0);
      ch.await_inputs();
    }
  } catch (const Error& e) {
    a.code = e.code();
    a.why = e.what();
  } catch (const std::exception& e) {
    a.code = Code::internal;
    a.why = e.what();
  }
  ch.retract();  // no receive writes into the ranks' buffers past this point
  a.remote_failure = ch.remote_failure;
  if (stage && stage->in) {
    stage->in->on_change(nullptr);
    // The copies back (stage_out) may write where the inputs are read from
    // (in place): every piece must be in. The algorithms read all of every
    // input, so they waited for every piece; this holds them to it.
    if (a.code == Code::ok && stage->in->reached.load(std::memory_order_acquire) < stage->in->count) {
      a.code = Code::internal;
      a.why = "the operation between nodes ended before all of its inputs were in host memory (" +
              std::to_string(stage->in->reached.load()) + " of " +
              std::to_string(stage->in->count) + " pieces)";
    }
  }
  a.keep.clear();
}

/// Answers the operation's ranks (a split: with its children).
void Engine::Impl::finish_across(Locked lk, const std::shared_ptr<Comm>& cp, std::uint64_t seq,
                                 AcrossOp& a, Deliveries& out, Tasks& tasks) {
  Comm& comm = *cp;
  auto it = comm.slots.find(seq);
  if (it != comm.slots.end() && !it->second.failed) {
    Slot& slot = it->second;
    if (a.code == Code::ok && a.desc.kind == OpKind::split) {
      std::map<int, CommInfo> info;
      make_split_children(lk, cp, seq, a.color_key, info);
      for (int r = 0; r < comm.nranks; ++r) {
        Part& part = slot.parts[r];
        if (!part.present) continue;
        Result res;
        res.seq = seq;
        res.comm = info.count(r) ? info[r] : CommInfo{};
        out.push_back({part.sink, part.request, std::move(res)});
        part.present = false;
      }
    }
    if (a.code == Code::ok) {
      complete_slot(lk, comm, seq, out);
    } else {
      if (!a.remote_failure) send_slot_failed(lk, comm, seq, a.code, a.why);
      log.warn("operation_failed", {{"comm", comm.name},
                                    {"seq", seq},
                                    {"op", to_string(a.desc.kind)},
                                    {"reason", a.why}});
      fail_slot(lk, comm, slot, a.code, a.why, out);
      end_slot(lk, comm, it);
    }
  }
  progress(lk, cp, out, tasks);
}

void Engine::Impl::start_remote_item(Locked lk, const std::shared_ptr<Comm>& cp,
                                     const std::shared_ptr<Group>& g, P2PItem& item,
                                     Deliveries& out,
                                     Tasks& tasks) {
  Comm& comm = *cp;
  log.debug("p2p_remote", {{"comm", comm.name}, {"rank", g->rank}, {"peer", item.peer},
                           {"send", item.is_send}, {"index", item.index}});
  if (item.is_send) {
    item.started = true;
    const std::string address = comm.node_address[comm.node_of_rank[item.peer]];
    const std::string node = comm.node_text(comm.node_of_rank[item.peer]);
    tasks.push_back([this, cp, g, address, node, span = item.span, peer = item.peer,
                     index = item.index, count = item.count, dtype = item.dtype] {
      // Read in place; the registration keeps the mapping alive until sent.
      HostRegion* region = span.reg && !span.reg->device ? span.reg->mapping.region() : nullptr;
      auto bytes = p2p_message(options.rendezvous_address, cp->uid, cp->my_node, g->rank, peer,
                               index, count, dtype, std::span<const std::byte>(span.ptr, span.bytes),
                               span.reg, region);
      NodeTransport* t = nodes.transport.load();
      if (!t) return;
      // The send is done (eagerly) once the bytes are in the connection.
      t->send(address, std::move(bytes),
                      [this, cp, g, peer, node](Code code, const std::string& why) {
                        locked([&](Locked lk2, Deliveries& out2, Tasks& tasks2) {
                          if (code != Code::ok) {
                            fail_group(lk2, *cp, *g, code,
                                       "send to rank " + std::to_string(peer) + " on node " +
                                           node + " failed: " + why,
                                       out2);
                          } else {
                            item_done(lk2, *cp, *g, out2);
                          }
                          progress(lk2, cp, out2, tasks2);
                        });
                      });
    });
    return;
  }
  auto it = comm.inbox->p2p.find({item.peer, g->rank, item.index});
  if (it == comm.inbox->p2p.end()) return;  // not here yet: progress() runs again when it is
  item.started = true;
  auto in = std::make_shared<NodeIn>(std::move(it->second));
  comm.inbox->bytes -= in->payload.storage.size();
  comm.inbox->p2p.erase(it);
  if (in->dtype != item.dtype || in->payload.size != item.count * dtype_size(item.dtype)) {
    fail_group(lk, comm, *g, Code::mismatch,
               p2p_mismatch(item.peer, in->count, in->dtype, g->rank, item.count, item.dtype),
               out);
    return;
  }
  tasks.push_back([this, cp, g, span = item.span, in] {
    if (span.bytes != 0) std::memcpy(span.ptr, in->payload.data(), span.bytes);
    locked([&](Locked lk2, Deliveries& out2, Tasks& tasks2) {
      item_done(lk2, *cp, *g, out2);
      progress(lk2, cp, out2, tasks2);
    });
  });
}

void Engine::Impl::handle_node_down(Locked lk, const std::string& address, const std::string& node,
                                    const std::string& why, Deliveries& out,
                                    Tasks& tasks) {
  const std::string who = "node " + (node.empty() ? address : node + " (" + address + ")");
  // Ranks here waiting for that node's rendezvous.
  std::set<std::string> keys;
  for (auto& [key, p] : joins.pending) {
    if (p.rendezvous == address) keys.insert(key);
  }
  for (const auto& key : keys) {
    fail_pending_joins(lk, key, -1, Code::unavailable,
                       "the rendezvous daemon, " + who + ", went away: " + why, out);
  }
  // Rendezvous here with ranks from that node.
  for (auto it = joins.here.begin(); it != joins.here.end();) {
    Rendezvous& rv = it->second;
    const bool involved = std::any_of(rv.joined.begin(), rv.joined.end(), [&](const auto& j) {
      return j && j->address == address;
    });
    if (!involved) {
      ++it;
      continue;
    }
    fail_rendezvous(lk, it->first, rv, Code::remote, "ranks on " + who + " went away: " + why, -1,
                    out);
    it = joins.here.erase(it);
  }
  for (auto& cp : all_comms(lk)) {
    if (!cp->spans_nodes()) continue;
    const auto n = std::find(cp->node_address.begin(), cp->node_address.end(), address);
    if (n == cp->node_address.end()) continue;
    const int idx = static_cast<int>(n - cp->node_address.begin());
    break_comm(lk, *cp, Code::remote,
               "node " + cp->node_text(idx) + ", which hosts " + ranks_text(*cp, idx) +
                   ", is unreachable: " + why,
               out, false);
    progress(lk, cp, out, tasks);
  }
}

void Engine::Impl::check_node_deadlines(Locked lk, Clock::time_point now, Deliveries& out) {
  std::set<std::string> expired;
  for (auto& [key, p] : joins.pending) {
    if (now >= p.deadline) expired.insert(key);
  }
  for (const auto& key : expired) {
    auto it = joins.pending.find(key);
    fail_pending_joins(lk, key, -1, Code::timeout,
                       "no answer from the rendezvous daemon " + it->second.rendezvous +
                           " within " +
                           std::to_string(options.rendezvous_deadline.count()) +
                           " ms (deadlines.rendezvous_ms): not every rank joined there, or it "
                           "cannot be reached",
                       out);
  }
  for (auto it = nodes.inboxes.begin(); it != nodes.inboxes.end();) {
    if (!it->second.first->claimed && now >= it->second.first->expires) {
      it = nodes.inboxes.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::Impl::node_client_gone(Locked, std::uint64_t session) {
  for (auto it = joins.pending.begin(); it != joins.pending.end();) {
    if (it->second.client.session != session) {
      ++it;
      continue;
    }
    const PendingJoin& p = it->second;
    send_node(p.rendezvous, join_cancel(options.rendezvous_address, p.id, p.rendezvous, p.rank,
                                        "disconnected before all ranks joined"));
    it = joins.pending.erase(it);
  }
}

void Engine::Impl::node_shutdown(Locked lk, const std::string& reason, Deliveries& out) {
  std::set<std::string> keys;
  for (auto& [key, p] : joins.pending) keys.insert(key);
  for (const auto& key : keys) fail_pending_joins(lk, key, -1, Code::aborted, reason, out);
  wake_executors(lk);
}

}  // namespace collectived::engine

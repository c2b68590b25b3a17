// Requests and matching: a rank's k-th collective on a communicator is
// sequence number k, its Slot collects every rank's share, and a rank's
// queue keeps its operations in submission order. An operation starts when
// it is at the head of every rank's queue (a send/recv pair: when both
// groups lead their ranks' queues).
#include <algorithm>

#include "engine/engine_core.h"
#include "engine/plan.h"
#include "engine/validate.h"

namespace collectived::engine {

Result Engine::Impl::error(Code code, std::string message, std::uint64_t seq) {
  Result r;
  r.code = code;
  r.message = std::move(message);
  r.seq = seq;
  return r;
}

void Engine::Impl::deliver(Deliveries& out) {
  for (auto& d : out) {
    if (d.sink) d.sink->complete(d.request, std::move(d.result));
  }
  out.clear();
}

std::pair<std::shared_ptr<Comm>, int> Engine::Impl::resolve(Locked, const ClientRef& client,
                                                            std::uint64_t handle) {
  auto it = communicators.by_handle.find(handle);
  if (it == communicators.by_handle.end()) {
    throw Error(Code::not_found, "unknown communicator handle " + std::to_string(handle) +
                                     " (never created, destroyed, or aborted)");
  }
  auto& [comm, rank] = it->second;
  if (comm->members[rank].session != client.session) {
    throw Error(Code::permission_denied,
                "communicator handle " + std::to_string(handle) + " belongs to another client");
  }
  return it->second;
}

std::pair<std::shared_ptr<Comm>, int> Engine::Impl::resolve_or_answer(
    Locked lk, const ClientRef& client, std::uint64_t request, std::uint64_t handle,
    std::string_view what, Deliveries& out) {
  try {
    return resolve(lk, client, handle);
  } catch (const Error& e) {
    out.push_back({client.sink, request, error(e.code(), std::string(what) + ": " + e.what())});
    return {nullptr, 0};
  }
}

// ---- submissions -----------------------------------------------------------------

void Engine::Impl::submit_slot(const ClientRef& client, std::uint64_t request,
                               std::uint64_t handle, const CollectiveArgs& args, int color,
                               int key) {
  locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    auto [cp, rank] = resolve_or_answer(lk, client, request, handle, to_string(args.kind), out);
    if (!cp) return;
    Comm& comm = *cp;
    const std::string op(to_string(args.kind));
    if (stopping) {
      out.push_back({client.sink, request,
                     error(Code::aborted, op + " on " + comm.where(rank) +
                                              ": the daemon is stopping")});
      return;
    }
    if (comm.broken && comm.members[rank].next_seq >= comm.broken_floor) {
      out.push_back({client.sink, request,
                     error(comm.broken->code,
                           op + " on " + comm.where(rank) + ": " + comm.broken->message)});
      return;
    }
    submit_part(lk, client, request, cp, rank, args, color, key, out, tasks);
  }, client.inline_small);
}

void Engine::Impl::submit_part(Locked lk, const ClientRef& client, std::uint64_t request,
                               const std::shared_ptr<Comm>& cp, int rank,
                               const CollectiveArgs& args, int color, int key, Deliveries& out,
                               Tasks& tasks) {
  Comm& comm = *cp;
  const std::string op(to_string(args.kind));
  Member& m = comm.members[rank];
  const std::uint64_t seq = m.next_seq++;
  // Not a structured binding: the lambda below captures `it` (clang before
  // 16 cannot capture a binding).
  const auto emplaced = comm.slots.try_emplace(seq);
  const auto it = emplaced.first;
  const bool fresh = emplaced.second;
  Slot& slot = it->second;
  const Clock::time_point now = Clock::now();
  if (fresh) {
    slot.seq = seq;
    slot.parts.resize(comm.nranks);
    slot.created = now;
  }
  note_deadline(lk, slot, fresh, now, args.deadline, rank);
  slot.arrived += 1;
  // The slot is done with once every local rank has come by (failed slots).
  auto end_if_all_in = [&] {
    if (slot.arrived >= comm.local_count) end_slot(lk, comm, it);
  };
  if (slot.failed) {
    Result res = slot.failure;
    res.message = op + " (seq " + std::to_string(seq) + ") on " + comm.where(rank) + ": " +
                  slot.failure.message;
    out.push_back({client.sink, request, std::move(res)});
    end_if_all_in();
    return;
  }
  Part part;
  part.request = request;
  part.sink = client.sink;
  part.session = client.session;
  part.pid = client.pid;
  part.color = color;
  part.key = key;
  Desc desc;
  try {
    desc = validate_collective(registry, client, args, comm.nranks, rank, gpu != nullptr, part);
  } catch (const Error& e) {
    part.present = true;
    slot.parts[rank] = std::move(part);
    if (!slot.has_desc) slot.desc.kind = args.kind;
    fail_slot(lk, comm, slot, e.code(),
              comm.who(rank) + " submitted an invalid " + op + ": " + e.what(), out);
    end_if_all_in();
    return;
  }
  part.present = true;
  slot.parts[rank] = std::move(part);
  if (!slot.has_desc) {
    slot.desc = desc;
    slot.has_desc = true;
    slot.desc_rank = rank;
    if (comm.spans_nodes()) {
      slot.algorithms = nodes.algorithms;
      slot.run = plan_node_run(comm, desc, *slot.algorithms);
      // Other nodes may have sent their view of this operation already.
      if (!check_remote_desc(lk, comm, seq, out)) return;
    }
  } else if (!(slot.desc == desc) || slot.desc.gpu != desc.gpu) {
    fail_slot(lk, comm, slot, Code::mismatch,
              desc_mismatch(comm, seq, slot.desc_rank, slot.desc, rank, desc), out);
    end_if_all_in();
    return;
  }
  m.queue.push_back(Work{Work::Type::slot, seq, nullptr, 0, nullptr});
  progress(lk, cp, out, tasks);
}

void Engine::Impl::submit_group(const ClientRef& client, std::uint64_t request,
                                std::uint64_t handle, const std::vector<P2PArgs>& items,
                                std::shared_ptr<gpu::RankSync> gpu_sync,
                                std::chrono::milliseconds deadline) {
  locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    auto [cp, rank_] = resolve_or_answer(lk, client, request, handle, "send/recv group", out);
    if (!cp) return;
    Comm& comm = *cp;
    const auto rank = rank_;  // a structured binding cannot be captured before clang 16
    auto fail = [&](Code code, const std::string& why) {
      out.push_back({client.sink, request,
                     error(code, "send/recv group on " + comm.where(rank) + ": " + why)});
    };
    if (stopping) return fail(Code::aborted, "the daemon is stopping");
    if (comm.broken) return fail(comm.broken->code, comm.broken->message);
    auto g = std::make_shared<Group>();
    g->rank = rank;
    g->request = request;
    g->sink = client.sink;
    g->created = Clock::now();
    g->deadline = g->created + budget(lk, deadline);
    if (deadline.count() > 0) g->timeout = budget(lk, deadline);
    try {
      for (std::size_t i = 0; i < items.size(); ++i) {
        g->items.push_back(validate_p2p_item(registry, client, items[i], i, comm.nranks,
                                             gpu_sync != nullptr));
      }
    } catch (const Error& e) {
      return fail(e.code(), e.what());
    }
    if (gpu_sync && gpu == nullptr) return fail(Code::unavailable, "this daemon has no GPU executor");
    if (g->items.empty()) {
      out.push_back({client.sink, request, Result{}});
      return;  // a GPU group's stream is released as `gpu_sync` goes
    }
    g->gpu_sync = std::move(gpu_sync);
    // Indices pair the k-th send from a to b with the k-th receive at b from a.
    for (auto& item : g->items) {
      auto& counter = item.is_send ? comm.sends[{rank, item.peer}] : comm.recvs[{item.peer, rank}];
      item.index = counter++;
    }
    g->seq = comm.next_group_seq++;
    comm.members[rank].queue.push_back(Work{Work::Type::group, 0, g, 0, nullptr});
    progress(lk, cp, out, tasks);
  }, client.inline_small);
}

void Engine::Impl::leave(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    auto [cp, rank] = resolve_or_answer(lk, client, request, handle, "comm_destroy", out);
    if (!cp) return;
    Member& m = cp->members[rank];
    m.queue.push_back(Work{Work::Type::leave, 0, nullptr, request, client.sink});
    progress(lk, cp, out, tasks);
  });
}

void Engine::Impl::abort(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  locked([&](Locked lk, Deliveries& out, Tasks&) {
    auto [cp, rank] = resolve_or_answer(lk, client, request, handle, "comm_abort", out);
    if (!cp) return;
    Comm& comm = *cp;
    log.warn("comm_aborted", {{"comm", comm.name}, {"rank", rank}, {"pid", client.pid}});
    break_comm(lk, comm, Code::aborted,
               "the communicator was aborted by " + comm.who(rank) + " (comm_abort)", out);
    // The aborting rank's own queued leaves are answered; then it is gone.
    Member& m = comm.members[rank];
    for (auto& w : m.queue) {
      if (w.type == Work::Type::leave) out.push_back({w.sink, w.request, Result{}});
    }
    m.queue.clear();
    drop_member(lk, comm, rank);
    out.push_back({client.sink, request, Result{}});
  });
}

// ---- progress --------------------------------------------------------------------

void Engine::Impl::progress(Locked lk, const std::shared_ptr<Comm>& cp, Deliveries& out,
                            Tasks& tasks) {
  Comm& comm = *cp;
  for (bool changed = true; changed;) {
    changed = answer_leaves(lk, comm, out);
    if (comm.broken && comm.broken_floor == 0) break;
    changed = start_ready_collective(lk, cp, out, tasks) || changed;
    changed = pair_groups(lk, cp, out, tasks) || changed;
  }
}

/// Leaves whose earlier operations are all done.
bool Engine::Impl::answer_leaves(Locked lk, Comm& comm, Deliveries& out) {
  bool changed = false;
  for (auto& m : comm.members) {
    if (!m.active || m.queue.empty() || m.queue.front().type != Work::Type::leave) continue;
    Work w = std::move(m.queue.front());
    m.queue.pop_front();
    out.push_back({w.sink, w.request, Result{}});
    drop_member(lk, comm, m.rank);
    log.debug("comm_left", {{"comm", comm.name}, {"rank", m.rank}, {"pid", m.pid}});
    if (comm.active_members() > 0) {
      // Across nodes, the operations it finished may still be running
      // elsewhere: only later ones fail.
      break_comm(lk, comm, Code::remote,
                 comm.who(m.rank) + " left the communicator (comm_destroy)", out, true,
                 comm.spans_nodes() ? m.next_seq : 0);
    }
    changed = true;
  }
  return changed;
}

/// A collective starts when it is at the head of every (local) rank's queue;
/// other nodes' ranks are met by the algorithm between nodes.
bool Engine::Impl::start_ready_collective(Locked lk, const std::shared_ptr<Comm>& cp,
                                          Deliveries& out, Tasks& tasks) {
  Comm& comm = *cp;
  auto first = std::find_if(comm.members.begin(), comm.members.end(),
                            [](const Member& m) { return !m.remote; });
  if (first == comm.members.end() || first->queue.empty() ||
      first->queue.front().type != Work::Type::slot) {
    return false;
  }
  const std::uint64_t seq = first->queue.front().seq;
  auto it = comm.slots.find(seq);
  if (it == comm.slots.end() || it->second.started || it->second.failed ||
      (comm.broken && seq >= comm.broken_floor) || it->second.arrived != comm.local_count) {
    return false;
  }
  const bool at_heads = std::all_of(comm.members.begin(), comm.members.end(), [&](const Member& m) {
    return m.remote || (!m.queue.empty() && m.queue.front().type == Work::Type::slot &&
                        m.queue.front().seq == seq);
  });
  if (!at_heads) return false;
  start_slot(lk, cp, it->second, out, tasks);
  return true;
}

namespace {
/// The send/recv groups at the head of a rank's queue, before its first
/// collective or leave (copies: pairing may remove them from the queue).
/// Stream-ordered (GPU) groups only at the very head: the client's stream
/// waits on one flag word whose tickets must complete in order.
std::vector<std::shared_ptr<Group>> leading_groups(const Member& m) {
  std::vector<std::shared_ptr<Group>> run;
  for (const Work& w : m.queue) {
    if (w.type != Work::Type::group) break;
    if (w.group->gpu_sync && !run.empty()) break;
    run.push_back(w.group);
    if (w.group->gpu_sync) break;
  }
  return run;
}
}  // namespace

/// Point-to-point pairs whose groups are both in their ranks' leading run of
/// groups (no collective before them): a rank's isend and its later irecv
/// both wait for their peers, as Gloo's and NCCL's do, so two ranks that each
/// send first and receive second meet. The k-th send from a to b still meets
/// the k-th receive at b from a (index).
bool Engine::Impl::pair_groups(Locked lk, const std::shared_ptr<Comm>& cp, Deliveries& out,
                               Tasks& tasks) {
  Comm& comm = *cp;
  bool changed = false;
  for (auto& m : comm.members) {
    if (comm.broken) break;
    for (const auto& g : leading_groups(m)) {
      if (comm.broken || g->failed) break;
      for (std::size_t k = 0; k < g->items.size(); ++k) {
        if (pair_item(lk, cp, m, g, k, changed, out, tasks) == Next::group) break;
      }
    }
  }
  return changed;
}

/// Item `k` of `m`'s group `g`: started with its peer's match if it can be.
Engine::Impl::Next Engine::Impl::pair_item(Locked lk, const std::shared_ptr<Comm>& cp, Member& m,
                                           const std::shared_ptr<Group>& g, std::size_t k,
                                           bool& changed, Deliveries& out, Tasks& tasks) {
  Comm& comm = *cp;
  auto& item = g->items[k];
  if (item.started) return Next::item;
  if (comm.members[item.peer].remote) {
    if (g->gpu_sync && !item.staged) {
      // Through pinned host staging: a send runs once the executor has its
      // data on the host, a receive at once.
      if (!item.staging) stage_gpu_item(lk, cp, g, k, out);
      if (g->failed) return Next::group;
      if (!item.staged) return Next::item;
    }
    start_remote_item(lk, cp, g, item, out, tasks);
    return Next::item;
  }
  if (!item.is_send) return Next::item;
  Member& peer = comm.members[item.peer];
  std::shared_ptr<Group> h;
  std::vector<P2PItem>::iterator match;
  for (const auto& cand : leading_groups(peer)) {
    match = std::find_if(cand->items.begin(), cand->items.end(), [&](const P2PItem& i) {
      return !i.is_send && i.peer == m.rank && i.index == item.index;
    });
    if (match != cand->items.end()) {
      h = cand;
      break;
    }
  }
  if (!h) return Next::item;
  if (match->count * dtype_size(match->dtype) != item.count * dtype_size(item.dtype) ||
      match->dtype != item.dtype) {
    const std::string why =
        p2p_mismatch(m.rank, item.count, item.dtype, item.peer, match->count, match->dtype);
    fail_group(lk, comm, *g, Code::mismatch, why, out);
    if (h != g) fail_group(lk, comm, *h, Code::mismatch, why, out);
    changed = true;
    return Next::group;
  }
  const bool mixed = static_cast<bool>(g->gpu_sync) != static_cast<bool>(h->gpu_sync);
  if (mixed) {
    // One side GPU memory, the other host memory: the GPU side goes through
    // pinned host staging as it does across nodes (a send's data is copied
    // out once its stream reaches the group, a receive's staging is copied
    // back before its group answers); the pair itself is then an ordinary
    // host copy.
    const bool gpu_sends = static_cast<bool>(g->gpu_sync);
    const auto& gg = gpu_sends ? g : h;
    const std::size_t gk = gpu_sends ? k : static_cast<std::size_t>(match - h->items.begin());
    if (!gg->items[gk].staging) stage_gpu_item(lk, cp, gg, gk, out);
    if (gg->failed) {
      // The host side would otherwise wait for its deadline.
      const auto& other = gpu_sends ? h : g;
      fail_group(lk, comm, *other, Code::remote,
                 "its peer rank " + std::to_string(gg->rank) +
                     " (GPU buffer) could not be staged on the host",
                 out);
      changed = true;
      return Next::group;
    }
    if (!gg->items[gk].staged) return Next::item;  // the send's data is not on the host yet
  }
  item.started = true;
  match->started = true;
  if (g->gpu_sync && !mixed) {
    start_gpu_pair(lk, cp, g, h, item, *match, out);
    changed = true;
    return g->failed || h->failed ? Next::group : Next::item;
  }
  start_pair(cp, g, h, item.span, match->span, tasks);
  return Next::item;
}

// ---- starting and completing -------------------------------------------------------

void Engine::Impl::start_slot(Locked lk, const std::shared_ptr<Comm>& cp, Slot& slot,
                              Deliveries& out, Tasks& tasks) {
  slot.started = true;
  if (slot.desc.gpu) return start_gpu_slot(lk, cp, slot, out);
  if (cp->spans_nodes()) return start_across_nodes(lk, cp, slot.seq);
  if (slot.desc.kind == OpKind::split) return do_split(lk, cp, slot, out);
  if (slot.desc.kind == OpKind::barrier) return complete_slot(lk, *cp, slot.seq, out);
  start_host_slot(lk, cp, slot, tasks);
}

/// A collective inside the node: tasks for the worker pool.
void Engine::Impl::start_host_slot(Locked, const std::shared_ptr<Comm>& cp, Slot& slot,
                                   Tasks& tasks) {
  const std::uint64_t seq = slot.seq;
  CollectivePlanInput in;
  in.kind = slot.desc.kind;
  in.dtype = slot.desc.dtype;
  in.redop = slot.desc.redop;
  in.count = slot.desc.count;
  in.root = slot.desc.root;
  for (auto& part : slot.parts) {
    in.send.push_back(part.send);
    in.recv.push_back(part.recv);
  }
  auto more = plan_collective(std::move(in), pool.size(), [this, cp, seq] {
    locked([&](Locked lk, Deliveries& done, Tasks& next) {
      complete_slot(lk, *cp, seq, done);
      progress(lk, cp, done, next);
    });
  });
  for (auto& t : more) tasks.push_back(std::move(t));
}

void Engine::Impl::complete_slot(Locked lk, Comm& comm, std::uint64_t seq, Deliveries& out) {
  auto it = comm.slots.find(seq);
  if (it == comm.slots.end()) return;
  Slot& slot = it->second;
  // Staged GPU operation: the answers wait for the copies back to the GPUs.
  Deliveries staged;
  Deliveries& answers = slot.gpu_stage ? staged : out;
  for (int r = 0; r < comm.nranks; ++r) {
    Part& part = slot.parts[r];
    Member& m = comm.members[r];
    if (!m.queue.empty() && m.queue.front().type == Work::Type::slot &&
        m.queue.front().seq == seq) {
      m.queue.pop_front();
    }
    if (!part.present) continue;
    Result res;
    res.seq = seq;
    answers.push_back({part.sink, part.request, std::move(res)});
  }
  ++communicators.completed;
  observe_slot(lk, comm, slot, Code::ok);
  if (slot.gpu_stage) stage_out_slot(lk, comm, slot, std::move(staged), out);
  end_slot(lk, comm, it);
}

void Engine::Impl::start_pair(const std::shared_ptr<Comm>& cp, std::shared_ptr<Group> sender,
                              std::shared_ptr<Group> receiver, Span src, Span dst, Tasks& tasks) {
  auto more = plan_copy(std::move(src), std::move(dst), pool.size(), [this, cp, sender, receiver] {
    locked([&](Locked lk, Deliveries& done, Tasks& next) {
      item_done(lk, *cp, *sender, done);
      item_done(lk, *cp, *receiver, done);
      progress(lk, cp, done, next);
    });
  });
  for (auto& t : more) tasks.push_back(std::move(t));
}

void Engine::Impl::item_done(Locked lk, Comm& comm, Group& g, Deliveries& out) {
  ++g.done;
  finish_group(lk, comm, g, out);
}

/// A GPU group's receives from other nodes are copied back to the GPU first,
/// once the rank's stream has reached the group (its ready word): they may
/// have arrived before.
void Engine::Impl::finish_group(Locked lk, Comm& comm, Group& g, Deliveries& out) {
  if (g.done < g.items.size() || g.answered) return;
  for (const auto& item : g.items) {
    if (item.staged && !item.is_send && !item.ready) return;  // stage_gpu_item finishes it
  }
  g.answered = true;
  Result res;
  res.seq = g.seq;
  ++communicators.completed;
  observe_group(lk, comm, g, Code::ok);
  remove_work(lk, comm.members[g.rank],
              [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
  if (!g.gpu_sync) {
    out.push_back({g.sink, g.request, std::move(res)});
    return;
  }
  stage_back_group(lk, g, std::move(res), out);
}

}  // namespace collectived::engine

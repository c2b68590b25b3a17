// What ends operations other than their completion: a failed or mismatched
// slot, a broken communicator (a rank died, left or aborted; a node went
// away), deadlines, a departed client, the daemon stopping. And what the
// observer (metrics) hears of every finished operation.
#include <algorithm>

#include "engine/engine_core.h"

namespace collectived::engine {

std::chrono::milliseconds Engine::Impl::budget(Locked, std::chrono::milliseconds client) const {
  // Capped so that now + it cannot overflow the clock.
  constexpr std::chrono::milliseconds kMax{std::int64_t{1} << 40};  // ~35 years
  return client.count() > 0 ? std::min(client, kMax) : options.operation_deadline;
}

void Engine::Impl::note_deadline(Locked lk, Slot& slot, bool fresh, Clock::time_point now,
                                 std::chrono::milliseconds client, int rank) const {
  const Clock::time_point d = now + budget(lk, client);
  if (!fresh && d >= slot.deadline) return;
  slot.deadline = d;
  slot.timeout = client.count() > 0 ? budget(lk, client) : std::chrono::milliseconds(0);
  slot.timeout_rank = client.count() > 0 ? rank : -1;
}

/// The node's as it always was, "30000 ms (deadlines.operation_ms)"; a
/// client's with whose it is.
std::string Engine::Impl::deadline_text(Locked, std::chrono::milliseconds client, int rank) const {
  const std::string node = std::to_string(options.operation_deadline.count());
  if (client.count() <= 0) return node + " ms (deadlines.operation_ms)";
  return std::to_string(client.count()) + " ms (the operation's timeout, set by rank " +
         std::to_string(rank) + "; deadlines.operation_ms is " + node + ")";
}

void Engine::Impl::remove_work(Locked, Member& m, const std::function<bool(const Work&)>& pred) {
  m.queue.erase(std::remove_if(m.queue.begin(), m.queue.end(), pred), m.queue.end());
}

// ---- metrics (EngineOptions::observer) -------------------------------------------------

void Engine::Impl::observe_slot(Locked, const Comm& comm, const Slot& slot, Code code) const {
  if (options.observer == nullptr) return;
  const Desc& d = slot.desc;
  std::uint64_t bytes = d.count * dtype_size(d.dtype);
  if (d.kind == OpKind::all_gather || d.kind == OpKind::reduce_scatter ||
      d.kind == OpKind::all_to_all) {
    bytes *= static_cast<std::uint64_t>(comm.nranks);
  } else if (d.kind == OpKind::barrier || d.kind == OpKind::split) {
    bytes = 0;
  }
  // In-node operations are copies between clients; spanning ones use the peer links.
  options.observer->operation_finished(d.kind, code, bytes, Clock::now() - slot.created,
                                       comm.spans_nodes() ? "tcp" : "local");
}

void Engine::Impl::observe_group(Locked, const Comm& comm, const Group& g, Code code) const {
  if (options.observer == nullptr) return;
  std::uint64_t bytes = 0;
  for (const auto& item : g.items) {
    if (item.is_send) bytes += item.count * dtype_size(item.dtype);
  }
  options.observer->operation_finished(OpKind::p2p, code, bytes, Clock::now() - g.created,
                                       comm.spans_nodes() ? "tcp" : "local");
}

// ---- failing -----------------------------------------------------------------------------

void Engine::Impl::fail_slot(Locked lk, Comm& comm, Slot& slot, Code code, const std::string& reason,
                             Deliveries& out, bool unqueue) {
  if (!slot.failed) observe_slot(lk, comm, slot, code);
  slot.failed = true;
  slot.failure = error(code, reason, slot.seq);
  for (int r = 0; r < comm.nranks; ++r) {
    Part& part = slot.parts[r];
    if (!part.present) continue;
    part.present = false;
    Result res = slot.failure;
    res.message = std::string(to_string(slot.desc.kind)) + " (seq " + std::to_string(slot.seq) +
                  ") on " + comm.where(r) + ": " + reason;
    out.push_back({part.sink, part.request, std::move(res)});
    part.send = {};
    part.recv = {};
    part.gpu_sync.reset();  // releases the client's stream (its flag is written)
    if (unqueue) {
      remove_work(lk, comm.members[r], [&](const Work& w) {
        return w.type == Work::Type::slot && w.seq == slot.seq;
      });
    }
  }
}

void Engine::Impl::fail_group(Locked lk, Comm& comm, Group& g, Code code, const std::string& reason,
                              Deliveries& out, bool unqueue) {
  if (g.failed || g.answered) return;
  observe_group(lk, comm, g, code);
  g.failed = true;
  g.answered = true;
  out.push_back({g.sink, g.request,
                 error(code,
                       "send/recv group (seq " + std::to_string(g.seq) + ") on " +
                           comm.where(g.rank) + ": " + reason,
                       g.seq)});
  if (unqueue) {
    remove_work(lk, comm.members[g.rank],
                [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
  }
  drop_gpu(lk, g);
}

Engine::Impl::SlotIt Engine::Impl::end_slot(Locked lk, Comm& comm, SlotIt it) {
  if (comm.spans_nodes()) {
    comm.end(it->first);
    purge_inbox(lk, comm, it->first);
  }
  return comm.slots.erase(it);
}

void Engine::Impl::break_comm(Locked lk, Comm& comm, Code code, const std::string& reason,
                              Deliveries& out, bool tell_nodes, std::uint64_t floor) {
  const bool lower = !comm.broken || floor < comm.broken_floor;
  if (comm.spans_nodes() && lower) {
    comm.inbox->broken = error(code, reason);
    notify(*comm.inbox);
    if (tell_nodes) send_broken(lk, comm, code, reason, floor);
  }
  if (!comm.broken) {
    comm.broken = error(code, reason);
    comm.broken_floor = floor;
  } else if (floor < comm.broken_floor) {
    comm.broken_floor = floor;
  }
  floor = comm.broken_floor;
  // The queues are cleared once at the end, not once per failed operation: a
  // daemon stopping under thousands of non-blocking submissions spent minutes
  // in that quadratic loop, past systemd's stop timeout.
  std::vector<std::uint64_t> failed;  // ascending, as the map is
  for (auto it = comm.slots.begin(); it != comm.slots.end();) {
    if (!it->second.started && it->first >= floor) {
      if (!it->second.failed) fail_slot(lk, comm, it->second, code, reason, out, false);
      failed.push_back(it->first);
      it = end_slot(lk, comm, it);
    } else {
      ++it;
    }
  }
  for (auto& m : comm.members) {
    std::vector<const Group*> gone;
    std::vector<std::shared_ptr<Group>> groups;
    for (auto& w : m.queue) {
      if (w.type == Work::Type::group) groups.push_back(w.group);
    }
    for (auto& g : groups) {
      const bool running = std::any_of(g->items.begin(), g->items.end(),
                                       [](const P2PItem& i) { return i.started; });
      if (running || g->failed || g->answered) continue;
      fail_group(lk, comm, *g, code, reason, out, false);
      gone.push_back(g.get());
    }
    std::sort(gone.begin(), gone.end());
    if (failed.empty() && gone.empty()) continue;
    remove_work(lk, m, [&](const Work& w) {
      if (w.type == Work::Type::slot) return std::binary_search(failed.begin(), failed.end(), w.seq);
      return w.type == Work::Type::group &&
             std::binary_search(gone.begin(), gone.end(), static_cast<const Group*>(w.group.get()));
    });
  }
}

std::vector<std::shared_ptr<Comm>> Engine::Impl::all_comms(Locked) const {
  std::vector<std::shared_ptr<Comm>> comms;
  for (const auto& [h, cr] : communicators.by_handle) comms.push_back(cr.first);
  std::sort(comms.begin(), comms.end());
  comms.erase(std::unique(comms.begin(), comms.end()), comms.end());
  return comms;
}

void Engine::Impl::drop_member(Locked lk, Comm& comm, int rank) {
  Member& m = comm.members[rank];
  m.active = false;
  communicators.by_handle.erase(m.handle);
  const bool local_left = std::any_of(comm.members.begin(), comm.members.end(),
                                      [](const Member& x) { return x.active && !x.remote; });
  if (!local_left) release_nodes(lk, comm);
}

// ---- clients, deadlines, stopping ------------------------------------------------------

void Engine::Impl::client_gone(std::uint64_t session) {
  locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    // Rendezvous this client took part in cannot complete any more.
    rendezvous_client_gone(lk, session, out);
    node_client_gone(lk, session);
    std::vector<std::pair<std::shared_ptr<Comm>, int>> mine;
    for (auto& [h, cr] : communicators.by_handle) {
      const Member& m = cr.first->members[cr.second];
      if (!m.remote && m.session == session) mine.push_back(cr);
    }
    for (auto& [cp, rank] : mine) {
      Comm& comm = *cp;
      Member& m = comm.members[rank];
      m.queue.clear();
      drop_member(lk, comm, rank);
      if (comm.active_members() == 0) continue;
      log.warn("rank_died", {{"comm", comm.name},
                             {"rank", rank},
                             {"pid", m.pid},
                             {"node", options.node_name},
                             {"action", "the communicator is broken: see why the process "
                                        "exited (its log, dmesg for the OOM killer)"}});
      break_comm(lk, comm, Code::remote,
                 comm.who(rank) + (comm.spans_nodes() ? "" : " on node " + options.node_name) +
                     " disconnected (its process exited or was killed)",
                 out);
      progress(lk, cp, out, tasks);
    }
  });
}

void Engine::Impl::check_deadlines() {
  locked([&](Locked lk, Deliveries& out, Tasks&) {
    const auto now = Clock::now();
    wake_executors(lk);  // operations between nodes re-check their deadlines
    expire_rendezvous(lk, now, out);
    check_node_deadlines(lk, now, out);
    for (auto& cp : all_comms(lk)) {
      expire_slots(lk, *cp, now, out);
      expire_groups(lk, *cp, now, out);
    }
  });
}

void Engine::Impl::expire_slots(Locked lk, Comm& comm, Clock::time_point now, Deliveries& out) {
  for (auto it = comm.slots.begin(); it != comm.slots.end();) {
    Slot& slot = it->second;
    if (slot.started || slot.failed || now < slot.deadline) {
      ++it;
      continue;
    }
    std::vector<int> missing;
    std::string detail;
    for (int r = 0; r < comm.nranks; ++r) {
      if (!comm.members[r].remote && comm.members[r].next_seq <= slot.seq) {
        missing.push_back(r);
        if (!detail.empty()) detail += ", ";
        detail += comm.who(r);
      }
    }
    std::string why;
    const std::string after = deadline_text(lk, slot.timeout, slot.timeout_rank);
    if (!missing.empty()) {
      why = "timed out after " + after + " on node " + options.node_name +
            ": ranks that did not submit it: " + detail;
    } else {
      why = "timed out after " + after +
            ": every rank submitted it, but an earlier operation of this communicator "
            "never finished";
    }
    log.warn("operation_timeout",
             {{"comm", comm.name},
              {"seq", slot.seq},
              {"op", to_string(slot.desc.kind)},
              {"node", options.node_name},
              {"missing_ranks", rank_list(missing)},
              {"missing", detail},
              {"deadline", after},
              {"action", missing.empty()
                             ? "an earlier operation of the communicator never finished"
                             : "look at what the missing ranks' processes do (py-spy dump "
                               "--pid PID, gdb -p PID); collectivectl status lists them"}});
    if (comm.spans_nodes()) send_slot_failed(lk, comm, slot.seq, Code::timeout, why);
    fail_slot(lk, comm, slot, Code::timeout, why, out);
    if (slot.arrived >= comm.local_count) {
      it = end_slot(lk, comm, it);
    } else {
      ++it;
    }
  }
}

void Engine::Impl::expire_groups(Locked lk, Comm& comm, Clock::time_point now, Deliveries& out) {
  for (auto& m : comm.members) {
    std::vector<std::shared_ptr<Group>> expired;
    for (auto& w : m.queue) {
      if (w.type == Work::Type::group && now >= w.group->deadline &&
          std::none_of(w.group->items.begin(), w.group->items.end(),
                       [](const P2PItem& i) { return i.started; })) {
        expired.push_back(w.group);
      }
    }
    for (auto& g : expired) {
      std::string peers;
      for (const auto& item : g->items) {
        if (!peers.empty()) peers += ", ";
        peers += std::string(item.is_send ? "send to " : "recv from ") + "rank " +
                 std::to_string(item.peer);
      }
      fail_group(lk, comm, *g, Code::timeout,
                 "timed out after " + deadline_text(lk, g->timeout, g->rank) + ": unmatched " +
                     peers,
                 out);
    }
  }
}

void Engine::Impl::shutdown(const std::string& reason) {
  locked([&](Locked lk, Deliveries& out, Tasks&) {
    stopping = true;
    for (auto& [key, rv] : joins.here) fail_rendezvous(lk, key, rv, Code::aborted, reason, -1, out);
    joins.here.clear();
    node_shutdown(lk, reason, out);
    for (auto& cp : all_comms(lk)) break_comm(lk, *cp, Code::aborted, reason, out);
  });
}

}  // namespace collectived::engine

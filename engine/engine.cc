#include "engine/engine.h"

#include "engine/engine_impl.h"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>

#include "ipc/node.capnp.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "engine/plan.h"
#include "engine/worker_pool.h"

namespace collectived::engine {

std::string_view to_string(OpKind kind) {
  switch (kind) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::all_gather: return "all_gather";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::broadcast: return "broadcast";
    case OpKind::reduce: return "reduce";
    case OpKind::all_to_all: return "all_to_all";
    case OpKind::barrier: return "barrier";
    case OpKind::split: return "comm_split";
    case OpKind::p2p: return "send/recv group";
  }
  return "operation";
}

Engine::Engine(EngineOptions options, Registry& registry, Logger& log)
    : impl_(std::make_unique<Impl>(std::move(options), registry, log)) {}

Engine::~Engine() = default;

void Engine::set_gpu_executor(gpu::GpuExecutor* executor) {
  std::lock_guard lock(impl_->mu);
  impl_->gpu = executor;
}

void Engine::set_deadlines(std::chrono::milliseconds operation,
                           std::chrono::milliseconds rendezvous) {
  std::lock_guard lock(impl_->mu);
  impl_->options.operation_deadline = operation;
  impl_->options.rendezvous_deadline = rendezvous;
}

void Engine::comm_init(const ClientRef& client, std::uint64_t request, const std::string& secret,
                       const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>&) {
    const std::string name = hex_prefix(secret, 4);
    auto fail = [&](Code code, const std::string& why) {
      out.push_back({client.sink, request,
                     I.error(code, "comm_init_rank (communicator " + name + ", rank " +
                                       std::to_string(rank) + " of " + std::to_string(nranks) +
                                       "): " + why)});
    };
    if (I.stopping) return fail(Code::aborted, "the daemon is stopping");
    if (secret.size() != 16) return fail(Code::invalid_argument, "malformed unique id");
    if (nranks == 0 || nranks > 65536) {
      return fail(Code::invalid_argument, "nranks must be 1..65536");
    }
    if (rank >= nranks) {
      return fail(Code::invalid_argument, "rank must be below nranks");
    }
    const std::string key = secret + "@" + rendezvous;
    if (rendezvous != I.options.rendezvous_address) {
      // Another node's daemon runs the rendezvous: the join goes there.
      const bool local_only = rendezvous.rfind("local:", 0) == 0;
      const bool no_listener = I.options.rendezvous_address.rfind("local:", 0) == 0;
      if (!I.transport || local_only || no_listener) {
        return fail(Code::unavailable,
                    "the unique id names rendezvous daemon " + rendezvous + ", but this is node " +
                        I.options.node_name + " (" + I.options.rendezvous_address + "); " +
                        (local_only ? "that daemon has no peer listener (peer.port is 0 there)"
                                    : "this daemon has no peer listener (peer.port is 0)") +
                        ": communicators across nodes need peer.port and peer.secret_file on "
                        "every node");
      }
      auto [b, e] = I.pending_joins.equal_range(key);
      for (auto it = b; it != e; ++it) {
        if (it->second.rank == rank) {
          return fail(Code::invalid_usage, "rank " + std::to_string(rank) +
                                               " already joined from this node (pid " +
                                               std::to_string(it->second.client.pid) + ")");
        }
      }
      PendingJoin p;
      p.client = client;
      p.request = request;
      p.id = secret;
      p.rendezvous = rendezvous;
      p.nranks = nranks;
      p.rank = rank;
      // The rendezvous daemon answers by its own deadline; this one only
      // covers a daemon that never answers.
      p.deadline = Clock::now() + I.options.rendezvous_deadline + std::chrono::seconds(5);
      I.pending_joins.emplace(key, std::move(p));
      capnp::MallocMessageBuilder mb(256);
      auto m = mb.initRoot<nodewire::NodeMessage>();
      m.setFrom(I.options.rendezvous_address);
      auto j = m.initJoin();
      j.setId(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(secret.data()), secret.size()));
      j.setRendezvous(rendezvous);
      j.setNranks(nranks);
      j.setRank(rank);
      j.setPid(client.pid);
      j.setNode(I.options.node_name);
      const auto words = capnp::messageToFlatArray(mb);
      const auto bytes = words.asBytes();
      OutMessage msg;
      msg.head.resize(8 + bytes.size());
      const auto nwords = static_cast<std::uint32_t>(words.size());
      std::memcpy(msg.head.data(), &nwords, 4);
      std::memcpy(msg.head.data() + 8, bytes.begin(), bytes.size());
      I.transport.load()->send(rendezvous, std::move(msg),
                        [&I, key, rank, rendezvous](Code code, const std::string& why) {
                          if (code == Code::ok) return;
                          I.locked([&](std::vector<Delivery>& out2,
                                       std::vector<std::function<void()>>&) {
                            I.fail_pending_joins(key, static_cast<int>(rank), code,
                                                 "cannot reach the rendezvous daemon " +
                                                     rendezvous + ": " + why,
                                                 out2);
                          });
                        });
      return;
    }
    Joiner joiner;
    joiner.client = client;
    joiner.request = request;
    joiner.pid = client.pid;
    if (auto err = I.join_rendezvous(key, nranks, rank, std::move(joiner), out)) {
      return fail(err->first, err->second);
    }
  });
}

void Engine::comm_split(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                        int color, int key) {
  CollectiveArgs args;
  args.kind = OpKind::split;
  impl_->submit_slot(client, request, comm, args, color, key);
}

void Engine::comm_destroy(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    auto [cp, rank] = I.resolve_or_answer(client, request, handle, "comm_destroy", out);
    if (!cp) return;
    Member& m = cp->members[rank];
    m.queue.push_back(Work{Work::Type::leave, 0, nullptr, request, client.sink});
    I.progress(cp, out, tasks);
  });
}

void Engine::comm_abort(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>&) {
    auto [cp, rank] = I.resolve_or_answer(client, request, handle, "comm_abort", out);
    if (!cp) return;
    Comm& comm = *cp;
    I.log.warn("comm_aborted", {{"comm", comm.name}, {"rank", rank}, {"pid", client.pid}});
    I.break_comm(comm, Code::aborted,
                 "the communicator was aborted by " + comm.who(rank) + " (comm_abort)", out);
    // The aborting rank's own queued leaves are answered; then it is gone.
    Member& m = comm.members[rank];
    for (auto& w : m.queue) {
      if (w.type == Work::Type::leave) out.push_back({w.sink, w.request, Result{}});
    }
    m.queue.clear();
    I.drop_member(comm, rank);
    out.push_back({client.sink, request, Result{}});
  });
}

void Engine::collective(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                        const CollectiveArgs& args) {
  impl_->submit_slot(client, request, comm, args, 0, 0);
}

void Engine::p2p_group(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                       const std::vector<P2PArgs>& items, std::shared_ptr<gpu::RankSync> gpu,
                       std::chrono::milliseconds deadline) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    auto [cp, rank_] = I.resolve_or_answer(client, request, handle, "send/recv group", out);
    if (!cp) return;
    Comm& comm = *cp;
    const auto rank = rank_;  // a structured binding cannot be captured before clang 16
    auto fail = [&](Code code, const std::string& why) {
      out.push_back({client.sink, request,
                     I.error(code, "send/recv group on " + comm.where(rank) + ": " + why)});
    };
    if (I.stopping) return fail(Code::aborted, "the daemon is stopping");
    if (comm.broken) return fail(comm.broken->code, comm.broken->message);
    auto g = std::make_shared<Group>();
    g->rank = rank;
    g->request = request;
    g->sink = client.sink;
    g->created = Clock::now();
    g->deadline = g->created + I.budget(deadline);
    if (deadline.count() > 0) g->timeout = I.budget(deadline);
    try {
      for (std::size_t i = 0; i < items.size(); ++i) {
        const P2PArgs& a = items[i];
        P2PItem item;
        item.is_send = a.is_send;
        if (a.peer >= static_cast<std::uint32_t>(comm.nranks)) {
          throw Error(Code::invalid_argument, "item " + std::to_string(i) + ": peer " +
                                                  std::to_string(a.peer) + " is not a rank");
        }
        item.peer = static_cast<int>(a.peer);
        const auto dt = dtype_from_int(a.dtype);
        if (!dt) throw Error(Code::invalid_argument, "unknown dtype " + std::to_string(a.dtype));
        item.dtype = *dt;
        item.count = a.count;
        if (a.count > (std::uint64_t{1} << 46) / dtype_size(item.dtype)) {
          throw Error(Code::invalid_argument, "count too large");
        }
        item.span = I.resolve_span(client, a.buffer, a.count * dtype_size(item.dtype),
                                   a.is_send ? "send" : "recv");
        const char* which = a.is_send ? "send" : "recv";
        if (!gpu && item.span.reg && item.span.reg->device) {
          // The daemon's CPU copies host send/recv data: GPU memory there
          // would be a device address it cannot touch.
          throw Error(Code::invalid_argument,
                      "item " + std::to_string(i) + ": " + which +
                          " buffer is GPU memory: end the group with collective_group_end_stream");
        }
        if (gpu && item.span.reg && !item.span.reg->device) {
          throw Error(Code::invalid_argument,
                      "item " + std::to_string(i) + ": " + which +
                          " buffer is host memory, but the group is on GPU buffers (one group "
                          "takes one kind of memory)");
        }
        if (gpu && item.span.reg && a.buffer_id != 0 &&
            a.buffer_id != item.span.reg->device->buffer_id()) {
          throw Error(Code::invalid_argument,
                      "item " + std::to_string(i) + ": " + which + " buffer: stale registration " +
                          std::to_string(item.span.reg->handle) + ": it was made for buffer id " +
                          std::to_string(item.span.reg->device->buffer_id()) +
                          ", but the memory there is now buffer id " + std::to_string(a.buffer_id) +
                          " (freed and reallocated); register it again");
        }
        g->items.push_back(std::move(item));
      }
    } catch (const Error& e) {
      return fail(e.code(), e.what());
    }
    if (gpu && I.gpu == nullptr) return fail(Code::unavailable, "this daemon has no GPU executor");
    if (g->items.empty()) {
      out.push_back({client.sink, request, Result{}});
      return;  // a GPU group's stream is released as `gpu` goes
    }
    g->gpu_sync = std::move(gpu);
    // Indices pair the k-th send from a to b with the k-th receive at b from a.
    for (auto& item : g->items) {
      auto& counter = item.is_send ? comm.sends[{rank, item.peer}] : comm.recvs[{item.peer, rank}];
      item.index = counter++;
    }
    g->seq = comm.next_group_seq++;
    comm.members[rank].queue.push_back(Work{Work::Type::group, 0, g, 0, nullptr});
    I.progress(cp, out, tasks);
  }, client.inline_small);
}

void Engine::client_gone(std::uint64_t session) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    // Rendezvous this client took part in cannot complete any more.
    for (auto it = I.rendezvous.begin(); it != I.rendezvous.end();) {
      Rendezvous& rv = it->second;
      int gone = -1;
      for (int r = 0; r < rv.nranks; ++r) {
        if (rv.joined[r] && rv.joined[r]->address.empty() &&
            rv.joined[r]->client.session == session) {
          gone = r;
        }
      }
      if (gone < 0) {
        ++it;
        continue;
      }
      I.fail_rendezvous(it->first, rv, Code::remote,
                        "rank " + std::to_string(gone) + " (pid " +
                            std::to_string(rv.joined[gone]->pid) + " on node " +
                            I.options.node_name + ") disconnected before all ranks joined",
                        gone, out);
      it = I.rendezvous.erase(it);
    }
    I.node_client_gone(session, out);
    std::vector<std::pair<std::shared_ptr<Comm>, int>> mine;
    for (auto& [h, cr] : I.handles) {
      const Member& m = cr.first->members[cr.second];
      if (!m.remote && m.session == session) mine.push_back(cr);
    }
    for (auto& [cp, rank] : mine) {
      Comm& comm = *cp;
      Member& m = comm.members[rank];
      m.queue.clear();
      I.drop_member(comm, rank);
      if (comm.active_members() > 0) {
        I.log.warn("rank_died", {{"comm", comm.name},
                                 {"rank", rank},
                                 {"pid", m.pid},
                                 {"node", I.options.node_name},
                                 {"action", "the communicator is broken: see why the process "
                                            "exited (its log, dmesg for the OOM killer)"}});
        I.break_comm(comm, Code::remote,
                     comm.who(rank) + (comm.spans_nodes() ? "" : " on node " + I.options.node_name) +
                         " disconnected (its process exited or was killed)",
                     out);
        I.progress(cp, out, tasks);
      }
    }
  });
}

void Engine::check_deadlines() {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>&) {
    const auto now = Clock::now();
    I.wake_executors();  // operations between nodes re-check their deadlines
    for (auto it = I.rendezvous.begin(); it != I.rendezvous.end();) {
      Rendezvous& rv = it->second;
      if (now < rv.deadline) {
        ++it;
        continue;
      }
      std::vector<int> missing;
      for (int r = 0; r < rv.nranks; ++r) {
        if (!rv.joined[r]) missing.push_back(r);
      }
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - rv.started).count();
      I.fail_rendezvous(it->first, rv, Code::timeout,
                        "rendezvous timed out after " + std::to_string(waited) +
                            " ms (deadlines.rendezvous_ms) on node " + I.options.node_name + ": " +
                            std::to_string(rv.count) + " of " + std::to_string(rv.nranks) +
                            " ranks joined; missing ranks: " + rank_list(missing),
                        -1, out);
      I.log.warn("rendezvous_timeout",
                 {{"comm", rv.name},
                  {"node", I.options.node_name},
                  {"joined", rv.count},
                  {"nranks", rv.nranks},
                  {"missing", rank_list(missing)},
                  {"action", "start the missing ranks with the same unique id and nranks, or "
                             "raise deadlines.rendezvous_ms if they start later"}});
      it = I.rendezvous.erase(it);
    }
    I.check_node_deadlines(now, out);
    for (auto& cp : I.all_comms()) {
      Comm& comm = *cp;
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
        const std::string after = I.deadline_text(slot.timeout, slot.timeout_rank);
        if (!missing.empty()) {
          why = "timed out after " + after + " on node " + I.options.node_name +
                ": ranks that did not submit it: " + detail;
        } else {
          why = "timed out after " + after +
                ": every rank submitted it, but an earlier operation of this communicator "
                "never finished";
        }
        I.log.warn("operation_timeout",
                   {{"comm", comm.name},
                    {"seq", slot.seq},
                    {"op", to_string(slot.desc.kind)},
                    {"node", I.options.node_name},
                    {"missing_ranks", rank_list(missing)},
                    {"missing", detail},
                    {"deadline", after},
                    {"action", missing.empty()
                                   ? "an earlier operation of the communicator never finished"
                                   : "look at what the missing ranks' processes do (py-spy dump "
                                     "--pid PID, gdb -p PID); collectivectl status lists them"}});
        if (comm.spans_nodes()) I.send_slot_failed(comm, slot.seq, Code::timeout, why);
        I.fail_slot(comm, slot, Code::timeout, why, out);
        if (slot.arrived >= comm.local_count) {
          it = I.end_slot_it(comm, it);
        } else {
          ++it;
        }
      }
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
          I.fail_group(comm, *g, Code::timeout,
                       "timed out after " + I.deadline_text(g->timeout, g->rank) +
                           ": unmatched " + peers,
                       out);
        }
      }
    }
  });
}

void Engine::shutdown(const std::string& reason) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>&) {
    I.stopping = true;
    for (auto& [key, rv] : I.rendezvous) I.fail_rendezvous(key, rv, Code::aborted, reason, -1, out);
    I.rendezvous.clear();
    I.node_shutdown(reason, out);
    for (auto& cp : I.all_comms()) I.break_comm(*cp, Code::aborted, reason, out);
  });
}

std::optional<CommShape> Engine::comm_shape(std::uint64_t session, std::uint64_t handle) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->handles.find(handle);
  if (it == impl_->handles.end()) return std::nullopt;
  const auto& [comm, rank] = it->second;
  if (comm->members[rank].session != session) return std::nullopt;
  CommShape s;
  s.id = comm->serial;
  s.next_seq = comm->members[rank].next_seq;
  s.rank = static_cast<std::uint32_t>(rank);
  s.nranks = static_cast<std::uint32_t>(comm->nranks);
  s.nodes = static_cast<std::uint32_t>(std::max<std::size_t>(1, comm->node_address.size()));
  return s;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(impl_->mu);
  EngineStats s;
  const auto comms = impl_->all_comms();
  s.communicators = static_cast<std::uint32_t>(comms.size());
  for (const auto& c : comms) {
    for (auto& [seq, slot] : c->slots) {
      if (!slot.failed) ++s.in_flight;
    }
    for (auto& m : c->members) {
      for (auto& w : m.queue) {
        if (w.type == Work::Type::group) ++s.in_flight;
      }
    }
  }
  s.completed = impl_->completed;
  s.worker_threads = static_cast<std::uint32_t>(impl_->pool.size());
  return s;
}

std::vector<CommSnapshot> Engine::snapshot() const {
  const Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  const auto now = Clock::now();
  const auto age = [&](Clock::time_point since) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - since);
  };
  std::vector<CommSnapshot> out;
  for (const auto& cp : I.all_comms()) {
    const Comm& comm = *cp;
    CommSnapshot& c = out.emplace_back();
    c.name = comm.name;
    c.nranks = static_cast<std::uint32_t>(comm.nranks);
    if (comm.broken) c.broken = comm.broken->message;
    for (const Member& m : comm.members) {
      c.ranks.push_back({static_cast<std::uint32_t>(m.rank), m.pid, m.session,
                         comm.spans_nodes() ? comm.node_name[comm.node_of_rank[m.rank]]
                                            : I.options.node_name,
                         m.active, m.next_seq, m.remote});
    }
    for (const auto& [seq, slot] : comm.slots) {
      if (slot.failed) continue;
      OpSnapshot& op = c.ops.emplace_back();
      op.seq = seq;
      op.op = slot.has_desc ? slot.desc.str() : std::string(to_string(slot.desc.kind));
      op.age = age(slot.created);
      op.started = slot.started;
      // Ranks of this node only: another node's ranks are that node's daemon's to name.
      for (const Member& m : comm.members) {
        if (!m.remote && m.next_seq <= seq) op.missing.push_back(static_cast<std::uint32_t>(m.rank));
      }
    }
    // Operations other nodes already sent their part of while this node's
    // ranks have not submitted them: the other nodes wait on these ranks.
    if (comm.spans_nodes() && comm.inbox) {
      std::map<std::uint64_t, OpSnapshot> waited;
      for (const auto& [key, in] : comm.inbox->msgs) {
        const std::uint64_t seq = std::get<0>(key);
        if (comm.slots.count(seq) != 0 || comm.is_ended(seq)) continue;
        const std::string node = comm.node_name[std::get<2>(key)];
        auto [it, fresh] = waited.try_emplace(seq);
        OpSnapshot& op = it->second;
        if (fresh) {
          op.seq = seq;
          op.op = in.desc.str() + ", waited on by node " + node;
          op.age = age(in.arrived);
          for (const Member& m : comm.members) {
            if (!m.remote && m.next_seq <= seq) op.missing.push_back(static_cast<std::uint32_t>(m.rank));
          }
        } else if (op.op.find(node) == std::string::npos) {
          op.op += ", " + node;
          op.age = std::max(op.age, age(in.arrived));
        }
      }
      for (auto& [seq, op] : waited) c.ops.push_back(std::move(op));
    }
    for (const Member& m : comm.members) {
      for (const Work& w : m.queue) {
        if (w.type != Work::Type::group || w.group->answered) continue;
        const Group& g = *w.group;
        OpSnapshot& op = c.ops.emplace_back();
        op.seq = g.seq;
        op.op = "send/recv group";
        op.age = age(g.created);
        op.rank = g.rank;
        for (const P2PItem& item : g.items) {
          op.started = op.started || item.started;
          if (!item.started) op.missing.push_back(static_cast<std::uint32_t>(item.peer));
        }
      }
    }
  }
  return out;
}

}  // namespace collectived::engine

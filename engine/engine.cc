// The facade (engine/engine.h): every request takes the engine's lock through
// Engine::Impl (engine/engine_core.h, which says where each part lives), and
// status reads it under the lock.
#include "engine/engine.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "engine/engine_core.h"

namespace collectived::engine {

Engine::Impl::Impl(EngineOptions o, Registry& r, Logger& l)
    : options(std::move(o)), registry(r), log(l), pool(options.worker_threads) {
  // The own node thread (no runner set) sweeps deadlines itself.
  nodes.runner->idle = [this] {
    EngineLock lock(mu);
    wake_executors(lock.token());
  };
}

Engine::Engine(EngineOptions options, Registry& registry, Logger& log)
    : impl_(std::make_unique<Impl>(std::move(options), registry, log)) {}

Engine::~Engine() = default;

void Engine::set_gpu_executor(gpu::GpuExecutor* executor) {
  EngineLock lock(impl_->mu);
  impl_->gpu = executor;
}

void Engine::set_deadlines(std::chrono::milliseconds operation,
                           std::chrono::milliseconds rendezvous) {
  EngineLock lock(impl_->mu);
  impl_->options.operation_deadline = operation;
  impl_->options.rendezvous_deadline = rendezvous;
}

void Engine::comm_init(const ClientRef& client, std::uint64_t request, const std::string& secret,
                       const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank) {
  impl_->comm_init(client, request, secret, rendezvous, nranks, rank);
}

void Engine::comm_split(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                        int color, int key) {
  CollectiveArgs args;
  args.kind = OpKind::split;
  impl_->submit_slot(client, request, comm, args, color, key);
}

void Engine::comm_destroy(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  impl_->leave(client, request, handle);
}

void Engine::comm_abort(const ClientRef& client, std::uint64_t request, std::uint64_t handle) {
  impl_->abort(client, request, handle);
}

void Engine::collective(const ClientRef& client, std::uint64_t request, std::uint64_t comm,
                        const CollectiveArgs& args) {
  impl_->submit_slot(client, request, comm, args, 0, 0);
}

void Engine::p2p_group(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                       const std::vector<P2PArgs>& items, std::shared_ptr<gpu::RankSync> gpu,
                       std::chrono::milliseconds deadline) {
  impl_->submit_group(client, request, handle, items, std::move(gpu), deadline);
}

void Engine::client_gone(std::uint64_t session) { impl_->client_gone(session); }

void Engine::check_deadlines() { impl_->check_deadlines(); }

void Engine::shutdown(const std::string& reason) { impl_->shutdown(reason); }

// ---- communicators that span nodes ------------------------------------------------------

void Engine::set_node_transport(NodeTransport* transport) {
  EngineLock lock(impl_->mu);
  impl_->nodes.transport = transport;
}

void Engine::set_node_runner(std::function<void(std::function<void()>)> post) {
  EngineLock lock(impl_->mu);
  impl_->nodes.runner->post = std::move(post);
}

void Engine::set_node_algorithms(const NodeAlgorithmOptions& options) {
  auto next = std::make_shared<const NodeAlgorithmOptions>(options);
  EngineLock lock(impl_->mu);
  impl_->nodes.algorithms = std::move(next);
}

bool Engine::reduce_scatter_own_elsewhere(int nodes) const {
  std::shared_ptr<const NodeAlgorithmOptions> options;
  {
    EngineLock lock(impl_->mu);
    options = impl_->nodes.algorithms;
  }
  return engine::reduce_scatter_own_elsewhere(nodes, *options);
}

void Engine::node_message(const std::string& peer, MessageBytes message) {
  Impl& I = *impl_;
  I.locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    try {
      I.handle_node_message(lk, peer, std::move(message), out, tasks);
    } catch (const Error& e) {
      I.log.warn("node_message_refused", {{"peer", peer}, {"reason", e.what()}});
    } catch (const kj::Exception& e) {
      I.log.warn("node_message_refused",
                 {{"peer", peer}, {"reason", std::string(e.getDescription().cStr())}});
    }
  });
}

Placement Engine::place_node_message(std::span<const std::byte> head, std::uint64_t bytes) {
  Impl& I = *impl_;
  std::unique_ptr<Decoded> d;
  try {
    d = decode(MessageBytes::copy_of(head));
    if (d->raw_offset != head.size() || d->msg.which() != nodewire::NodeMessage::DATA) return {};
    const auto dm = d->msg.getData();
    if (dm.getP2p()) return {};
    const std::string uid = text(dm.getUid());
    const auto key = std::make_tuple(dm.getSeq(), dm.getTag(), static_cast<int>(dm.getFromNode()));
    EngineLock lock(I.mu);
    const auto it = I.nodes.inboxes.find(uid);
    if (it == I.nodes.inboxes.end() || !it->second.first) return {};
    const auto pp = it->second.first->posted.find(key);
    if (pp == it->second.first->posted.end() || pp->second.claimed || pp->second.bytes != bytes) {
      return {};
    }
    pp->second.claimed = true;
    return Placement{pp->second.dest, std::move(pp->second.token)};
  } catch (const Error&) {
    return {};  // node_message() refuses it with the reason
  } catch (const kj::Exception&) {
    return {};
  }
}

void Engine::node_down(const std::string& address, const std::string& node,
                       const std::string& why) {
  Impl& I = *impl_;
  I.locked([&](Locked lk, Deliveries& out, Tasks& tasks) {
    I.handle_node_down(lk, address, node, why, out, tasks);
  });
}

// ---- status -------------------------------------------------------------------------------

std::optional<CommShape> Engine::comm_shape(std::uint64_t session, std::uint64_t handle) const {
  EngineLock lock(impl_->mu);
  auto it = impl_->communicators.by_handle.find(handle);
  if (it == impl_->communicators.by_handle.end()) return std::nullopt;
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
  EngineLock lock(impl_->mu);
  EngineStats s;
  const auto comms = impl_->all_comms(lock.token());
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
  s.completed = impl_->communicators.completed;
  s.worker_threads = static_cast<std::uint32_t>(impl_->pool.size());
  return s;
}

std::vector<CommSnapshot> Engine::snapshot() const {
  const Impl& I = *impl_;
  EngineLock lock(I.mu);
  const auto now = Clock::now();
  const auto age = [&](Clock::time_point since) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - since);
  };
  std::vector<CommSnapshot> out;
  for (const auto& cp : I.all_comms(lock.token())) {
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

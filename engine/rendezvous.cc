// Rendezvous and split. Every rank sends CommInit{secret, rendezvous, nranks,
// rank}; the daemon the unique id names keys pending rendezvous by secret and
// address and answers all ranks at once. A rank whose rendezvous daemon is
// another node's forwards its join there (`join`); once every rank is in,
// the rendezvous daemon sends every node with ranks the rank map
// (`joinReply`), and each node creates its side of the communicator. Nodes
// are numbered by their lowest rank, the same everywhere. comm_split makes
// the children of a communicator from every rank's (color, key).
#include <algorithm>
#include <set>
#include <tuple>

#include "engine/engine_core.h"

namespace collectived::engine {

namespace {
/// What a client learns of the communicator's nodes (CommReady): their
/// number, its own, and the first rank of the next one.
void set_layout(CommInfo& info, const Comm& comm) {
  if (!comm.spans_nodes()) return;
  const int nodes = static_cast<int>(comm.node_address.size());
  info.nodes = static_cast<std::uint32_t>(nodes);
  info.node = static_cast<std::uint32_t>(comm.my_node);
  const int next = (comm.my_node + 1) % nodes;
  for (std::size_t r = 0; r < comm.node_of_rank.size(); ++r) {
    if (comm.node_of_rank[r] == next) {
      info.next_node_first_rank = static_cast<std::uint32_t>(r);
      break;
    }
  }
}
}  // namespace

void Engine::Impl::comm_init(const ClientRef& client, std::uint64_t request,
                             const std::string& secret, const std::string& rendezvous_address,
                             std::uint32_t nranks, std::uint32_t rank) {
  locked([&](Locked lk, Deliveries& out, Tasks&) {
    const std::string name = hex_prefix(secret, 4);
    auto fail = [&](Code code, const std::string& why) {
      out.push_back({client.sink, request,
                     error(code, "comm_init_rank (communicator " + name + ", rank " +
                                     std::to_string(rank) + " of " + std::to_string(nranks) +
                                     "): " + why)});
    };
    if (stopping) return fail(Code::aborted, "the daemon is stopping");
    if (secret.size() != 16) return fail(Code::invalid_argument, "malformed unique id");
    if (nranks == 0 || nranks > 65536) {
      return fail(Code::invalid_argument, "nranks must be 1..65536");
    }
    if (rank >= nranks) {
      return fail(Code::invalid_argument, "rank must be below nranks");
    }
    const std::string key = secret + "@" + rendezvous_address;
    if (rendezvous_address != options.rendezvous_address) {
      // Another node's daemon runs the rendezvous: the join goes there.
      const bool local_only = rendezvous_address.rfind("local:", 0) == 0;
      const bool no_listener = options.rendezvous_address.rfind("local:", 0) == 0;
      if (!nodes.transport || local_only || no_listener) {
        return fail(Code::unavailable,
                    "the unique id names rendezvous daemon " + rendezvous_address +
                        ", but this is node " + options.node_name + " (" +
                        options.rendezvous_address + "); " +
                        (local_only ? "that daemon has no peer listener (peer.port is 0 there)"
                                    : "this daemon has no peer listener (peer.port is 0)") +
                        ": communicators across nodes need peer.port and peer.secret_file on "
                        "every node");
      }
      auto [b, e] = joins.pending.equal_range(key);
      for (auto it = b; it != e; ++it) {
        if (it->second.rank == rank) {
          return fail(Code::invalid_usage, "rank " + std::to_string(rank) +
                                               " already joined from this node (pid " +
                                               std::to_string(it->second.client.pid) + ")");
        }
      }
      return forward_join(lk, client, request, key, secret, rendezvous_address, nranks, rank);
    }
    Joiner joiner;
    joiner.client = client;
    joiner.request = request;
    joiner.pid = client.pid;
    if (auto err = join_rendezvous(lk, key, nranks, rank, std::move(joiner), out)) {
      return fail(err->first, err->second);
    }
  });
}

void Engine::Impl::forward_join(Locked, const ClientRef& client, std::uint64_t request,
                                const std::string& key, const std::string& secret,
                                const std::string& rendezvous_address, std::uint32_t nranks,
                                std::uint32_t rank) {
  PendingJoin p;
  p.client = client;
  p.request = request;
  p.id = secret;
  p.rendezvous = rendezvous_address;
  p.nranks = nranks;
  p.rank = rank;
  // The rendezvous daemon answers by its own deadline; this one only covers
  // a daemon that never answers.
  p.deadline = Clock::now() + options.rendezvous_deadline + std::chrono::seconds(5);
  joins.pending.emplace(key, std::move(p));
  nodes.transport.load()->send(rendezvous_address,
                         join_message(options.rendezvous_address, secret, rendezvous_address,
                                      nranks, rank, client.pid, options.node_name),
                         [this, key, rank, rendezvous_address](Code code, const std::string& why) {
                           if (code == Code::ok) return;
                           locked([&](Locked lk2, Deliveries& out2, Tasks&) {
                             fail_pending_joins(lk2, key, static_cast<int>(rank), code,
                                                "cannot reach the rendezvous daemon " +
                                                    rendezvous_address + ": " + why,
                                                out2);
                           });
                         });
}

void Engine::Impl::send_join_reply(const std::string& to, const std::string& key, int rank,
                                   Code code, const std::string& why) {
  send_node(to, join_refusal(options.rendezvous_address, key, rank, code, why));
}

std::optional<std::pair<Code, std::string>> Engine::Impl::join_rendezvous(
    Locked lk, const std::string& key, std::uint32_t nranks, std::uint32_t rank, Joiner joiner,
    Deliveries& out) {
  auto [it, fresh] = joins.here.try_emplace(key);
  Rendezvous& rv = it->second;
  if (fresh) {
    rv.name = hex_prefix(key, 4);
    rv.nranks = static_cast<int>(nranks);
    rv.joined.resize(nranks);
    rv.started = Clock::now();
    rv.deadline = rv.started + options.rendezvous_deadline;
  }
  if (rv.nranks != static_cast<int>(nranks)) {
    return std::make_pair(Code::mismatch, "this rank says " + std::to_string(nranks) +
                                              " ranks, but earlier ranks said " +
                                              std::to_string(rv.nranks));
  }
  if (rv.joined[rank]) {
    std::string where = rv.joined[rank]->address.empty() ? "" : " on node " + rv.joined[rank]->node;
    return std::make_pair(Code::invalid_usage, "rank " + std::to_string(rank) +
                                                   " already joined (pid " +
                                                   std::to_string(rv.joined[rank]->pid) + where +
                                                   ")");
  }
  rv.joined[rank] = std::move(joiner);
  if (++rv.count < rv.nranks) return std::nullopt;

  const bool remote = std::any_of(rv.joined.begin(), rv.joined.end(),
                                  [](const std::optional<Joiner>& j) { return !j->address.empty(); });
  if (remote) {
    finish_rendezvous_across_nodes(lk, key, rv, out);
    joins.here.erase(it);
    return std::nullopt;
  }
  auto comm = std::make_shared<Comm>();
  comm->serial = ++communicators.serial;
  comm->name = rv.name;
  comm->nranks = rv.nranks;
  comm->local_count = rv.nranks;
  for (int r = 0; r < rv.nranks; ++r) {
    Member m;
    m.rank = r;
    m.session = rv.joined[r]->client.session;
    m.pid = rv.joined[r]->client.pid;
    m.handle = communicators.next_handle++;
    communicators.by_handle[m.handle] = {comm, r};
    comm->members.push_back(std::move(m));
  }
  for (int r = 0; r < rv.nranks; ++r) {
    Result res;
    res.comm = CommInfo{comm->members[r].handle, static_cast<std::uint32_t>(r),
                        static_cast<std::uint32_t>(rv.nranks), comm->name};
    out.push_back({rv.joined[r]->client.sink, rv.joined[r]->request, std::move(res)});
  }
  log.info("comm_created",
           {{"comm", comm->name},
            {"nranks", comm->nranks},
            {"rendezvous_ms",
             std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - rv.started)
                 .count()}});
  joins.here.erase(it);
  return std::nullopt;
}

void Engine::Impl::finish_rendezvous_across_nodes(Locked lk, const std::string& key, Rendezvous& rv,
                                                  Deliveries& out) {
  // Nodes are numbered by their lowest rank: the same on every node.
  std::vector<std::string> addresses, names;
  std::map<std::string, int> index;
  std::vector<int> node_of_rank(rv.nranks);
  std::vector<pid_t> pids(rv.nranks);
  std::map<int, Joiner> local;
  for (int r = 0; r < rv.nranks; ++r) {
    const Joiner& j = *rv.joined[r];
    const std::string addr = j.address.empty() ? options.rendezvous_address : j.address;
    auto [it, fresh] = index.try_emplace(addr, static_cast<int>(addresses.size()));
    if (fresh) {
      addresses.push_back(addr);
      names.push_back(j.address.empty() ? options.node_name : j.node);
    }
    node_of_rank[r] = it->second;
    pids[r] = j.pid;
    if (j.address.empty()) local[r] = j;
  }
  const std::string id = key.substr(0, 16);  // the id bytes may contain '@'
  const std::string uid = to_hex(id) + "@" + options.rendezvous_address;
  for (std::size_t n = 0; n < addresses.size(); ++n) {
    if (addresses[n] == options.rendezvous_address) continue;
    send_node(addresses[n], join_map(options.rendezvous_address, id, uid, rv.name, node_of_rank,
                                     pids, addresses, names));
  }
  if (!local.empty()) {
    make_spanning_comm(lk, uid, rv.name, node_of_rank, pids, addresses, names, local, out);
  }
  log.info("rendezvous_done", {{"comm", rv.name},
                               {"nranks", rv.nranks},
                               {"nodes", addresses.size()},
                               {"rendezvous_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     Clock::now() - rv.started)
                                                     .count()}});
}

std::shared_ptr<Comm> Engine::Impl::make_spanning_comm(
    Locked lk, const std::string& uid, const std::string& name,
    const std::vector<int>& node_of_rank, const std::vector<pid_t>& pids,
    const std::vector<std::string>& addresses, const std::vector<std::string>& names,
    const std::map<int, Joiner>& local, Deliveries& out) {
  auto comm = std::make_shared<Comm>();
  comm->serial = ++communicators.serial;
  comm->name = name;
  comm->uid = uid;
  comm->nranks = static_cast<int>(node_of_rank.size());
  comm->node_of_rank = node_of_rank;
  comm->node_address = addresses;
  comm->node_name = names;
  comm->my_node = static_cast<int>(
      std::find(addresses.begin(), addresses.end(), options.rendezvous_address) -
      addresses.begin());
  for (int r = 0; r < comm->nranks; ++r) {
    Member m;
    m.rank = r;
    m.pid = pids[r];
    auto it = local.find(r);
    if (it != local.end()) {
      m.session = it->second.client.session;
      m.handle = communicators.next_handle++;
      communicators.by_handle[m.handle] = {comm, r};
      ++comm->local_count;
    } else {
      m.remote = true;
    }
    comm->members.push_back(std::move(m));
  }
  attach_nodes(lk, comm);
  for (const auto& [r, j] : local) {
    Result res;
    res.comm = CommInfo{comm->members[r].handle, static_cast<std::uint32_t>(r),
                        static_cast<std::uint32_t>(comm->nranks), comm->name};
    set_layout(*res.comm, *comm);
    out.push_back({j.client.sink, j.request, std::move(res)});
  }
  log.info("comm_created", {{"comm", comm->name},
                            {"nranks", comm->nranks},
                            {"local_ranks", comm->local_count},
                            {"nodes", addresses.size()}});
  return comm;
}

void Engine::Impl::fail_rendezvous(Locked, const std::string& key, Rendezvous& rv, Code code,
                                   const std::string& why, int except_rank,
                                   Deliveries& out) {
  for (int r = 0; r < rv.nranks; ++r) {
    if (!rv.joined[r] || r == except_rank) continue;
    const std::string msg = "comm_init_rank (communicator " + rv.name + ", rank " +
                            std::to_string(r) + " of " + std::to_string(rv.nranks) + "): " + why;
    if (rv.joined[r]->address.empty()) {
      out.push_back({rv.joined[r]->client.sink, rv.joined[r]->request, error(code, msg)});
    } else {
      send_join_reply(rv.joined[r]->address, key, r, code, msg);
    }
  }
}

void Engine::Impl::fail_pending_joins(Locked, const std::string& key, int rank, Code code,
                                      const std::string& why, Deliveries& out) {
  auto [b, e] = joins.pending.equal_range(key);
  for (auto it = b; it != e;) {
    if (rank >= 0 && it->second.rank != static_cast<std::uint32_t>(rank)) {
      ++it;
      continue;
    }
    const PendingJoin& p = it->second;
    const bool full = why.rfind("comm_init_rank", 0) == 0;
    out.push_back({p.client.sink, p.request,
                   error(code, full ? why
                                    : "comm_init_rank (communicator " + hex_prefix(p.id, 4) +
                                          ", rank " + std::to_string(p.rank) + " of " +
                                          std::to_string(p.nranks) + "): " + why)});
    it = joins.pending.erase(it);
  }
}

void Engine::Impl::expire_rendezvous(Locked lk, Clock::time_point now, Deliveries& out) {
  for (auto it = joins.here.begin(); it != joins.here.end();) {
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
    fail_rendezvous(lk, it->first, rv, Code::timeout,
                    "rendezvous timed out after " + std::to_string(waited) +
                        " ms (deadlines.rendezvous_ms) on node " + options.node_name + ": " +
                        std::to_string(rv.count) + " of " + std::to_string(rv.nranks) +
                        " ranks joined; missing ranks: " + rank_list(missing),
                    -1, out);
    log.warn("rendezvous_timeout",
             {{"comm", rv.name},
              {"node", options.node_name},
              {"joined", rv.count},
              {"nranks", rv.nranks},
              {"missing", rank_list(missing)},
              {"action", "start the missing ranks with the same unique id and nranks, or "
                         "raise deadlines.rendezvous_ms if they start later"}});
    it = joins.here.erase(it);
  }
}

void Engine::Impl::rendezvous_client_gone(Locked lk, std::uint64_t session, Deliveries& out) {
  for (auto it = joins.here.begin(); it != joins.here.end();) {
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
    fail_rendezvous(lk, it->first, rv, Code::remote,
                    "rank " + std::to_string(gone) + " (pid " +
                        std::to_string(rv.joined[gone]->pid) + " on node " + options.node_name +
                        ") disconnected before all ranks joined",
                    gone, out);
    it = joins.here.erase(it);
  }
}

// ---- split ---------------------------------------------------------------------------------

void Engine::Impl::do_split(Locked lk, const std::shared_ptr<Comm>& cp, Slot& slot,
                            Deliveries& out) {
  Comm& parent = *cp;
  std::vector<std::pair<int, int>> color_key(parent.nranks);
  for (int r = 0; r < parent.nranks; ++r) color_key[r] = {slot.parts[r].color, slot.parts[r].key};
  std::map<int, CommInfo> info;  // parent rank -> new communicator
  make_split_children(lk, cp, slot.seq, color_key, info);
  const std::uint64_t seq = slot.seq;
  Deliveries replies;
  for (int r = 0; r < parent.nranks; ++r) {
    if (!slot.parts[r].present) continue;
    Result res;
    res.seq = seq;
    res.comm = info.count(r) ? info[r] : CommInfo{};
    replies.push_back({slot.parts[r].sink, slot.parts[r].request, std::move(res)});
    slot.parts[r].present = false;
  }
  complete_slot(lk, parent, seq, out);
  for (auto& d : replies) out.push_back(std::move(d));
}

void Engine::Impl::make_split_children(Locked lk, const std::shared_ptr<Comm>& cp,
                                       std::uint64_t seq,
                                       const std::vector<std::pair<int, int>>& color_key,
                                       std::map<int, CommInfo>& info) {
  Comm& parent = *cp;
  std::map<int, std::vector<int>> by_color;
  for (int r = 0; r < parent.nranks; ++r) {
    if (color_key[r].first >= 0) by_color[color_key[r].first].push_back(r);
  }
  for (auto& [color, ranks] : by_color) {
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
      return std::tie(color_key[a].second, a) < std::tie(color_key[b].second, b);
    });
    const bool mine = std::any_of(ranks.begin(), ranks.end(),
                                  [&](int r) { return !parent.members[r].remote; });
    if (!mine) continue;
    auto child = std::make_shared<Comm>();
    child->serial = ++communicators.serial;
    child->name = parent.name + "." + std::to_string(color);
    child->nranks = static_cast<int>(ranks.size());
    if (parent.spans_nodes()) {
      // The child's nodes, numbered by their lowest child rank.
      std::map<int, int> index;  // parent node -> child node
      for (int r : ranks) {
        const int pn = parent.node_of_rank[r];
        auto [it, fresh] = index.try_emplace(pn, static_cast<int>(child->node_address.size()));
        if (fresh) {
          child->node_address.push_back(parent.node_address[pn]);
          child->node_name.push_back(parent.node_name[pn]);
        }
        child->node_of_rank.push_back(it->second);
      }
      child->my_node = index.count(parent.my_node) ? index[parent.my_node] : 0;
      if (child->spans_nodes()) {
        child->uid = parent.uid + "/" + std::to_string(seq) + "." + std::to_string(color);
      } else {
        child->node_address.clear();
        child->node_name.clear();
        child->node_of_rank.clear();
      }
    }
    for (int i = 0; i < child->nranks; ++i) {
      const Member& pm = parent.members[ranks[i]];
      Member m;
      m.rank = i;
      m.session = pm.session;
      m.pid = pm.pid;
      m.remote = pm.remote;
      if (!m.remote) {
        m.handle = communicators.next_handle++;
        communicators.by_handle[m.handle] = {child, i};
        ++child->local_count;
        info[ranks[i]] = CommInfo{m.handle, static_cast<std::uint32_t>(i),
                                  static_cast<std::uint32_t>(child->nranks), child->name};
        set_layout(info[ranks[i]], *child);
      }
      child->members.push_back(std::move(m));
    }
    if (child->spans_nodes()) attach_nodes(lk, child);
    log.info("comm_created", {{"comm", child->name},
                              {"nranks", child->nranks},
                              {"parent", parent.name},
                              {"color", color},
                              {"nodes", std::max<std::size_t>(1, child->node_address.size())}});
  }
}

}  // namespace collectived::engine

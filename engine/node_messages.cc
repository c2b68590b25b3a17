// What another node's engine sends this one (ipc/node.capnp), one handler
// per message: a rank's join of a rendezvous here (`join`), the rendezvous
// daemon's answer (`joinReply`), a joined rank gone (`joinCancel`), an
// operation's data (`data`), and failures (`broken`, `slotFailed`). All run
// with the engine's lock held, on the thread that read the message.
#include <algorithm>

#include "engine/engine_core.h"

namespace collectived::engine {

void Engine::Impl::handle_node_message(Locked lk, const std::string& peer, MessageBytes bytes,
                                       Deliveries& out, Tasks& tasks) {
  auto d = decode(std::move(bytes));
  auto msg = d->msg;
  const std::string from = text(msg.getFrom());
  switch (msg.which()) {
    case nodewire::NodeMessage::JOIN: return on_join(lk, from, msg.getJoin(), out);
    case nodewire::NodeMessage::JOIN_REPLY: return on_join_reply(lk, from, msg.getJoinReply(), out);
    case nodewire::NodeMessage::JOIN_CANCEL:
      return on_join_cancel(lk, from, msg.getJoinCancel(), out);
    case nodewire::NodeMessage::DATA: return on_data(lk, from, *d, out, tasks);
    case nodewire::NodeMessage::BROKEN: return on_broken(lk, msg.getBroken(), out, tasks);
    case nodewire::NodeMessage::SLOT_FAILED:
      return on_slot_failed(lk, msg.getSlotFailed(), out, tasks);
    default:
      throw Error(Code::protocol, "unknown message from " + peer);
  }
}

void Engine::Impl::on_join(Locked lk, const std::string& from, nodewire::Join::Reader j,
                           Deliveries& out) {
  const std::string id = data(j.getId());
  const std::string rv_addr = text(j.getRendezvous());
  const std::string key = id + "@" + rv_addr;
  const std::uint32_t nranks = j.getNranks(), rank = j.getRank();
  auto refuse = [&](Code code, const std::string& why) {
    send_join_reply(from, key, static_cast<int>(rank), code,
                    "comm_init_rank (communicator " + hex_prefix(id, 4) + ", rank " +
                        std::to_string(rank) + " of " + std::to_string(nranks) + "): " + why);
  };
  if (stopping) return refuse(Code::aborted, "the rendezvous daemon is stopping");
  if (rv_addr != options.rendezvous_address) {
    return refuse(Code::invalid_argument, "the unique id names " + rv_addr + ", but node " +
                                              options.node_name + " is " +
                                              options.rendezvous_address);
  }
  if (id.size() != 16 || nranks == 0 || nranks > 65536 || rank >= nranks) {
    return refuse(Code::invalid_argument, "malformed join");
  }
  Joiner joiner;
  joiner.address = from;
  joiner.node = text(j.getNode());
  joiner.pid = j.getPid();
  if (auto err = join_rendezvous(lk, key, nranks, rank, std::move(joiner), out)) {
    refuse(err->first, err->second);
  }
}

void Engine::Impl::on_join_reply(Locked lk, const std::string& from,
                                 nodewire::JoinReply::Reader r, Deliveries& out) {
  const std::string key = data(r.getId()) + "@" + text(r.getRendezvous());
  if (r.getCode() != 0) {
    fail_pending_joins(lk, key, r.getRank(), static_cast<Code>(r.getCode()), text(r.getMessage()),
                       out);
    return;
  }
  const auto nor = r.getNodeOfRank();
  const auto por = r.getPidOfRank();
  const auto na = r.getNodeAddresses();
  const auto nn = r.getNodeNames();
  if (por.size() != nor.size() || na.size() != nn.size() || na.size() < 2) {
    throw Error(Code::protocol, "malformed join reply");
  }
  std::vector<int> node_of_rank;
  std::vector<pid_t> pids;
  std::vector<std::string> addresses, names;
  for (auto v : nor) {
    if (v >= na.size()) throw Error(Code::protocol, "join reply: node index out of range");
    node_of_rank.push_back(static_cast<int>(v));
  }
  for (auto v : por) pids.push_back(v);
  for (auto t : na) addresses.push_back(text(t));
  for (auto t : nn) names.push_back(text(t));
  const auto me = std::find(addresses.begin(), addresses.end(), options.rendezvous_address);
  if (me == addresses.end()) throw Error(Code::protocol, "join reply: this node is not in it");
  const int my_node = static_cast<int>(me - addresses.begin());
  std::map<int, Joiner> local;
  std::vector<int> lost;  // local ranks of the map whose client is gone
  auto [b, e] = joins.pending.equal_range(key);
  for (auto it = b; it != e; ++it) {
    Joiner j;
    j.client = it->second.client;
    j.request = it->second.request;
    j.pid = it->second.client.pid;
    local[static_cast<int>(it->second.rank)] = j;
  }
  for (std::size_t k = 0; k < node_of_rank.size(); ++k) {
    if (node_of_rank[k] == my_node && !local.count(static_cast<int>(k))) {
      lost.push_back(static_cast<int>(k));
    }
  }
  if (local.empty()) {
    // Its ranks here failed or left already (or a repeated answer).
    log.warn("join_reply_unclaimed", {{"comm", text(r.getName())}, {"from", from}});
    return;
  }
  joins.pending.erase(key);
  auto comm = make_spanning_comm(lk, text(r.getUid()), text(r.getName()), node_of_rank, pids,
                                 addresses, names, local, out);
  if (!lost.empty()) {
    break_comm(lk, *comm, Code::remote,
               "rank " + rank_list(lost) + " on node " + options.node_name +
                   " disconnected while the communicator was being created",
               out);
  }
}

void Engine::Impl::on_join_cancel(Locked lk, const std::string& from,
                                  nodewire::JoinCancel::Reader c, Deliveries& out) {
  const std::string key = data(c.getId()) + "@" + text(c.getRendezvous());
  auto it = joins.here.find(key);
  if (it == joins.here.end()) return;
  Rendezvous& rv = it->second;
  const auto rank = c.getRank();
  if (rank >= static_cast<std::uint32_t>(rv.nranks) || !rv.joined[rank] ||
      rv.joined[rank]->address != from) {
    return;
  }
  fail_rendezvous(lk, key, rv, Code::remote,
                  "rank " + std::to_string(rank) + " (pid " +
                      std::to_string(rv.joined[rank]->pid) + " on node " +
                      rv.joined[rank]->node + ") " + text(c.getMessage()),
                  static_cast<int>(rank), out);
  joins.here.erase(it);
}

void Engine::Impl::on_data(Locked lk, const std::string& from, Decoded& decoded, Deliveries& out,
                           Tasks& tasks) {
  Decoded* d = &decoded;
  auto dm = d->msg.getData();
  const std::string uid = text(dm.getUid());
  auto& ref = nodes.inboxes[uid];
  if (!ref.first) {
    // Its communicator does not exist here yet (the join reply is on its
    // way): kept for a while.
    ref.first = std::make_shared<Inbox>();
    ref.first->expires = Clock::now() + 2 * options.rendezvous_deadline;
  }
  Inbox& in = *ref.first;
  auto cp = ref.second.lock();
  NodeIn item;
  item.desc = desc_of(dm);
  item.desc_rank = static_cast<int>(dm.getDescRank());
  item.plan.algorithm = static_cast<NodeAlgorithm>(dm.getPlanAlgorithm());
  item.plan.chunk = dm.getPlanChunk();
  item.count = dm.getCount();
  item.dtype = static_cast<DType>(dm.getDtype());
  const bool p2p = dm.getP2p();
  const std::uint64_t seq = dm.getSeq(), tag = dm.getTag(), index = dm.getIndex();
  const int from_node = static_cast<int>(dm.getFromNode());
  const int from_rank = static_cast<int>(dm.getFromRank()), to_rank = static_cast<int>(dm.getToRank());
  item.arrived = Clock::now();
  item.payload.offset = d->raw_offset;
  item.payload.size = d->bytes.size() - d->raw_offset;
  item.payload.storage = std::move(d->bytes);
  // The texts are made only where the limit is passed (every data
  // message comes here).
  if (unreceived_over(lk, item.payload.storage.size()) &&
      over_unreceived_limit(lk, uid, in, cp, item.payload.storage.size(),
                            p2p ? "a send from rank " + std::to_string(from_rank) + " to rank " +
                                      std::to_string(to_rank)
                                : "data of operation " + std::to_string(seq),
                            cp && from_node >= 0 && from_node < static_cast<int>(cp->node_name.size())
                                ? "node " + cp->node_text(from_node)
                                : from,
                            out)) {
    return;
  }
  if (p2p) {
    log.debug("p2p_arrived", {{"uid", uid}, {"from", from_rank}, {"to", to_rank},
                              {"index", index}, {"comm", cp ? cp->name : "-"}});
    in.bytes += item.payload.storage.size();
    in.p2p[{from_rank, to_rank, index}] = std::move(item);
    if (cp) progress(lk, cp, out, tasks);
    return;
  }
  const auto key = std::make_tuple(seq, tag, from_node);
  if (const auto pp = in.posted.find(key); pp != in.posted.end()) {
    // Its payload went straight into the buffer the operation posted
    // (place_node_message); the message here is its head.
    if (pp->second.claimed && item.payload.size == 0) {
      item.payload.placed = pp->second.dest;
      item.payload.size = pp->second.bytes;
      log.debug("node_receive_placed", {{"comm", cp ? cp->name : uid},
                                        {"seq", seq},
                                        {"from_node", from_node},
                                        {"bytes", pp->second.bytes}});
    }
    in.posted.erase(pp);
  }
  if (cp && cp->is_ended(seq)) return;  // a failed operation's late data
  in.bytes += item.payload.storage.size();
  in.msgs[key] = std::move(item);
  notify(in);
  if (cp) check_remote_desc(lk, *cp, seq, out);
}

void Engine::Impl::on_broken(Locked lk, nodewire::Broken::Reader b, Deliveries& out,
                             Tasks& tasks) {
  auto it = nodes.inboxes.find(text(b.getUid()));
  if (it == nodes.inboxes.end()) return;
  const Code code = static_cast<Code>(b.getCode());
  const std::string why = text(b.getMessage());
  if (auto cp = it->second.second.lock()) {
    break_comm(lk, *cp, code, why, out, false, b.getFloor());
    progress(lk, cp, out, tasks);
  } else {
    it->second.first->broken = error(code, why);
  }
}

void Engine::Impl::on_slot_failed(Locked lk, nodewire::SlotFailed::Reader f, Deliveries& out,
                                  Tasks& tasks) {
  auto it = nodes.inboxes.find(text(f.getUid()));
  if (it == nodes.inboxes.end()) return;
  auto cp = it->second.second.lock();
  const std::uint64_t seq = f.getSeq();
  const Code code = static_cast<Code>(f.getCode());
  const std::string why = text(f.getMessage());
  if (cp && cp->is_ended(seq)) return;
  it->second.first->failed[seq] = error(code, why, seq);
  notify(*it->second.first);
  if (!cp) return;
  Comm& comm = *cp;
  auto [sit, fresh] = comm.slots.try_emplace(seq);
  Slot& slot = sit->second;
  if (fresh) {
    slot.seq = seq;
    slot.parts.resize(comm.nranks);
    slot.created = Clock::now();
    slot.deadline = slot.created + options.operation_deadline;
  }
  if (!slot.started && !slot.failed) {
    fail_slot(lk, comm, slot, code, why, out);
    if (slot.arrived >= comm.local_count) end_slot(lk, comm, sit);
  }
  progress(lk, cp, out, tasks);
}

// ---- the bound on what other nodes sent ahead ---------------------------------------------

bool Engine::Impl::unreceived_over(Locked, std::uint64_t size) const {
  const std::uint64_t limit = options.max_unreceived_bytes;
  if (limit == 0) return false;
  std::uint64_t held = 0;
  for (const auto& [_, ref] : nodes.inboxes) held += ref.first ? ref.first->bytes : 0;
  return held + size > limit;
}

bool Engine::Impl::over_unreceived_limit(Locked lk, const std::string& uid, Inbox& in,
                                         const std::shared_ptr<Comm>& cp, std::uint64_t size,
                                         const std::string& what, const std::string& from,
                                         Deliveries& out) {
  const std::uint64_t limit = options.max_unreceived_bytes;
  if (limit == 0) return false;
  std::uint64_t held = 0;
  for (const auto& [_, ref] : nodes.inboxes) held += ref.first ? ref.first->bytes : 0;
  if (held + size <= limit) return false;
  // Sends complete once their data is on the way (eager), and a broadcast
  // root does not wait for its receivers: without a bound a program whose
  // receives never come would grow this daemon until the kernel kills it,
  // taking every other job of the node with it. The communicator whose data
  // overflowed breaks instead, and what it held here is dropped.
  const std::string why = "node " + options.node_name + " holds " + std::to_string(held) +
                          " bytes from other nodes that no operation here has taken yet; " + what +
                          " from " + from + " (" + std::to_string(size) +
                          " bytes) would pass memory.max_unreceived_bytes = " +
                          std::to_string(limit) + (cp ? " (communicator " + cp->name + ")" : "");
  log.error("unreceived_limit", {{"uid", to_hex(uid)}, {"from", from}, {"held", held},
                                 {"bytes", size}, {"limit", limit},
                                 {"comm", cp ? cp->name : "-"}});
  in.msgs.clear();
  in.p2p.clear();
  in.bytes = 0;
  if (cp) {
    break_comm(lk, *cp, Code::resource_exhausted, why, out);
  } else {
    in.broken = error(Code::resource_exhausted, why);
  }
  return true;
}

}  // namespace collectived::engine

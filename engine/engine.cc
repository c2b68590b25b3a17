#include "engine/engine.h"

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

namespace {

/// What every rank of a collective must agree on.
struct Desc {
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  RedOp redop = RedOp::sum;
  std::uint64_t count = 0;
  int root = -1;

  bool operator==(const Desc&) const = default;

  std::string str() const {
    std::string s(to_string(kind));
    if (kind == OpKind::barrier || kind == OpKind::split) return s;
    s += "(count=" + std::to_string(count) + ", dtype=" + std::string(to_string(dtype));
    if (kind == OpKind::all_reduce || kind == OpKind::reduce || kind == OpKind::reduce_scatter) {
      s += ", op=" + std::string(to_string(redop));
    }
    if (kind == OpKind::broadcast || kind == OpKind::reduce) s += ", root=" + std::to_string(root);
    return s + ")";
  }
};

struct Delivery {
  std::shared_ptr<CompletionSink> sink;
  std::uint64_t request;
  Result result;
};

/// One rank's share of a collective.
struct Part {
  bool present = false;  // submitted and still waiting for the result
  std::uint64_t request = 0;
  std::shared_ptr<CompletionSink> sink;
  std::uint64_t session = 0;
  pid_t pid = 0;
  Span send, recv;
  int color = 0, key = 0;  // comm_split
};

/// One sequence number of a communicator.
struct Slot {
  std::uint64_t seq = 0;
  Desc desc;
  bool has_desc = false;
  int desc_rank = -1;
  std::vector<Part> parts;
  int arrived = 0;  // ranks that submitted this seq (including failed submissions)
  Clock::time_point deadline;
  Clock::time_point created;
  bool failed = false;
  Result failure;
  bool started = false;
};

struct P2PItem {
  bool is_send = false;
  int peer = 0;
  Span span;
  std::uint64_t count = 0;
  DType dtype = DType::uint8;
  std::uint64_t index = 0;  // k-th send/recv between this pair of ranks
  bool started = false;
};

struct Group {
  int rank = 0;
  std::uint64_t seq = 0;
  std::uint64_t request = 0;
  std::shared_ptr<CompletionSink> sink;
  std::vector<P2PItem> items;
  std::size_t done = 0;
  bool failed = false;
  bool answered = false;
  Clock::time_point deadline;
  Clock::time_point created;
};

struct Work {
  enum class Type { slot, group, leave } type;
  std::uint64_t seq = 0;              // slot
  std::shared_ptr<Group> group;       // group
  std::uint64_t request = 0;          // leave
  std::shared_ptr<CompletionSink> sink;  // leave
};

struct Member {
  int rank = 0;
  std::uint64_t session = 0;
  pid_t pid = 0;
  std::uint64_t handle = 0;
  bool active = true;  // false once left, aborted or dead
  std::uint64_t next_seq = 0;
  std::deque<Work> queue;  // this rank's operations in submission order
};

struct Comm {
  std::string name;
  int nranks = 0;
  std::vector<Member> members;
  std::map<std::uint64_t, Slot> slots;
  std::map<std::pair<int, int>, std::uint64_t> sends, recvs;  // (from, to) -> next index
  std::uint64_t next_group_seq = 0;
  std::optional<Result> broken;

  std::string where(int rank) const {
    return "communicator " + name + " (rank " + std::to_string(rank) + " of " +
           std::to_string(nranks) + ")";
  }
  std::string who(int rank) const {
    return "rank " + std::to_string(rank) + " (pid " + std::to_string(members[rank].pid) + ")";
  }
  int active_members() const {
    int n = 0;
    for (const auto& m : members) n += m.active ? 1 : 0;
    return n;
  }
};

struct Joiner {
  ClientRef client;
  std::uint64_t request = 0;
};

struct Rendezvous {
  std::string name;
  int nranks = 0;
  std::vector<std::optional<Joiner>> joined;
  int count = 0;
  Clock::time_point started;
  Clock::time_point deadline;
};

std::string hex_prefix(const std::string& bytes, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < std::min(n, bytes.size()); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace

struct Engine::Impl {
  EngineOptions options;
  Registry& registry;
  Logger& log;
  mutable std::mutex mu;
  std::map<std::string, Rendezvous> rendezvous;
  std::map<std::uint64_t, std::pair<std::shared_ptr<Comm>, int>> handles;  // handle -> (comm, rank)
  std::uint64_t next_handle = 1;
  std::uint64_t completed = 0;
  bool stopping = false;
  // Declared last: destroyed first, so its threads are joined (and their
  // tasks, which call back into this Impl, are done) before anything else goes.
  WorkerPool pool;

  Impl(EngineOptions o, Registry& r, Logger& l)
      : options(std::move(o)), registry(r), log(l), pool(options.worker_threads) {}

  // ---- helpers (all with mu held) -------------------------------------------

  std::pair<std::shared_ptr<Comm>, int> resolve(const ClientRef& client, std::uint64_t handle) {
    auto it = handles.find(handle);
    if (it == handles.end()) {
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

  /// resolve(), or an error answer naming `what` (then the pointer is null).
  std::pair<std::shared_ptr<Comm>, int> resolve_or_answer(const ClientRef& client,
                                                          std::uint64_t request,
                                                          std::uint64_t handle,
                                                          std::string_view what,
                                                          std::vector<Delivery>& out) {
    try {
      return resolve(client, handle);
    } catch (const Error& e) {
      out.push_back({client.sink, request, error(e.code(), std::string(what) + ": " + e.what())});
      return {nullptr, 0};
    }
  }

  Span resolve_span(const ClientRef& client, const BufferArg& b, std::uint64_t bytes,
                    const char* which) {
    if (bytes == 0) return {};
    try {
      auto reg = registry.find_range(client.session, b.handle, b.offset, bytes);
      std::byte* p = reg->mapping.data() + b.offset;
      return Span{std::move(reg), p, bytes};
    } catch (const Error& e) {
      throw Error(e.code(), std::string(which) + " buffer: " + e.what());
    }
  }

  Result error(Code code, std::string message, std::uint64_t seq = 0) {
    Result r;
    r.code = code;
    r.message = std::move(message);
    r.seq = seq;
    return r;
  }

  void remove_work(Member& m, const std::function<bool(const Work&)>& pred) {
    m.queue.erase(std::remove_if(m.queue.begin(), m.queue.end(), pred), m.queue.end());
  }

  // ---- metrics (EngineOptions::observer) ----------------------------------------

  void observe_slot(const Comm& comm, const Slot& slot, Code code) {
    if (options.observer == nullptr) return;
    const Desc& d = slot.desc;
    std::uint64_t bytes = d.count * dtype_size(d.dtype);
    if (d.kind == OpKind::all_gather || d.kind == OpKind::reduce_scatter ||
        d.kind == OpKind::all_to_all) {
      bytes *= static_cast<std::uint64_t>(comm.nranks);
    } else if (d.kind == OpKind::barrier || d.kind == OpKind::split) {
      bytes = 0;
    }
    // Every operation runs inside this daemon for now (memcpy between clients).
    options.observer->operation_finished(d.kind, code, bytes, Clock::now() - slot.created,
                                         "local");
  }

  void observe_group(const Group& g, Code code) {
    if (options.observer == nullptr) return;
    std::uint64_t bytes = 0;
    for (const auto& item : g.items) {
      if (item.is_send) bytes += item.count * dtype_size(item.dtype);
    }
    options.observer->operation_finished(OpKind::p2p, code, bytes, Clock::now() - g.created,
                                         "local");
  }

  void fail_slot(Comm& comm, Slot& slot, Code code, const std::string& reason,
                 std::vector<Delivery>& out) {
    observe_slot(comm, slot, code);
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
      remove_work(comm.members[r], [&](const Work& w) {
        return w.type == Work::Type::slot && w.seq == slot.seq;
      });
    }
  }

  void fail_group(Comm& comm, Group& g, Code code, const std::string& reason,
                  std::vector<Delivery>& out) {
    if (g.failed || g.answered) return;
    observe_group(g, code);
    g.failed = true;
    g.answered = true;
    out.push_back({g.sink, g.request,
                   error(code,
                         "send/recv group (seq " + std::to_string(g.seq) + ") on " +
                             comm.where(g.rank) + ": " + reason,
                         g.seq)});
    remove_work(comm.members[g.rank],
                [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
  }

  /// Fails everything not yet running; later submissions fail at once.
  void break_comm(Comm& comm, Code code, const std::string& reason, std::vector<Delivery>& out) {
    if (!comm.broken) comm.broken = error(code, reason);
    for (auto it = comm.slots.begin(); it != comm.slots.end();) {
      if (!it->second.started) {
        if (!it->second.failed) fail_slot(comm, it->second, code, reason, out);
        it = comm.slots.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& m : comm.members) {
      std::vector<std::shared_ptr<Group>> groups;
      for (auto& w : m.queue) {
        if (w.type == Work::Type::group) groups.push_back(w.group);
      }
      for (auto& g : groups) {
        const bool running = std::any_of(g->items.begin(), g->items.end(),
                                         [](const P2PItem& i) { return i.started; });
        if (!running) fail_group(comm, *g, code, reason, out);
      }
    }
  }

  /// Every live communicator once (handles map several ranks to one).
  std::vector<std::shared_ptr<Comm>> all_comms() const {
    std::vector<std::shared_ptr<Comm>> comms;
    for (const auto& [h, cr] : handles) comms.push_back(cr.first);
    std::sort(comms.begin(), comms.end());
    comms.erase(std::unique(comms.begin(), comms.end()), comms.end());
    return comms;
  }

  void drop_member(Comm& comm, int rank) {
    Member& m = comm.members[rank];
    m.active = false;
    handles.erase(m.handle);
  }

  // ---- progress --------------------------------------------------------------

  /// Starts whatever can start; answers leaves and failures at queue heads.
  void progress(const std::shared_ptr<Comm>& cp, std::vector<Delivery>& out,
                std::vector<std::function<void()>>& tasks) {
    Comm& comm = *cp;
    for (bool changed = true; changed;) {
      changed = false;
      // Leaves whose earlier operations are all done.
      for (auto& m : comm.members) {
        if (!m.active || m.queue.empty() || m.queue.front().type != Work::Type::leave) continue;
        Work w = std::move(m.queue.front());
        m.queue.pop_front();
        out.push_back({w.sink, w.request, Result{}});
        drop_member(comm, m.rank);
        log.debug("comm_left", {{"comm", comm.name}, {"rank", m.rank}, {"pid", m.pid}});
        if (comm.active_members() > 0) {
          break_comm(comm, Code::remote,
                     comm.who(m.rank) + " left the communicator (comm_destroy)", out);
        }
        changed = true;
      }
      if (comm.broken) break;
      // A collective starts when it is at the head of every rank's queue.
      if (!comm.members.empty() && !comm.members[0].queue.empty() &&
          comm.members[0].queue.front().type == Work::Type::slot) {
        const std::uint64_t seq = comm.members[0].queue.front().seq;
        auto it = comm.slots.find(seq);
        if (it != comm.slots.end() && !it->second.started && !it->second.failed &&
            it->second.arrived == comm.nranks &&
            std::all_of(comm.members.begin(), comm.members.end(), [&](const Member& m) {
              return !m.queue.empty() && m.queue.front().type == Work::Type::slot &&
                     m.queue.front().seq == seq;
            })) {
          start_slot(cp, it->second, out, tasks);
          changed = true;
        }
      }
      // Point-to-point pairs whose both groups are at their ranks' heads.
      for (auto& m : comm.members) {
        if (m.queue.empty() || m.queue.front().type != Work::Type::group) continue;
        auto g = m.queue.front().group;
        for (auto& item : g->items) {
          if (item.started || !item.is_send) continue;
          Member& peer = comm.members[item.peer];
          if (peer.queue.empty() || peer.queue.front().type != Work::Type::group) continue;
          auto h = peer.queue.front().group;
          auto match = std::find_if(h->items.begin(), h->items.end(), [&](const P2PItem& i) {
            return !i.is_send && i.peer == m.rank && i.index == item.index;
          });
          if (match == h->items.end()) continue;
          if (match->count * dtype_size(match->dtype) != item.count * dtype_size(item.dtype) ||
              match->dtype != item.dtype) {
            const std::string why =
                "mismatched send/recv: rank " + std::to_string(m.rank) + " sends " +
                std::to_string(item.count) + " " + std::string(to_string(item.dtype)) +
                " to rank " + std::to_string(item.peer) + " but rank " +
                std::to_string(item.peer) + " receives " + std::to_string(match->count) + " " +
                std::string(to_string(match->dtype)) + " from rank " + std::to_string(m.rank);
            fail_group(comm, *g, Code::mismatch, why, out);
            if (h != g) fail_group(comm, *h, Code::mismatch, why, out);
            changed = true;
            break;
          }
          item.started = true;
          match->started = true;
          start_pair(cp, g, h, item.span, match->span, tasks);
        }
      }
    }
  }

  void start_slot(const std::shared_ptr<Comm>& cp, Slot& slot, std::vector<Delivery>& out,
                  std::vector<std::function<void()>>& tasks) {
    Comm& comm = *cp;
    slot.started = true;
    const std::uint64_t seq = slot.seq;
    if (slot.desc.kind == OpKind::split) {
      do_split(cp, slot, out);
      return;
    }
    if (slot.desc.kind == OpKind::barrier) {
      complete_slot(comm, seq, out);
      return;
    }
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
      std::vector<Delivery> done;
      std::vector<std::function<void()>> next;
      {
        std::lock_guard lock(mu);
        complete_slot(*cp, seq, done);
        progress(cp, done, next);
      }
      pool.submit_all(std::move(next));
      deliver(done);
    });
    for (auto& t : more) tasks.push_back(std::move(t));
  }

  void complete_slot(Comm& comm, std::uint64_t seq, std::vector<Delivery>& out) {
    auto it = comm.slots.find(seq);
    if (it == comm.slots.end()) return;
    Slot& slot = it->second;
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
      out.push_back({part.sink, part.request, std::move(res)});
    }
    ++completed;
    observe_slot(comm, slot, Code::ok);
    comm.slots.erase(it);
  }

  void start_pair(const std::shared_ptr<Comm>& cp, std::shared_ptr<Group> sender,
                  std::shared_ptr<Group> receiver, Span src, Span dst,
                  std::vector<std::function<void()>>& tasks) {
    auto more = plan_copy(std::move(src), std::move(dst), pool.size(),
                          [this, cp, sender, receiver] {
                            std::vector<Delivery> done;
                            std::vector<std::function<void()>> next;
                            {
                              std::lock_guard lock(mu);
                              item_done(*cp, *sender, done);
                              item_done(*cp, *receiver, done);
                              progress(cp, done, next);
                            }
                            pool.submit_all(std::move(next));
                            deliver(done);
                          });
    for (auto& t : more) tasks.push_back(std::move(t));
  }

  void item_done(Comm& comm, Group& g, std::vector<Delivery>& out) {
    ++g.done;
    if (g.done < g.items.size() || g.answered) return;
    g.answered = true;
    Result res;
    res.seq = g.seq;
    out.push_back({g.sink, g.request, std::move(res)});
    ++completed;
    observe_group(g, Code::ok);
    remove_work(comm.members[g.rank],
                [&](const Work& w) { return w.type == Work::Type::group && w.group.get() == &g; });
  }

  void do_split(const std::shared_ptr<Comm>& cp, Slot& slot, std::vector<Delivery>& out) {
    Comm& parent = *cp;
    std::map<int, std::vector<int>> by_color;
    for (int r = 0; r < parent.nranks; ++r) {
      if (slot.parts[r].color >= 0) by_color[slot.parts[r].color].push_back(r);
    }
    std::map<int, CommInfo> info;  // parent rank -> new communicator
    for (auto& [color, ranks] : by_color) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
        return std::tie(slot.parts[a].key, a) < std::tie(slot.parts[b].key, b);
      });
      auto child = std::make_shared<Comm>();
      child->name = parent.name + "." + std::to_string(color);
      child->nranks = static_cast<int>(ranks.size());
      for (int i = 0; i < child->nranks; ++i) {
        const Part& p = slot.parts[ranks[i]];
        Member m;
        m.rank = i;
        m.session = p.session;
        m.pid = p.pid;
        m.handle = next_handle++;
        handles[m.handle] = {child, i};
        info[ranks[i]] = CommInfo{m.handle, static_cast<std::uint32_t>(i),
                                  static_cast<std::uint32_t>(child->nranks), child->name};
        child->members.push_back(std::move(m));
      }
      log.info("comm_created", {{"comm", child->name},
                                {"nranks", child->nranks},
                                {"parent", parent.name},
                                {"color", color}});
    }
    const std::uint64_t seq = slot.seq;
    std::vector<Delivery> replies;
    for (int r = 0; r < parent.nranks; ++r) {
      if (!slot.parts[r].present) continue;
      Result res;
      res.seq = seq;
      res.comm = info.count(r) ? info[r] : CommInfo{};
      replies.push_back({slot.parts[r].sink, slot.parts[r].request, std::move(res)});
      slot.parts[r].present = false;
    }
    complete_slot(parent, seq, out);
    for (auto& d : replies) out.push_back(std::move(d));
  }

  void deliver(std::vector<Delivery>& out) {
    for (auto& d : out) {
      if (d.sink) d.sink->complete(d.request, std::move(d.result));
    }
    out.clear();
  }

  // ---- requests -----------------------------------------------------------------

  /// Runs `fn` under the engine lock, then starts the tasks it produced and
  /// delivers its answers. `run_inline`: the caller is a daemon worker (the
  /// ring poller), and an operation that is a single task runs right here,
  /// saving the wake-up of a pool thread — most of a small operation's cost.
  template <typename Fn>
  void locked(Fn&& fn, bool run_inline = false) {
    std::vector<Delivery> out;
    std::vector<std::function<void()>> tasks;
    {
      std::lock_guard lock(mu);
      fn(out, tasks);
    }
    if (run_inline && tasks.size() == 1) {
      deliver(out);
      tasks.front()();
      return;
    }
    pool.submit_all(std::move(tasks));
    deliver(out);
  }

  /// Validates one rank's collective and resolves its buffers. Throws Error.
  Desc validate(const ClientRef& client, const CollectiveArgs& a, int nranks, int rank,
                Part& part) {
    Desc d;
    d.kind = a.kind;
    if (a.kind == OpKind::barrier || a.kind == OpKind::split) return d;
    const auto dtype = dtype_from_int(a.dtype);
    if (!dtype) throw Error(Code::invalid_argument, "unknown dtype " + std::to_string(a.dtype));
    d.dtype = *dtype;
    d.count = a.count;
    const bool reducing = a.kind == OpKind::all_reduce || a.kind == OpKind::reduce ||
                          a.kind == OpKind::reduce_scatter;
    if (reducing) {
      const auto op = redop_from_int(a.redop);
      if (!op) throw Error(Code::invalid_argument, "unknown reduction " + std::to_string(a.redop));
      d.redop = *op;
    }
    const bool rooted = a.kind == OpKind::broadcast || a.kind == OpKind::reduce;
    if (rooted) {
      if (a.root < 0 || a.root >= nranks) {
        throw Error(Code::invalid_argument, "root " + std::to_string(a.root) +
                                                " is not a rank of this communicator (0.." +
                                                std::to_string(nranks - 1) + ")");
      }
      d.root = a.root;
    }
    const std::uint64_t es = dtype_size(d.dtype);
    const std::uint64_t n = static_cast<std::uint64_t>(nranks);
    if (a.count > (std::uint64_t{1} << 46) / es / n) {
      throw Error(Code::invalid_argument, "count " + std::to_string(a.count) + " is too large");
    }
    const std::uint64_t one = a.count * es;
    std::uint64_t send_bytes = one, recv_bytes = one;
    switch (a.kind) {
      case OpKind::all_gather: recv_bytes = one * n; break;
      case OpKind::reduce_scatter: send_bytes = one * n; break;
      case OpKind::all_to_all: send_bytes = recv_bytes = one * n; break;
      case OpKind::broadcast: if (rank != a.root) send_bytes = 0; break;
      case OpKind::reduce: if (rank != a.root) recv_bytes = 0; break;
      default: break;
    }
    part.send = resolve_span(client, a.send, send_bytes, "send");
    part.recv = resolve_span(client, a.recv, recv_bytes, "recv");
    // Overlapping send and receive buffers are only allowed in the in-place
    // layout of each operation; anything else would read half-written data.
    if (part.send.ptr && part.recv.ptr && part.send.reg == part.recv.reg) {
      const std::byte* s = part.send.ptr;
      const std::byte* r = part.recv.ptr;
      const bool overlap = s < r + part.recv.bytes && r < s + part.send.bytes;
      bool in_place = false;
      switch (a.kind) {
        case OpKind::all_gather: in_place = s == r + rank * one; break;
        case OpKind::reduce_scatter: in_place = r == s + rank * one; break;
        default: in_place = s == r; break;
      }
      if (overlap && !in_place) {
        throw Error(Code::invalid_argument,
                    "send and recv buffers overlap but are not the in-place layout of " +
                        std::string(to_string(a.kind)));
      }
    }
    return d;
  }

  void submit_slot(const ClientRef& client, std::uint64_t request, std::uint64_t handle,
                   const CollectiveArgs& args, int color, int key) {
    locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
      auto [cp, rank] = resolve_or_answer(client, request, handle, to_string(args.kind), out);
      if (!cp) return;
      Comm& comm = *cp;
      const std::string op(to_string(args.kind));
      if (stopping) {
        out.push_back({client.sink, request,
                       error(Code::aborted, op + " on " + comm.where(rank) +
                                                ": the daemon is stopping")});
        return;
      }
      if (comm.broken) {
        out.push_back({client.sink, request,
                       error(comm.broken->code,
                             op + " on " + comm.where(rank) + ": " + comm.broken->message)});
        return;
      }
      Member& m = comm.members[rank];
      const std::uint64_t seq = m.next_seq++;
      auto [it, fresh] = comm.slots.try_emplace(seq);
      Slot& slot = it->second;
      if (fresh) {
        slot.seq = seq;
        slot.parts.resize(comm.nranks);
        slot.created = Clock::now();
        slot.deadline = slot.created + options.operation_deadline;
      }
      slot.arrived += 1;
      if (slot.failed) {
        Result res = slot.failure;
        res.message = op + " (seq " + std::to_string(seq) + ") on " + comm.where(rank) + ": " +
                      slot.failure.message;
        out.push_back({client.sink, request, std::move(res)});
        if (slot.arrived >= comm.nranks) comm.slots.erase(it);
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
        desc = validate(client, args, comm.nranks, rank, part);
      } catch (const Error& e) {
        part.present = true;
        slot.parts[rank] = std::move(part);
        if (!slot.has_desc) slot.desc.kind = args.kind;
        fail_slot(comm, slot, e.code(),
                  comm.who(rank) + " submitted an invalid " + op + ": " + e.what(), out);
        if (slot.arrived >= comm.nranks) comm.slots.erase(it);
        return;
      }
      part.present = true;
      slot.parts[rank] = std::move(part);
      if (!slot.has_desc) {
        slot.desc = desc;
        slot.has_desc = true;
        slot.desc_rank = rank;
      } else if (!(slot.desc == desc)) {
        // Named both ways, so that whoever reads either rank's error sees the pair.
        fail_slot(comm, slot, Code::mismatch,
                  "mismatched operations for sequence number " + std::to_string(seq) + ": " +
                      comm.who(slot.desc_rank) + " submitted " + slot.desc.str() + " but " +
                      comm.who(rank) + " submitted " + desc.str(),
                  out);
        if (slot.arrived >= comm.nranks) comm.slots.erase(it);
        return;
      }
      m.queue.push_back(Work{Work::Type::slot, seq, nullptr, 0, nullptr});
      progress(cp, out, tasks);
    }, client.inline_small);
  }
};

Engine::Engine(EngineOptions options, Registry& registry, Logger& log)
    : impl_(std::make_unique<Impl>(std::move(options), registry, log)) {}

Engine::~Engine() = default;

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
    if (rendezvous != I.options.rendezvous_address) {
      return fail(Code::unavailable,
                  "the unique id names rendezvous daemon " + rendezvous + ", but this is node " +
                      I.options.node_name + " (" + I.options.rendezvous_address +
                      "); communicators across nodes need the daemons' TCP transport");
    }
    const std::string key = secret + "@" + rendezvous;
    auto [it, fresh] = I.rendezvous.try_emplace(key);
    Rendezvous& rv = it->second;
    if (fresh) {
      rv.name = name;
      rv.nranks = static_cast<int>(nranks);
      rv.joined.resize(nranks);
      rv.started = Clock::now();
      rv.deadline = rv.started + I.options.rendezvous_deadline;
    }
    if (rv.nranks != static_cast<int>(nranks)) {
      return fail(Code::mismatch, "this rank says " + std::to_string(nranks) +
                                      " ranks, but earlier ranks said " +
                                      std::to_string(rv.nranks));
    }
    if (rv.joined[rank]) {
      return fail(Code::invalid_usage, "rank " + std::to_string(rank) +
                                           " already joined (pid " +
                                           std::to_string(rv.joined[rank]->client.pid) + ")");
    }
    rv.joined[rank] = Joiner{client, request};
    if (++rv.count < rv.nranks) return;

    auto comm = std::make_shared<Comm>();
    comm->name = rv.name;
    comm->nranks = rv.nranks;
    for (int r = 0; r < rv.nranks; ++r) {
      Member m;
      m.rank = r;
      m.session = rv.joined[r]->client.session;
      m.pid = rv.joined[r]->client.pid;
      m.handle = I.next_handle++;
      I.handles[m.handle] = {comm, r};
      comm->members.push_back(std::move(m));
    }
    for (int r = 0; r < rv.nranks; ++r) {
      Result res;
      res.comm = CommInfo{comm->members[r].handle, static_cast<std::uint32_t>(r),
                          static_cast<std::uint32_t>(rv.nranks), comm->name};
      out.push_back({rv.joined[r]->client.sink, rv.joined[r]->request, std::move(res)});
    }
    I.log.info("comm_created",
               {{"comm", comm->name},
                {"nranks", comm->nranks},
                {"rendezvous_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                      Clock::now() - rv.started)
                                      .count()}});
    I.rendezvous.erase(it);
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
                       const std::vector<P2PArgs>& items) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    auto [cp, rank] = I.resolve_or_answer(client, request, handle, "send/recv group", out);
    if (!cp) return;
    Comm& comm = *cp;
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
    g->deadline = g->created + I.options.operation_deadline;
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
        g->items.push_back(std::move(item));
      }
    } catch (const Error& e) {
      return fail(e.code(), e.what());
    }
    if (g->items.empty()) {
      out.push_back({client.sink, request, Result{}});
      return;
    }
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
        if (rv.joined[r] && rv.joined[r]->client.session == session) gone = r;
      }
      if (gone < 0) {
        ++it;
        continue;
      }
      for (int r = 0; r < rv.nranks; ++r) {
        if (!rv.joined[r] || rv.joined[r]->client.session == session) continue;
        out.push_back({rv.joined[r]->client.sink, rv.joined[r]->request,
                       I.error(Code::remote, "comm_init_rank (communicator " + rv.name +
                                                 ", rank " + std::to_string(r) + "): rank " +
                                                 std::to_string(gone) + " (pid " +
                                                 std::to_string(rv.joined[gone]->client.pid) +
                                                 ") disconnected before all ranks joined")});
      }
      it = I.rendezvous.erase(it);
    }
    std::vector<std::pair<std::shared_ptr<Comm>, int>> mine;
    for (auto& [h, cr] : I.handles) {
      if (cr.first->members[cr.second].session == session) mine.push_back(cr);
    }
    for (auto& [cp, rank] : mine) {
      Comm& comm = *cp;
      Member& m = comm.members[rank];
      m.queue.clear();
      I.drop_member(comm, rank);
      if (comm.active_members() > 0) {
        I.log.warn("rank_died", {{"comm", comm.name}, {"rank", rank}, {"pid", m.pid}});
        I.break_comm(comm, Code::remote,
                     comm.who(rank) + " on node " + I.options.node_name +
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
      for (int r = 0; r < rv.nranks; ++r) {
        if (!rv.joined[r]) continue;
        out.push_back(
            {rv.joined[r]->client.sink, rv.joined[r]->request,
             I.error(Code::timeout,
                     "comm_init_rank (communicator " + rv.name + ", rank " + std::to_string(r) +
                         " of " + std::to_string(rv.nranks) + "): rendezvous timed out after " +
                         std::to_string(waited) + " ms (deadlines.rendezvous_ms) on node " +
                         I.options.node_name + ": " + std::to_string(rv.count) + " of " +
                         std::to_string(rv.nranks) + " ranks joined; missing ranks: " +
                         rank_list(missing))});
      }
      I.log.warn("rendezvous_timeout", {{"comm", rv.name}, {"missing", rank_list(missing)}});
      it = I.rendezvous.erase(it);
    }
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
          if (comm.members[r].next_seq <= slot.seq) {
            missing.push_back(r);
            if (!detail.empty()) detail += ", ";
            detail += comm.who(r);
          }
        }
        std::string why;
        if (!missing.empty()) {
          why = "timed out after " + std::to_string(I.options.operation_deadline.count()) +
                " ms (deadlines.operation_ms) on node " + I.options.node_name +
                ": ranks that did not submit it: " + detail;
        } else {
          why = "timed out after " + std::to_string(I.options.operation_deadline.count()) +
                " ms (deadlines.operation_ms): every rank submitted it, but an earlier "
                "operation of this communicator never finished";
        }
        I.log.warn("operation_timeout", {{"comm", comm.name},
                                         {"seq", slot.seq},
                                         {"op", to_string(slot.desc.kind)},
                                         {"missing_ranks", rank_list(missing)}});
        I.fail_slot(comm, slot, Code::timeout, why, out);
        if (slot.arrived >= comm.nranks) {
          it = comm.slots.erase(it);
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
                       "timed out after " + std::to_string(I.options.operation_deadline.count()) +
                           " ms (deadlines.operation_ms): unmatched " + peers,
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
    for (auto& [key, rv] : I.rendezvous) {
      for (auto& j : rv.joined) {
        if (j) out.push_back({j->client.sink, j->request, I.error(Code::aborted, reason)});
      }
    }
    I.rendezvous.clear();
    for (auto& cp : I.all_comms()) I.break_comm(*cp, Code::aborted, reason, out);
  });
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
      c.ranks.push_back({static_cast<std::uint32_t>(m.rank), m.pid, m.session, I.options.node_name,
                         m.active, m.next_seq});
    }
    for (const auto& [seq, slot] : comm.slots) {
      if (slot.failed) continue;
      OpSnapshot& op = c.ops.emplace_back();
      op.seq = seq;
      op.op = slot.has_desc ? slot.desc.str() : std::string(to_string(slot.desc.kind));
      op.age = age(slot.created);
      op.started = slot.started;
      for (const Member& m : comm.members) {
        if (m.next_seq <= seq) op.missing.push_back(static_cast<std::uint32_t>(m.rank));
      }
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

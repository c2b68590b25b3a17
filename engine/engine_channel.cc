#include "engine/engine_channel.h"

#include <algorithm>

namespace collectived::engine {

EngineChannel::EngineChannel(Engine::Impl& impl, std::shared_ptr<Comm> comm, std::uint64_t seq,
                             Desc desc, NodePlan plan, std::chrono::microseconds input_poll,
                             int desc_rank, Clock::time_point deadline, std::string deadline_text,
                             std::chrono::milliseconds budget)
    : I_(impl),
      comm_(std::move(comm)),
      seq_(seq),
      desc_(desc),
      plan_(plan),
      input_poll_(input_poll),
      desc_rank_(desc_rank),
      deadline_(deadline),
      deadline_text_(std::move(deadline_text)),
      budget_(budget) {
  sends_->exec = comm_->exec;
}

void EngineChannel::keep_alive(std::shared_ptr<const std::vector<Span>> spans) {
  regions_.clear();
  for (const Span& sp : *spans) {
    if (!sp.reg || sp.reg->device) continue;
    if (HostRegion* r = sp.reg->mapping.region()) regions_.push_back(r);
  }
  keep_ = std::move(spans);
}

void EngineChannel::send(int to, std::uint64_t tag,
                         std::span<const std::span<const std::byte>> pieces,
                         std::shared_ptr<const void> owner) {
  auto keep = std::make_shared<Keep>(Keep{keep_, scratch_, std::move(owner)});
  {
    std::lock_guard l(sends_->mu);
    ++sends_->outstanding;
    ++sends_->by_node[to];
  }
  auto find_region = [this](std::span<const std::byte> piece) -> HostRegion* {
    for (HostRegion* r : regions_) {
      if (r->contains(piece.data(), piece.size())) return r;
    }
    return nullptr;
  };
  sent_ = true;
  I_.send_node(comm_->node_address[to],
               op_data_message(I_.options.rendezvous_address, comm_->uid, seq_, tag, comm_->my_node,
                               desc_, desc_rank_, plan_, pieces, std::move(keep), find_region),
               [sends = sends_, to, node = comm_->node_text(to)](Code code, const std::string& why) {
                 std::lock_guard l(sends->mu);
                 --sends->outstanding;
                 if (--sends->by_node[to] == 0) sends->by_node.erase(to);
                 if (code != Code::ok && sends->code == Code::ok) {
                   sends->code = code;
                   sends->why = "sending to node " + node + " failed: " + why;
                 }
                 if (auto ex = sends->exec.lock()) Executor::wake(ex);
               });
}

void EngineChannel::flush() {
  for (;;) {
    {
      std::lock_guard l(sends_->mu);
      if (sends_->outstanding == 0) break;
    }
    if (Clock::now() >= deadline_) break;
    check_stopping();
    Executor::wait(*comm_->exec);
  }
  std::unique_lock l(sends_->mu);
  if (sends_->outstanding != 0) {
    std::string nodes;
    for (const auto& [j, n] : sends_->by_node) {
      nodes += (nodes.empty() ? "" : "; ") + std::string("node ") + comm_->node_text(j) +
               " (hosts " + ranks_text(*comm_, j) + "): " + std::to_string(n) + " message(s)";
    }
    throw Error(Code::timeout, "timed out after " + deadline_text_ + " on node " +
                                   I_.options.node_name +
                                   " while sending; not taken by the connection to " + nodes +
                                   " (the peer is not reading: stopped, or its connection stalled)");
  }
  if (sends_->code != Code::ok) throw Error(sends_->code, sends_->why);
}

std::byte* EngineChannel::scratch(std::size_t bytes) {
  // The executor's buffer, reused by the communicator's operations (they run
  // one at a time on its thread): fresh pages cost a fault each.
  auto& s = comm_->exec->scratch;
  if (!s || s->size() < bytes) s = std::make_shared<MessageBytes>(std::max<std::size_t>(bytes, 64));
  scratch_ = s;
  return s->data();
}

void EngineChannel::compute(const std::function<void()>& work) {
  // On the worker pool; this fiber yields the event loop meanwhile. The
  // fiber waits for the task whatever happens (`work` lives on its stack).
  compute_wait(compute_async([&work] { work(); }));
}

int EngineChannel::parallelism() const {
  // Cores to spare: the pool has threads beyond the two that the event loop
  // and the transport's copies keep busy (the same rule as tcp.io_threads).
  const std::size_t threads = I_.pool.size();
  return threads >= 4 ? static_cast<int>(std::min<std::size_t>(threads - 2, 8)) : 1;
}

NodeChannel::Ticket EngineChannel::compute_async(std::function<void()> work) {
  auto st = std::make_shared<AsyncWork>();
  std::weak_ptr<Executor> wex = comm_->exec;
  I_.pool.submit([st, work = std::move(work), wex] {
    try {
      work();
    } catch (...) {
      st->error = std::current_exception();
    }
    st->done.store(true, std::memory_order_release);
    if (auto ex = wex.lock()) Executor::wake(ex);
  });
  return st;
}

bool EngineChannel::compute_done(const Ticket& ticket) {
  return !ticket || static_cast<const AsyncWork*>(ticket.get())->done.load(std::memory_order_acquire);
}

void EngineChannel::compute_wait(const Ticket& ticket) {
  if (!ticket) return;
  const auto* st = static_cast<const AsyncWork*>(ticket.get());
  // Whatever happens meanwhile (the work holds the ranks' buffers): no
  // deadline here, a pass over one chunk takes microseconds to milliseconds.
  while (!st->done.load(std::memory_order_acquire)) Executor::wait(*comm_->exec);
  if (st->error) std::rethrow_exception(st->error);
}

void EngineChannel::start_sends() {
  if (sent_) {
    sent_ = false;
    Executor::yield(comm_->exec);
  }
}

NodePayload EngineChannel::recv(int from, std::uint64_t tag) {
  // The daemon's transport takes a send on its event loop, the thread this
  // operation's fiber runs on, once the fiber gives the thread back: until
  // then what was sent has not left. An algorithm that goes on to reduce
  // chunks already here (no wait in recv) would hold its sends back for as
  // long (the pairwise all-reduce's reduced chunks, which the other nodes
  // wait for). So the first receive after a send lets them go.
  start_sends();
  Executor::take_turns(comm_->exec);
  EngineLock lock(I_.mu);
  Inbox& in = *comm_->inbox;
  const auto key = std::make_tuple(seq_, tag, from);
  for (;;) {
    if (auto f = in.failed.find(seq_); f != in.failed.end()) {
      remote_failure = true;
      throw Error(f->second.code, f->second.message);
    }
    auto it = in.msgs.find(key);
    if (it != in.msgs.end()) {
      if (!(it->second.desc == desc_)) {
        // check_remote_desc() names it on arrival; this covers the rest.
        throw Error(Code::mismatch, desc_mismatch(*comm_, seq_, desc_rank_, desc_,
                                                  it->second.desc_rank, it->second.desc));
      }
      if (it->second.plan.known() && plan_.known() && !(it->second.plan == plan_)) {
        throw Error(Code::mismatch,
                    plan_mismatch(*comm_, seq_, desc_, plan_, from, it->second.plan));
      }
      NodePayload p = std::move(it->second.payload);
      in.bytes -= p.storage.size();
      in.msgs.erase(it);
      return p;
    }
    // This node's inputs never coming counts too: the other nodes wait
    // for them, so no answer comes from them first.
    check_ended_locked(lock.token(), -1);
    if (Clock::now() >= deadline_) {
      throw Error(Code::timeout,
                  "timed out after " + deadline_text_ + " on node " + I_.options.node_name +
                      " waiting for node " + comm_->node_text(from) + ", which hosts " +
                      ranks_text(*comm_, from) +
                      ": they have not all submitted this operation, or an earlier one is "
                      "not done there");
    }
    // Until something arrives for this communicator (or the deadline sweep).
    lock.unlock();
    Executor::wait(*comm_->exec);
    lock.lock();
  }
}

void EngineChannel::reading(const std::byte* p, std::uint64_t bytes) {
  if (!in_pieces) return;
  std::uint32_t need = 0;
  int rank = -1;
  for (const Staging& i : inputs) {
    if (p >= i.base && p + bytes <= i.base + i.bytes) {
      const auto from = static_cast<std::uint64_t>(p - i.base);
      need = in_pieces->needed(from, from + bytes);
      rank = i.rank;
      break;
    }
  }
  wait_pieces(need, rank);
}

void EngineChannel::await_inputs() {
  if (in_pieces) wait_pieces(in_pieces->count, -1);
}

void EngineChannel::written(const std::byte* p, std::uint64_t bytes) {
  if (on_written) on_written(p, bytes);
}

void EngineChannel::post(int from, std::uint64_t tag, std::span<std::byte> dest) {
  if (dest.size() < kPlaceMinBytes) return;  // never placed
  const auto key = std::make_tuple(seq_, tag, from);
  std::weak_ptr<Executor> wex = comm_->exec;
  // Released by the transport once it writes no more into `dest` (or here,
  // unclaimed, by retract): the operation's fiber is woken to look. It keeps
  // the ranks' mappings too, should the operation not wait (it does).
  std::shared_ptr<void> token(static_cast<void*>(nullptr), [wex, keep = keep_](void*) {
    if (auto ex = wex.lock()) Executor::wake(ex);
  });
  EngineLock lock(I_.mu);
  Inbox& in = *comm_->inbox;
  if (in.msgs.count(key) != 0 || in.posted.count(key) != 0) return;  // here already
  tokens_.push_back(token);
  posted_.push_back(key);
  in.posted[key] = Inbox::Posted{dest.data(), dest.size(), std::move(token), false};
}

void EngineChannel::retract() {
  if (posted_.empty()) return;
  std::vector<std::shared_ptr<void>> unclaimed;  // released outside the lock
  {
    EngineLock lock(I_.mu);
    Inbox& in = *comm_->inbox;
    for (const auto& key : posted_) {
      const auto it = in.posted.find(key);
      if (it == in.posted.end()) continue;
      if (it->second.token) unclaimed.push_back(std::move(it->second.token));
      in.posted.erase(it);
    }
  }
  posted_.clear();
  unclaimed.clear();
  const auto until = Clock::now() + budget_;
  for (;;) {
    const auto busy = std::count_if(tokens_.begin(), tokens_.end(),
                                    [](const std::weak_ptr<void>& t) { return !t.expired(); });
    if (busy == 0) break;
    if (Clock::now() >= until) {
      I_.log.error("placed_receive_stuck",
                   {{"comm", comm_->name},
                    {"seq", seq_},
                    {"receives", busy},
                    {"reason", "the connection still writes into the operation's buffers "
                               "after it ended"}});
      break;
    }
    Executor::wait(*comm_->exec);
  }
  tokens_.clear();
}

void EngineChannel::check_stopping() {
  EngineLock lock(I_.mu);
  if (I_.stopping) {
    throw Error(Code::aborted, "collectived on node " + I_.options.node_name + " is stopping");
  }
}

void EngineChannel::check_ended_locked(Locked, int rank) {
  const Inbox& in = *comm_->inbox;
  if (auto f = in.failed.find(seq_); f != in.failed.end()) {
    remote_failure = true;
    throw Error(f->second.code, f->second.message);
  }
  if (in.broken && seq_ >= comm_->broken_floor) {
    remote_failure = true;
    throw Error(in.broken->code, in.broken->message);
  }
  if (in_pieces && in_pieces->failed.load(std::memory_order_acquire)) {
    auto [code, why] = in_pieces->error();
    throw Error(code, "copying " + input_of(rank) + " to host memory: " + why);
  }
  if (I_.stopping) {
    throw Error(Code::aborted, "collectived on node " + I_.options.node_name + " is stopping");
  }
}

std::string EngineChannel::input_of(int rank) const {
  if (rank < 0) return "the inputs of the ranks on node " + I_.options.node_name;
  return "the input of " + comm_->who(rank) + " on node " + I_.options.node_name;
}

void EngineChannel::wait_pieces(std::uint32_t need, int rank) {
  const auto since = Clock::now();
  for (;;) {
    // The clients' ready words, read here (InPieces::poll): the completion
    // thread sees them too, but wakes this fiber only once it has answered
    // what else it found done.
    in_pieces->poll();
    if (in_pieces->reached.load(std::memory_order_acquire) >= need) return;
    const auto now = Clock::now();
    if (now >= deadline_) {
      throw Error(Code::timeout, "timed out after " + deadline_text_ + " waiting for " +
                                     input_of(rank) + " to reach host memory");
    }
    if (!in_pieces->marks.empty() && now - since < input_poll_) {
      // A stream's hand-off takes tens of microseconds: read the words
      // again after the event loop's other handlers (as long as the event
      // loop polls, workers.event_loop_spin_us, before sleeping).
      // The engine's mutex is left alone while polling: a failure (of a
      // rank, a peer, the input's copy) is found at the latest when the
      // poll ends, at most input_poll_ later.
      Executor::yield(comm_->exec);
      continue;
    }
    {
      EngineLock lock(I_.mu);
      check_ended_locked(lock.token(), rank);
    }
    // Until the completion thread sees the next piece in (InPieces::on_change).
    Executor::wait(*comm_->exec);
  }
}

}  // namespace collectived::engine

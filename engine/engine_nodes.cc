// Communicators whose ranks live on several nodes: the rendezvous across
// daemons, the messages between engines (ipc/node.capnp), the executor that
// runs each such communicator's collectives, point-to-point between nodes,
// and what happens when a node goes away.
//
// Bootstrap. A unique id names the rendezvous daemon. comm_init on another
// daemon forwards the join there (`join`); once every rank is in, the
// rendezvous daemon sends every node with ranks the rank map (`joinReply`),
// and each node creates its side of the communicator: local members with
// queues, remote members by rank. Nodes are numbered by their lowest rank, the
// same everywhere.
//
// Operations. Local ranks meet as on one node (sequence numbers, queues);
// when all of this node's ranks are in, the operation runs on the
// communicator's executor thread: engine/node_algorithms.h, whose messages
// are `data` keyed by (seq, tag, sender node) and carry the sender's view of
// the operation, so that a mismatch is named on every node. A failure is
// told to the other nodes (`slotFailed` for one operation, `broken` for the
// communicator).
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <array>
#include <cstring>
#include <thread>

#include <pthread.h>

#include "engine/engine_impl.h"
#include "ipc/node.capnp.h"

namespace collectived::engine {

namespace {

constexpr std::size_t kPrefix = 8;  // [u32 header words][u32 0]

/// A message: [u32 header words][u32 0][header][raw bytes]. The raw bytes
/// are `raw`, read in place by the transport (zero copy); `keep` owns them if
/// they may outlive the sender.
/// `find_region` names the client mapping a raw piece lies in, if any
/// (OutMessage::regions).
OutMessage encode(capnp::MessageBuilder& mb, std::span<const std::span<const std::byte>> raw = {},
                  std::shared_ptr<const void> keep = nullptr,
                  const std::function<HostRegion*(std::span<const std::byte>)>& find_region = {}) {
  const auto words = capnp::messageToFlatArray(mb);
  const auto header = words.asBytes();
  OutMessage out;
  out.head.reserve(kPrefix + header.size());
  const auto nwords = static_cast<std::uint32_t>(words.size());
  const std::array<std::uint32_t, 2> prefix{nwords, 0};
  const auto* pb = reinterpret_cast<const std::byte*>(prefix.data());
  out.head.insert(out.head.end(), pb, pb + kPrefix);
  const auto* hb = reinterpret_cast<const std::byte*>(header.begin());
  out.head.insert(out.head.end(), hb, hb + header.size());
  bool any_region = false;
  for (const auto& p : raw) {
    if (p.empty()) continue;
    out.payload.push_back(p);
    out.regions.push_back(find_region ? find_region(p) : nullptr);
    any_region = any_region || out.regions.back() != nullptr;
  }
  if (!any_region) out.regions.clear();
  out.keep = std::move(keep);
  return out;
}

/// A received message: its header, and where its raw bytes start.
struct Decoded {
  MessageBytes bytes;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader;
  nodewire::NodeMessage::Reader msg;
  std::size_t raw_offset = 0;
};

std::unique_ptr<Decoded> decode(MessageBytes bytes) {
  if (bytes.size() < kPrefix) throw Error(Code::protocol, "message shorter than its prefix");
  std::uint32_t nwords = 0;
  std::memcpy(&nwords, bytes.data(), 4);
  if (nwords == 0 || kPrefix + std::uint64_t{nwords} * 8 > bytes.size()) {
    throw Error(Code::protocol, "header of " + std::to_string(nwords) +
                                    " words does not fit a message of " +
                                    std::to_string(bytes.size()) + " bytes");
  }
  auto d = std::make_unique<Decoded>();
  d->bytes = std::move(bytes);
  // MessageBytes is aligned for any scalar type, so the words are too.
  kj::ArrayPtr<const capnp::word> words(reinterpret_cast<const capnp::word*>(d->bytes.data() + kPrefix),
                                        nwords);
  capnp::ReaderOptions limits;
  limits.traversalLimitInWords = 1u << 24;
  limits.nestingLimit = 16;
  d->reader = std::make_unique<capnp::FlatArrayMessageReader>(words, limits);
  d->msg = d->reader->getRoot<nodewire::NodeMessage>();
  d->raw_offset = kPrefix + std::size_t{nwords} * 8;
  return d;
}

std::string to_hex(const std::string& bytes) { return hex_prefix(bytes, bytes.size()); }

std::string text(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }
std::string data(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}

Desc desc_of(nodewire::OpData::Reader d) {
  Desc desc;
  desc.kind = static_cast<OpKind>(d.getKind());
  desc.dtype = static_cast<DType>(d.getDtype());
  desc.redop = static_cast<RedOp>(d.getRedop());
  desc.count = d.getCount();
  desc.root = d.getRoot();
  return desc;
}

/// A node's plan for an operation against another node's (NodePlan).
std::string plan_mismatch(const Comm& comm, std::uint64_t seq, const Desc& desc,
                          const NodePlan& mine, int node, const NodePlan& theirs) {
  return "mismatched plans for sequence number " + std::to_string(seq) + ", " + desc.str() +
         ": node " + comm.node_text(comm.my_node) + " runs it as " + mine.str() + ", node " +
         comm.node_text(node) + " as " + theirs.str() +
         "; the daemons' profiles disagree (collectives.algorithm, collectives.direct_max_bytes, "
         "collectives.pairwise_max_nodes and tcp.chunk_bytes must be the same on every node)";
}

std::string ranks_text(const Comm& comm, int node) {
  std::vector<int> ranks;
  for (int r = 0; r < comm.nranks; ++r) {
    if (comm.node_of_rank[r] == node) ranks.push_back(r);
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

/// One operation's NodeChannel over the engine's transport and inbox.
class EngineChannel final : public NodeChannel {
 public:
  EngineChannel(Engine::Impl& impl, std::shared_ptr<Comm> comm, std::uint64_t seq, Desc desc,
                NodePlan plan, std::chrono::microseconds input_poll, int desc_rank,
                Clock::time_point deadline, std::string deadline_text,
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

  int node() const override { return comm_->my_node; }
  int nodes() const override { return static_cast<int>(comm_->node_address.size()); }

  /// Completion of this operation's sends; shared with their callbacks, which
  /// may run after the channel is gone (a failed operation does not wait).
  struct Sends {
    std::mutex mu;
    std::weak_ptr<Executor> exec;  // woken when a send is done
    int outstanding = 0;
    std::map<int, int> by_node;  // node -> sends not yet done
    Code code = Code::ok;
    std::string why;
  };
  /// What every send of the operation keeps alive: the ranks' registrations
  /// (their mappings), the scratch buffer, and the sender's own `owner`.
  struct Keep {
    std::shared_ptr<const void> op, scratch, owner;
  };

  /// Memory that the operation's sends read from and that must outlive them:
  /// the ranks' buffers. Pieces sent from them name their client mapping
  /// (OutMessage::regions), so a transport may read them in place.
  void keep_alive(std::shared_ptr<const std::vector<Span>> spans) {
    regions_.clear();
    for (const Span& sp : *spans) {
      if (!sp.reg || sp.reg->device) continue;
      if (HostRegion* r = sp.reg->mapping.region()) regions_.push_back(r);
    }
    keep_ = std::move(spans);
  }

  void send(int to, std::uint64_t tag, std::span<const std::span<const std::byte>> pieces,
            std::shared_ptr<const void> owner) override {
    capnp::MallocMessageBuilder mb(128);
    auto m = mb.initRoot<nodewire::NodeMessage>();
    m.setFrom(I_.options.rendezvous_address);
    auto d = m.initData();
    d.setUid(comm_->uid);
    d.setSeq(seq_);
    d.setTag(tag);
    d.setFromNode(static_cast<std::uint32_t>(comm_->my_node));
    d.setKind(static_cast<std::uint8_t>(desc_.kind));
    d.setDtype(static_cast<std::uint8_t>(desc_.dtype));
    d.setRedop(static_cast<std::uint8_t>(desc_.redop));
    d.setCount(desc_.count);
    d.setRoot(desc_.root);
    d.setDescRank(static_cast<std::uint32_t>(desc_rank_));
    d.setPlanAlgorithm(static_cast<std::uint8_t>(plan_.algorithm));
    d.setPlanChunk(plan_.chunk);
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
    I_.send_node(comm_->node_address[to], encode(mb, pieces, std::move(keep), find_region),
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

  void flush() override {
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

  std::byte* scratch(std::size_t bytes) override {
    // The executor's buffer, reused by the communicator's operations (they run
    // one at a time on its thread): fresh pages cost a fault each.
    auto& s = comm_->exec->scratch;
    if (!s || s->size() < bytes) s = std::make_shared<MessageBytes>(std::max<std::size_t>(bytes, 64));
    scratch_ = s;
    return s->data();
  }

  void compute(const std::function<void()>& work) override {
    // On the worker pool; this fiber yields the event loop meanwhile. The
    // fiber waits for the task whatever happens (`work` lives on its stack).
    compute_wait(compute_async([&work] { work(); }));
  }

  int parallelism() const override {
    // Cores to spare: the pool has threads beyond the two that the event loop
    // and the transport's copies keep busy (the same rule as tcp.io_threads).
    const std::size_t threads = I_.pool.size();
    return threads >= 4 ? static_cast<int>(std::min<std::size_t>(threads - 2, 8)) : 1;
  }

  struct AsyncWork {
    std::atomic<bool> done{false};
    std::exception_ptr error;
  };

  Ticket compute_async(std::function<void()> work) override {
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

  bool compute_done(const Ticket& ticket) override {
    return !ticket || static_cast<const AsyncWork*>(ticket.get())->done.load(std::memory_order_acquire);
  }

  void compute_wait(const Ticket& ticket) override {
    if (!ticket) return;
    const auto* st = static_cast<const AsyncWork*>(ticket.get());
    // Whatever happens meanwhile (the work holds the ranks' buffers): no
    // deadline here, a pass over one chunk takes microseconds to milliseconds.
    while (!st->done.load(std::memory_order_acquire)) Executor::wait(*comm_->exec);
    if (st->error) std::rethrow_exception(st->error);
  }

  void start_sends() override {
    if (sent_) {
      sent_ = false;
      Executor::yield(comm_->exec);
    }
  }

  NodePayload recv(int from, std::uint64_t tag) override {
    // The daemon's transport takes a send on its event loop, the thread this
    // operation's fiber runs on, once the fiber gives the thread back: until
    // then what was sent has not left. An algorithm that goes on to reduce
    // chunks already here (no wait in recv) would hold its sends back for as
    // long (the pairwise all-reduce's reduced chunks, which the other nodes
    // wait for). So the first receive after a send lets them go.
    start_sends();
    Executor::take_turns(comm_->exec);
    std::unique_lock lock(I_.mu);
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
          throw Error(Code::mismatch, "mismatched operations for sequence number " +
                                          std::to_string(seq_) + ": " +
                                          comm_->who(desc_rank_) + " submitted " + desc_.str() +
                                          " but " + comm_->who(it->second.desc_rank) +
                                          " submitted " + it->second.desc.str());
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
      check_ended_locked(-1);
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

  /// Where a local rank's host staging (input or output) of a staged GPU
  /// operation lies.
  struct Staging {
    const std::byte* base;
    std::uint64_t bytes;
    int rank;
  };
  /// A staged GPU operation's inputs, arriving in pieces (GpuStage::in), and
  /// where they lie. Null: all there.
  std::shared_ptr<gpu::InPieces> in_pieces;
  std::vector<Staging> inputs;
  void reading(const std::byte* p, std::uint64_t bytes) override {
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

  /// Returns once every piece is in: the ranks' streams reached the
  /// operation and their inputs are in host memory. The algorithms read all
  /// of every input, so that this returns at once after them, except on a
  /// broadcast's node without its root, whose one empty piece is only the
  /// streams' wait: its exchange may end first, and its outputs go back to
  /// the GPUs only after that (stage_out). Nothing to wait for without pieces.
  void await_inputs() {
    if (in_pieces) wait_pieces(in_pieces->count, -1);
  }

  /// Where chunks of the local ranks' outputs told final go (a staged GPU
  /// operation copies them back to the GPU early); unset: nowhere.
  std::function<void(const std::byte*, std::uint64_t)> on_written;
  void written(const std::byte* p, std::uint64_t bytes) override {
    if (on_written) on_written(p, bytes);
  }

  void post(int from, std::uint64_t tag, std::span<std::byte> dest) override {
    if (dest.size() < kPlaceMinBytes) return;  // never placed
    const auto key = std::make_tuple(seq_, tag, from);
    std::weak_ptr<Executor> wex = comm_->exec;
    // Released by the transport once it writes no more into `dest` (or here,
    // unclaimed, by retract): the operation's fiber is woken to look. It keeps
    // the ranks' mappings too, should the operation not wait (it does).
    std::shared_ptr<void> token(static_cast<void*>(nullptr), [wex, keep = keep_](void*) {
      if (auto ex = wex.lock()) Executor::wake(ex);
    });
    std::lock_guard lock(I_.mu);
    Inbox& in = *comm_->inbox;
    if (in.msgs.count(key) != 0 || in.posted.count(key) != 0) return;  // here already
    tokens_.push_back(token);
    posted_.push_back(key);
    in.posted[key] = Inbox::Posted{dest.data(), dest.size(), std::move(token), false};
  }

  /// At the end of the operation, whatever its outcome: withdraws the
  /// buffers it posted, and waits until the transport writes into none of
  /// them (a placed message still arriving when the operation failed). The
  /// reads end when their bytes are in or their connection closes (peer
  /// heartbeats bound that); past the operation budget again it gives up and
  /// logs it.
  void retract() {
    if (posted_.empty()) return;
    std::vector<std::shared_ptr<void>> unclaimed;  // released outside the lock
    {
      std::lock_guard lock(I_.mu);
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

  /// The failure came from another node (it was told there already).
  bool remote_failure = false;

 private:
  void check_stopping() {
    std::lock_guard lock(I_.mu);
    if (I_.stopping) {
      throw Error(Code::aborted, "collectived on node " + I_.options.node_name + " is stopping");
    }
  }

  /// What ends this operation whatever it waits for (a message, an input
  /// piece): another node failed it, the communicator broke (a node died),
  /// this node's input copies failed (naming `rank`'s input; -1: unknown),
  /// the daemon is stopping. Under I_.mu.
  void check_ended_locked(int rank) {
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
  std::string input_of(int rank) const {
    if (rank < 0) return "the inputs of the ranks on node " + I_.options.node_name;
    return "the input of " + comm_->who(rank) + " on node " + I_.options.node_name;
  }
  /// Until the first `need` pieces in copy order are in (InPieces), within
  /// the deadline; `rank`: whose input, for the errors (-1: this node's).
  void wait_pieces(std::uint32_t need, int rank) {
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
        std::lock_guard lock(I_.mu);
        check_ended_locked(rank);
      }
      // Until the completion thread sees the next piece in (InPieces::on_change).
      Executor::wait(*comm_->exec);
    }
  }

 private:
  Engine::Impl& I_;
  std::shared_ptr<Comm> comm_;
  std::uint64_t seq_;
  Desc desc_;
  NodePlan plan_;
  std::chrono::microseconds input_poll_;  // NodeAlgorithmOptions::input_poll
  int desc_rank_;
  Clock::time_point deadline_;
  std::string deadline_text_;  // how errors name deadline_ (Impl::deadline_text)
  std::chrono::milliseconds budget_;  // the node's: bounds retract()
  std::shared_ptr<Sends> sends_ = std::make_shared<Sends>();
  std::shared_ptr<const void> keep_;
  std::vector<HostRegion*> regions_;  // of the memory keep_ holds
  bool sent_ = false;  // a send since the fiber last gave the thread back (recv)
  std::shared_ptr<const MessageBytes> scratch_;
  // Receives posted (post): their inbox keys, and the transport's holds.
  std::vector<std::tuple<std::uint64_t, std::uint64_t, int>> posted_;
  std::vector<std::weak_ptr<void>> tokens_;
};

}  // namespace

// ---- lifetime ------------------------------------------------------------------------

Engine::Impl::~Impl() {
  std::vector<std::shared_ptr<Executor>> execs;
  {
    std::lock_guard lock(mu);
    stopping = true;
    for (const auto& w : executors) {
      if (auto ex = w.lock()) execs.push_back(ex);
    }
  }
  // The own node thread (tests) may be inside a fiber: let it finish what it
  // runs and stop. The daemon's event loop has returned by now.
  runner->shut();
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

void NodeRunner::run(std::function<void()> f) {
  if (post) {
    post(std::move(f));
    return;
  }
  std::lock_guard l(mu);
  if (stop) return;
  if (!thread.joinable()) {
    thread = std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "cd-node");
      std::unique_lock lk(mu);
      while (!stop) {
        if (queue.empty()) {
          if (!cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return stop || !queue.empty(); })) {
            lk.unlock();
            if (idle) idle();
            lk.lock();
          }
          continue;
        }
        auto job = std::move(queue.front());
        queue.pop_front();
        lk.unlock();
        job();
        lk.lock();
      }
    });
  }
  queue.push_back(std::move(f));
  cv.notify_one();
}

void NodeRunner::shut() {
  std::thread t;
  {
    std::lock_guard l(mu);
    stop = true;
    t = std::move(thread);
    queue.clear();
  }
  cv.notify_all();
  if (t.joinable()) t.join();
}

void Executor::wake(const std::shared_ptr<Executor>& ex) {
  if (ex->wake_posted.exchange(true)) return;
  ex->runner->run([ex] { drive(ex); });
}

void Executor::wait(Executor& ex) {
  Fiber* f = Fiber::current();
  if (f == nullptr) throw Error(Code::internal, "an operation between nodes waited outside its fiber");
  ex.waiting = true;
  f->yield();
  ex.waiting = false;
}

void Executor::drive(const std::shared_ptr<Executor>& ex) {
  ex->wake_posted.store(false);
  if (ex->fiber && !ex->waiting) return;  // it is running, further up this thread's stack
  if (!ex->fiber) {
    {
      std::lock_guard l(ex->mu);
      if (ex->jobs.empty()) return;
    }
    // The executor owns the fiber, which only runs while the executor lives.
    ex->fiber = std::make_unique<Fiber>([raw = ex.get()] {
      for (;;) {
        std::function<void()> job;
        {
          std::lock_guard l(raw->mu);
          if (raw->jobs.empty()) return;
          job = std::move(raw->jobs.front());
          raw->jobs.pop_front();
        }
        job();
      }
    }, std::move(ex->spare_stack));
  }
  ex->waiting = false;
  ex->resumed_at = Clock::now();
  bool finished = true;
  try {
    finished = ex->fiber->resume();
  } catch (const std::exception& e) {
    // run_across_nodes answers every error itself; this would be a bug. No
    // logger here (the executor outlives nothing it could borrow one from):
    // the daemon's log format on stderr.
    std::fprintf(stderr, "level=error event=node_job_threw comm=%s error=\"%s\"\n",
                 ex->comm.c_str(), e.what());
  }
  if (finished) {
    ex->spare_stack = ex->fiber->take_stack();
    ex->fiber.reset();
  }
}

void Executor::take_turns(const std::shared_ptr<Executor>& ex) {
  // 5 ms: long enough that a large operation's chunks go by in batches, short
  // enough for heartbeats (deadlines.heartbeat_ms) and small operations.
  if (Clock::now() - ex->resumed_at < std::chrono::milliseconds(5)) return;
  yield(ex);
}

void Executor::yield(const std::shared_ptr<Executor>& ex) {
  wake(ex);
  wait(*ex);
}

void Engine::Impl::wake_executors() {
  // Every executor, also those of communicators already released whose last
  // operation still runs (it waits for its deadline).
  std::erase_if(executors, [](const std::weak_ptr<Executor>& w) {
    auto ex = w.lock();
    if (ex) Executor::wake(ex);
    return !ex;
  });
}

void Engine::Impl::attach_nodes(const std::shared_ptr<Comm>& cp) {
  Comm& comm = *cp;
  auto& ref = inboxes[comm.uid];
  if (!ref.first) ref.first = std::make_shared<Inbox>();
  ref.first->claimed = true;
  ref.second = cp;
  comm.inbox = ref.first;
  if (comm.inbox->broken) comm.broken = comm.inbox->broken;
  comm.exec = std::make_shared<Executor>();
  comm.exec->runner = runner;
  comm.exec->comm = comm.name;
  comm.inbox->exec = comm.exec;
  executors.push_back(comm.exec);
}

void Engine::Impl::release_nodes(Comm& comm) {
  if (!comm.spans_nodes()) return;
  auto it = inboxes.find(comm.uid);
  if (it != inboxes.end() && it->second.first == comm.inbox) inboxes.erase(it);
  comm.inbox->msgs.clear();
  comm.inbox->p2p.clear();
  comm.inbox->bytes = 0;
}

void Engine::Impl::purge_inbox(Comm& comm, std::uint64_t seq) {
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
  NodeTransport* t = transport.load();
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
    locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
      handle_node_down(address, "", why, out, tasks);
    });
  });
}

void Engine::Impl::send_broken(Comm& comm, Code code, const std::string& reason,
                               std::uint64_t floor) {
  for (int j = 0; j < static_cast<int>(comm.node_address.size()); ++j) {
    if (j == comm.my_node) continue;
    capnp::MallocMessageBuilder mb(256);
    auto m = mb.initRoot<nodewire::NodeMessage>();
    m.setFrom(options.rendezvous_address);
    auto b = m.initBroken();
    b.setUid(comm.uid);
    b.setCode(static_cast<std::uint16_t>(code));
    b.setMessage(reason);
    b.setFloor(floor);
    send_node(comm.node_address[j], encode(mb));
  }
}

void Engine::Impl::send_slot_failed(Comm& comm, std::uint64_t seq, Code code,
                                    const std::string& reason) {
  for (int j = 0; j < static_cast<int>(comm.node_address.size()); ++j) {
    if (j == comm.my_node) continue;
    capnp::MallocMessageBuilder mb(256);
    auto m = mb.initRoot<nodewire::NodeMessage>();
    m.setFrom(options.rendezvous_address);
    auto f = m.initSlotFailed();
    f.setUid(comm.uid);
    f.setSeq(seq);
    f.setCode(static_cast<std::uint16_t>(code));
    f.setMessage(reason);
    send_node(comm.node_address[j], encode(mb));
  }
}

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

void send_join_reply(Engine::Impl& I, const std::string& to, const std::string& key, int rank,
                     Code code, const std::string& why) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(I.options.rendezvous_address);
  auto r = m.initJoinReply();
  // The key is the 16 id bytes (which may contain '@'), '@', the address.
  const std::size_t at = 16;
  const std::string id = key.substr(0, at);
  r.setId(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(id.data()), id.size()));
  r.setRendezvous(key.substr(at + 1));
  r.setCode(static_cast<std::uint16_t>(code));
  r.setMessage(why);
  r.setRank(rank);
  I.send_node(to, encode(mb));
}
}  // namespace

// ---- rendezvous -----------------------------------------------------------------------

std::optional<std::pair<Code, std::string>> Engine::Impl::join_rendezvous(
    const std::string& key, std::uint32_t nranks, std::uint32_t rank, Joiner joiner,
    std::vector<Delivery>& out) {
  auto [it, fresh] = rendezvous.try_emplace(key);
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
    finish_rendezvous_across_nodes(key, rv, out);
    rendezvous.erase(it);
    return std::nullopt;
  }
  auto comm = std::make_shared<Comm>();
  comm->serial = ++comm_serial;
  comm->name = rv.name;
  comm->nranks = rv.nranks;
  comm->local_count = rv.nranks;
  for (int r = 0; r < rv.nranks; ++r) {
    Member m;
    m.rank = r;
    m.session = rv.joined[r]->client.session;
    m.pid = rv.joined[r]->client.pid;
    m.handle = next_handle++;
    handles[m.handle] = {comm, r};
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
  rendezvous.erase(it);
  return std::nullopt;
}

void Engine::Impl::finish_rendezvous_across_nodes(const std::string& key, Rendezvous& rv,
                                                  std::vector<Delivery>& out) {
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
    capnp::MallocMessageBuilder mb(1024);
    auto m = mb.initRoot<nodewire::NodeMessage>();
    m.setFrom(options.rendezvous_address);
    auto r = m.initJoinReply();
    r.setId(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(id.data()), id.size()));
    r.setRendezvous(options.rendezvous_address);
    r.setRank(-1);
    r.setUid(uid);
    r.setName(rv.name);
    auto nor = r.initNodeOfRank(rv.nranks);
    auto por = r.initPidOfRank(rv.nranks);
    for (int k = 0; k < rv.nranks; ++k) {
      nor.set(k, static_cast<std::uint32_t>(node_of_rank[k]));
      por.set(k, pids[k]);
    }
    auto na = r.initNodeAddresses(static_cast<unsigned>(addresses.size()));
    auto nn = r.initNodeNames(static_cast<unsigned>(names.size()));
    for (std::size_t k = 0; k < addresses.size(); ++k) {
      na.set(static_cast<unsigned>(k), addresses[k]);
      nn.set(static_cast<unsigned>(k), names[k]);
    }
    send_node(addresses[n], encode(mb));
  }
  if (!local.empty()) {
    make_spanning_comm(uid, rv.name, node_of_rank, pids, addresses, names, local, out);
  }
  log.info("rendezvous_done", {{"comm", rv.name},
                               {"nranks", rv.nranks},
                               {"nodes", addresses.size()},
                               {"rendezvous_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     Clock::now() - rv.started)
                                                     .count()}});
}

std::shared_ptr<Comm> Engine::Impl::make_spanning_comm(
    const std::string& uid, const std::string& name, const std::vector<int>& node_of_rank,
    const std::vector<pid_t>& pids, const std::vector<std::string>& addresses,
    const std::vector<std::string>& names, const std::map<int, Joiner>& local,
    std::vector<Delivery>& out) {
  auto comm = std::make_shared<Comm>();
  comm->serial = ++comm_serial;
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
      m.handle = next_handle++;
      handles[m.handle] = {comm, r};
      ++comm->local_count;
    } else {
      m.remote = true;
    }
    comm->members.push_back(std::move(m));
  }
  attach_nodes(comm);
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

void Engine::Impl::fail_rendezvous(const std::string& key, Rendezvous& rv, Code code,
                                   const std::string& why, int except_rank,
                                   std::vector<Delivery>& out) {
  for (int r = 0; r < rv.nranks; ++r) {
    if (!rv.joined[r] || r == except_rank) continue;
    const std::string msg = "comm_init_rank (communicator " + rv.name + ", rank " +
                            std::to_string(r) + " of " + std::to_string(rv.nranks) + "): " + why;
    if (rv.joined[r]->address.empty()) {
      out.push_back({rv.joined[r]->client.sink, rv.joined[r]->request, error(code, msg)});
    } else {
      send_join_reply(*this, rv.joined[r]->address, key, r, code, msg);
    }
  }
}

void Engine::Impl::fail_pending_joins(const std::string& key, int rank, Code code,
                                      const std::string& why, std::vector<Delivery>& out) {
  auto [b, e] = pending_joins.equal_range(key);
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
    it = pending_joins.erase(it);
  }
}

// ---- operations --------------------------------------------------------------------------

bool Engine::Impl::check_remote_desc(Comm& comm, std::uint64_t seq, std::vector<Delivery>& out) {
  auto sit = comm.slots.find(seq);
  if (sit == comm.slots.end() || !sit->second.has_desc || sit->second.failed) return true;
  Slot& slot = sit->second;
  for (auto it = comm.inbox->msgs.lower_bound({seq, 0, 0});
       it != comm.inbox->msgs.end() && std::get<0>(it->first) == seq; ++it) {
    const NodeIn& in = it->second;
    std::string why;
    if (!(in.desc == slot.desc)) {
      why = "mismatched operations for sequence number " + std::to_string(seq) + ": " +
            comm.who(slot.desc_rank) + " submitted " + slot.desc.str() + " but " +
            comm.who(in.desc_rank) + " submitted " + in.desc.str();
    } else if (in.plan.known() && slot.plan.known() && !(in.plan == slot.plan)) {
      why = plan_mismatch(comm, seq, slot.desc, slot.plan, std::get<2>(it->first), in.plan);
    } else {
      continue;
    }
    send_slot_failed(comm, seq, Code::mismatch, why);
    comm.inbox->failed[seq] = error(Code::mismatch, why, seq);
    notify(*comm.inbox);
    if (!slot.started) {
      fail_slot(comm, slot, Code::mismatch, why, out);
      if (slot.arrived >= comm.local_count) end_slot(comm, sit);
    }
    return false;
  }
  return true;
}

void Engine::Impl::start_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq) {
  {
    std::lock_guard l(cp->exec->mu);
    cp->exec->jobs.push_back([this, cp, seq] { run_across_nodes(cp, seq); });
  }
  Executor::wake(cp->exec);
}

void Engine::Impl::run_across_nodes(const std::shared_ptr<Comm>& cp, std::uint64_t seq) {
  Comm& comm = *cp;
  NodeCollective op;
  Desc desc;
  int desc_rank = 0;
  Clock::time_point deadline;
  std::string expiry;  // how errors name the deadline
  std::vector<Span> keep;  // holds the mappings while the operation runs
  std::vector<std::int32_t> mine;  // split: (rank, color, key) of local ranks
  std::shared_ptr<gpu::GpuStage> stage;  // a staged GPU operation's host staging
  std::shared_ptr<const NodeAlgorithmOptions> algorithms;  // as submitted (Slot::algorithms)
  NodePlan plan;
  // Staged: the local ranks' output and input staging.
  std::vector<EngineChannel::Staging> outs, ins;
  {
    std::lock_guard lock(mu);
    auto it = comm.slots.find(seq);
    if (it == comm.slots.end() || it->second.failed) return;
    Slot& slot = it->second;
    desc = slot.desc;
    desc_rank = slot.desc_rank;
    deadline = slot.deadline;
    expiry = deadline_text(slot.timeout, slot.timeout_rank);
    algorithms = slot.algorithms ? slot.algorithms : this->algorithms;
    plan = slot.plan;
    slot.across_started = Clock::now();
    op.kind = desc.kind;
    op.dtype = desc.dtype;
    op.redop = desc.redop;
    op.count = desc.count;
    op.root = desc.root;
    op.nranks = comm.nranks;
    op.node_of_rank = comm.node_of_rank;
    for (int r = 0; r < comm.nranks; ++r) {
      if (comm.members[r].remote) continue;
      const Part& p = slot.parts[r];
      op.local.push_back(LocalBuffers{r, p.send.ptr, p.send.bytes, p.recv.ptr, p.recv.bytes});
      if (p.gpu_sync && p.gpu_sync->own_segment_on_gpu) op.own_contribution_elsewhere = true;
      keep.push_back(p.send);
      keep.push_back(p.recv);
      mine.insert(mine.end(), {r, p.color, p.key});
      if (slot.gpu_stage && p.recv.ptr != nullptr) outs.push_back({p.recv.ptr, p.recv.bytes, r});
      if (slot.gpu_stage && p.send.ptr != nullptr) ins.push_back({p.send.ptr, p.send.bytes, r});
    }
    stage = slot.gpu_stage;
  }
  EngineChannel ch(*this, cp, seq, desc, plan, algorithms->input_poll, desc_rank, deadline,
                   std::move(expiry), options.operation_deadline);
  // Sends read the ranks' buffers in place; should the operation fail before
  // they are done, their mappings stay until then.
  ch.keep_alive(std::make_shared<const std::vector<Span>>(keep));
  if (stage && stage->in) {
    // The inputs are still arriving, piece by piece: the algorithm waits for
    // each before it reads it (NodeChannel::reading), woken from the GPU
    // executor's completion thread.
    ch.in_pieces = stage->in;
    ch.inputs = std::move(ins);
    stage->in->on_change([weak = std::weak_ptr<Executor>(cp->exec)] {
      if (auto ex = weak.lock()) Executor::wake(ex);
    });
  }
  if (stage && gpu != nullptr) {
    // Each chunk of an output that is final goes back to its GPU now, while
    // the rest of the exchange runs (docs/gpu.md, "Across nodes").
    ch.on_written = [this, stage, outs = std::move(outs)](const std::byte* p, std::uint64_t n) {
      for (const EngineChannel::Staging& o : outs) {
        if (p >= o.base && p + n <= o.base + o.bytes) {
          gpu->stage_out_early(*stage, o.rank, static_cast<std::uint64_t>(p - o.base), n);
          return;
        }
      }
    };
  }
  Code code = Code::ok;
  std::string why;
  std::vector<std::pair<int, int>> color_key;
  try {
    if (desc.kind == OpKind::split) {
      const auto all = node_exchange(
          ch, std::as_bytes(std::span<const std::int32_t>(mine)), std::uint64_t{1} << 56);
      color_key.resize(comm.nranks, {-1, 0});
      for (const auto& bytes : all) {
        std::vector<std::int32_t> v(bytes.size() / 4);
        std::memcpy(v.data(), bytes.data(), v.size() * 4);
        for (std::size_t k = 0; k + 2 < v.size(); k += 3) {
          if (v[k] < 0 || v[k] >= comm.nranks) throw Error(Code::protocol, "bad split entry");
          color_key[v[k]] = {v[k + 1], v[k + 2]};
        }
      }
    } else {
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
                                     {"algorithm", plan.name()},
                                     {"chunk_bytes", plan.chunk}});
      }
      run_node_collective(ch, op, *algorithms, 0);
      ch.await_inputs();
    }
  } catch (const Error& e) {
    code = e.code();
    why = e.what();
  } catch (const std::exception& e) {
    code = Code::internal;
    why = e.what();
  }
  ch.retract();  // no receive writes into the ranks' buffers past this point
  if (stage && stage->in) {
    stage->in->on_change(nullptr);
    // The copies back (stage_out) may write where the inputs are read from
    // (in place): every piece must be in. The algorithms read all of every
    // input, so they waited for every piece; this holds them to it.
    if (code == Code::ok && stage->in->reached.load(std::memory_order_acquire) < stage->in->count) {
      code = Code::internal;
      why = "the operation between nodes ended before all of its inputs were in host memory (" +
            std::to_string(stage->in->reached.load()) + " of " + std::to_string(stage->in->count) +
            " pieces)";
    }
  }
  keep.clear();
  std::vector<Delivery> out;
  std::vector<std::function<void()>> next;
  {
    std::lock_guard lock(mu);
    auto it = comm.slots.find(seq);
    if (it != comm.slots.end() && !it->second.failed) {
      Slot& slot = it->second;
      if (code == Code::ok && desc.kind == OpKind::split) {
        std::map<int, CommInfo> info;
        make_split_children(cp, seq, color_key, info);
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
      if (code == Code::ok) {
        complete_slot(comm, seq, out);
      } else {
        if (!ch.remote_failure) send_slot_failed(comm, seq, code, why);
        log.warn("operation_failed", {{"comm", comm.name},
                                      {"seq", seq},
                                      {"op", to_string(desc.kind)},
                                      {"reason", why}});
        fail_slot(comm, slot, code, why, out);
        end_slot(comm, it);
      }
    }
    progress(cp, out, next);
  }
  pool.submit_all(std::move(next));
  deliver(out);
}

void Engine::Impl::make_split_children(const std::shared_ptr<Comm>& cp, std::uint64_t seq,
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
    child->serial = ++comm_serial;
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
        m.handle = next_handle++;
        handles[m.handle] = {child, i};
        ++child->local_count;
        info[ranks[i]] = CommInfo{m.handle, static_cast<std::uint32_t>(i),
                                  static_cast<std::uint32_t>(child->nranks), child->name};
        set_layout(info[ranks[i]], *child);
      }
      child->members.push_back(std::move(m));
    }
    if (child->spans_nodes()) attach_nodes(child);
    log.info("comm_created", {{"comm", child->name},
                              {"nranks", child->nranks},
                              {"parent", parent.name},
                              {"color", color},
                              {"nodes", std::max<std::size_t>(1, child->node_address.size())}});
  }
}

void Engine::Impl::start_remote_item(const std::shared_ptr<Comm>& cp,
                                     const std::shared_ptr<Group>& g, P2PItem& item,
                                     std::vector<Delivery>& out,
                                     std::vector<std::function<void()>>& tasks) {
  Comm& comm = *cp;
  log.debug("p2p_remote", {{"comm", comm.name}, {"rank", g->rank}, {"peer", item.peer},
                           {"send", item.is_send}, {"index", item.index}});
  if (item.is_send) {
    item.started = true;
    const std::string address = comm.node_address[comm.node_of_rank[item.peer]];
    const std::string node = comm.node_text(comm.node_of_rank[item.peer]);
    tasks.push_back([this, cp, g, address, node, span = item.span, peer = item.peer,
                     index = item.index, count = item.count, dtype = item.dtype] {
      capnp::MallocMessageBuilder mb(128);
      auto m = mb.initRoot<nodewire::NodeMessage>();
      m.setFrom(options.rendezvous_address);
      auto d = m.initData();
      d.setUid(cp->uid);
      d.setP2p(true);
      d.setFromRank(static_cast<std::uint32_t>(g->rank));
      d.setToRank(static_cast<std::uint32_t>(peer));
      d.setIndex(index);
      d.setCount(count);
      d.setDtype(static_cast<std::uint8_t>(dtype));
      d.setFromNode(static_cast<std::uint32_t>(cp->my_node));
      const std::span<const std::byte> piece(span.ptr, span.bytes);
      // Read in place; the registration keeps the mapping alive until sent.
      HostRegion* region = span.reg && !span.reg->device ? span.reg->mapping.region() : nullptr;
      auto bytes = encode(mb, std::span<const std::span<const std::byte>>(&piece, 1), span.reg,
                          [region](std::span<const std::byte>) { return region; });
      NodeTransport* t = transport.load();
      if (!t) return;
      // The send is done (eagerly) once the bytes are in the connection.
      t->send(address, std::move(bytes),
                      [this, cp, g, peer, node](Code code, const std::string& why) {
                        locked([&](std::vector<Delivery>& out2,
                                   std::vector<std::function<void()>>& tasks2) {
                          if (code != Code::ok) {
                            fail_group(*cp, *g, code,
                                       "send to rank " + std::to_string(peer) + " on node " +
                                           node + " failed: " + why,
                                       out2);
                          } else {
                            item_done(*cp, *g, out2);
                          }
                          progress(cp, out2, tasks2);
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
    fail_group(comm, *g, Code::mismatch,
               "mismatched send/recv: rank " + std::to_string(item.peer) + " sends " +
                   std::to_string(in->count) + " " + std::string(to_string(in->dtype)) +
                   " to rank " + std::to_string(g->rank) + " but rank " +
                   std::to_string(g->rank) + " receives " + std::to_string(item.count) + " " +
                   std::string(to_string(item.dtype)) + " from rank " + std::to_string(item.peer),
               out);
    return;
  }
  tasks.push_back([this, cp, g, span = item.span, in] {
    if (span.bytes != 0) std::memcpy(span.ptr, in->payload.data(), span.bytes);
    locked([&](std::vector<Delivery>& out2, std::vector<std::function<void()>>& tasks2) {
      item_done(*cp, *g, out2);
      progress(cp, out2, tasks2);
    });
  });
}

// ---- what arrives from other nodes -------------------------------------------------------

bool Engine::Impl::unreceived_over(std::uint64_t size) const {
  const std::uint64_t limit = options.max_unreceived_bytes;
  if (limit == 0) return false;
  std::uint64_t held = 0;
  for (const auto& [_, ref] : inboxes) held += ref.first ? ref.first->bytes : 0;
  return held + size > limit;
}

bool Engine::Impl::over_unreceived_limit(const std::string& uid, Inbox& in,
                                         const std::shared_ptr<Comm>& cp, std::uint64_t size,
                                         const std::string& what, const std::string& from,
                                         std::vector<Delivery>& out) {
  const std::uint64_t limit = options.max_unreceived_bytes;
  if (limit == 0) return false;
  std::uint64_t held = 0;
  for (const auto& [_, ref] : inboxes) held += ref.first ? ref.first->bytes : 0;
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
    break_comm(*cp, Code::resource_exhausted, why, out);
  } else {
    in.broken = error(Code::resource_exhausted, why);
  }
  return true;
}

void Engine::Impl::handle_node_message(const std::string& peer, MessageBytes bytes,
                                       std::vector<Delivery>& out,
                                       std::vector<std::function<void()>>& tasks) {
  auto d = decode(std::move(bytes));
  auto msg = d->msg;
  const std::string from = text(msg.getFrom());
  switch (msg.which()) {
    case nodewire::NodeMessage::JOIN: {
      auto j = msg.getJoin();
      const std::string id = data(j.getId());
      const std::string rv_addr = text(j.getRendezvous());
      const std::string key = id + "@" + rv_addr;
      const std::uint32_t nranks = j.getNranks(), rank = j.getRank();
      auto refuse = [&](Code code, const std::string& why) {
        send_join_reply(*this, from, key, static_cast<int>(rank), code,
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
      if (auto err = join_rendezvous(key, nranks, rank, std::move(joiner), out)) {
        refuse(err->first, err->second);
      }
      return;
    }
    case nodewire::NodeMessage::JOIN_REPLY: {
      auto r = msg.getJoinReply();
      const std::string key = data(r.getId()) + "@" + text(r.getRendezvous());
      if (r.getCode() != 0) {
        fail_pending_joins(key, r.getRank(), static_cast<Code>(r.getCode()), text(r.getMessage()),
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
      auto [b, e] = pending_joins.equal_range(key);
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
      pending_joins.erase(key);
      auto comm = make_spanning_comm(text(r.getUid()), text(r.getName()), node_of_rank, pids,
                                     addresses, names, local, out);
      if (!lost.empty()) {
        break_comm(*comm, Code::remote,
                   "rank " + rank_list(lost) + " on node " + options.node_name +
                       " disconnected while the communicator was being created",
                   out);
      }
      return;
    }
    case nodewire::NodeMessage::JOIN_CANCEL: {
      auto c = msg.getJoinCancel();
      const std::string key = data(c.getId()) + "@" + text(c.getRendezvous());
      auto it = rendezvous.find(key);
      if (it == rendezvous.end()) return;
      Rendezvous& rv = it->second;
      const auto rank = c.getRank();
      if (rank >= static_cast<std::uint32_t>(rv.nranks) || !rv.joined[rank] ||
          rv.joined[rank]->address != from) {
        return;
      }
      fail_rendezvous(key, rv, Code::remote,
                      "rank " + std::to_string(rank) + " (pid " +
                          std::to_string(rv.joined[rank]->pid) + " on node " +
                          rv.joined[rank]->node + ") " + text(c.getMessage()),
                      static_cast<int>(rank), out);
      rendezvous.erase(it);
      return;
    }
    case nodewire::NodeMessage::DATA: {
      auto dm = msg.getData();
      const std::string uid = text(dm.getUid());
      auto& ref = inboxes[uid];
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
      if (unreceived_over(item.payload.storage.size()) &&
          over_unreceived_limit(uid, in, cp, item.payload.storage.size(),
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
        if (cp) progress(cp, out, tasks);
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
      if (cp) check_remote_desc(*cp, seq, out);
      return;
    }
    case nodewire::NodeMessage::BROKEN: {
      auto b = msg.getBroken();
      auto it = inboxes.find(text(b.getUid()));
      if (it == inboxes.end()) return;
      const Code code = static_cast<Code>(b.getCode());
      const std::string why = text(b.getMessage());
      if (auto cp = it->second.second.lock()) {
        break_comm(*cp, code, why, out, false, b.getFloor());
        progress(cp, out, tasks);
      } else {
        it->second.first->broken = error(code, why);
      }
      return;
    }
    case nodewire::NodeMessage::SLOT_FAILED: {
      auto f = msg.getSlotFailed();
      auto it = inboxes.find(text(f.getUid()));
      if (it == inboxes.end()) return;
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
        fail_slot(comm, slot, code, why, out);
        if (slot.arrived >= comm.local_count) end_slot(comm, sit);
      }
      progress(cp, out, tasks);
      return;
    }
    default:
      throw Error(Code::protocol, "unknown message from " + peer);
  }
}

void Engine::Impl::handle_node_down(const std::string& address, const std::string& node,
                                    const std::string& why, std::vector<Delivery>& out,
                                    std::vector<std::function<void()>>& tasks) {
  const std::string who = "node " + (node.empty() ? address : node + " (" + address + ")");
  // Ranks here waiting for that node's rendezvous.
  std::set<std::string> keys;
  for (auto& [key, p] : pending_joins) {
    if (p.rendezvous == address) keys.insert(key);
  }
  for (const auto& key : keys) {
    fail_pending_joins(key, -1, Code::unavailable,
                       "the rendezvous daemon, " + who + ", went away: " + why, out);
  }
  // Rendezvous here with ranks from that node.
  for (auto it = rendezvous.begin(); it != rendezvous.end();) {
    Rendezvous& rv = it->second;
    const bool involved = std::any_of(rv.joined.begin(), rv.joined.end(), [&](const auto& j) {
      return j && j->address == address;
    });
    if (!involved) {
      ++it;
      continue;
    }
    fail_rendezvous(it->first, rv, Code::remote, "ranks on " + who + " went away: " + why, -1,
                    out);
    it = rendezvous.erase(it);
  }
  for (auto& cp : all_comms()) {
    if (!cp->spans_nodes()) continue;
    const auto n = std::find(cp->node_address.begin(), cp->node_address.end(), address);
    if (n == cp->node_address.end()) continue;
    const int idx = static_cast<int>(n - cp->node_address.begin());
    break_comm(*cp, Code::remote,
               "node " + cp->node_text(idx) + ", which hosts " + ranks_text(*cp, idx) +
                   ", is unreachable: " + why,
               out, false);
    progress(cp, out, tasks);
  }
}

void Engine::Impl::check_node_deadlines(Clock::time_point now, std::vector<Delivery>& out) {
  std::set<std::string> expired;
  for (auto& [key, p] : pending_joins) {
    if (now >= p.deadline) expired.insert(key);
  }
  for (const auto& key : expired) {
    auto it = pending_joins.find(key);
    fail_pending_joins(key, -1, Code::timeout,
                       "no answer from the rendezvous daemon " + it->second.rendezvous +
                           " within " +
                           std::to_string(options.rendezvous_deadline.count()) +
                           " ms (deadlines.rendezvous_ms): not every rank joined there, or it "
                           "cannot be reached",
                       out);
  }
  for (auto it = inboxes.begin(); it != inboxes.end();) {
    if (!it->second.first->claimed && now >= it->second.first->expires) {
      it = inboxes.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::Impl::node_client_gone(std::uint64_t session, std::vector<Delivery>& out) {
  for (auto it = pending_joins.begin(); it != pending_joins.end();) {
    if (it->second.client.session != session) {
      ++it;
      continue;
    }
    const PendingJoin& p = it->second;
    capnp::MallocMessageBuilder mb(256);
    auto m = mb.initRoot<nodewire::NodeMessage>();
    m.setFrom(options.rendezvous_address);
    auto c = m.initJoinCancel();
    c.setId(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(p.id.data()), p.id.size()));
    c.setRendezvous(p.rendezvous);
    c.setRank(p.rank);
    c.setMessage("disconnected before all ranks joined");
    send_node(p.rendezvous, encode(mb));
    it = pending_joins.erase(it);
  }
  (void)out;
}

void Engine::Impl::node_shutdown(const std::string& reason, std::vector<Delivery>& out) {
  std::set<std::string> keys;
  for (auto& [key, p] : pending_joins) keys.insert(key);
  for (const auto& key : keys) fail_pending_joins(key, -1, Code::aborted, reason, out);
  wake_executors();
}

// ---- the public side -----------------------------------------------------------------------

void Engine::set_node_transport(NodeTransport* transport) {
  std::lock_guard lock(impl_->mu);
  impl_->transport = transport;
}

void Engine::set_node_runner(std::function<void(std::function<void()>)> post) {
  std::lock_guard lock(impl_->mu);
  impl_->runner->post = std::move(post);
}

void Engine::set_node_algorithms(const NodeAlgorithmOptions& options) {
  auto next = std::make_shared<const NodeAlgorithmOptions>(options);
  std::lock_guard lock(impl_->mu);
  impl_->algorithms = std::move(next);
}

void Engine::node_message(const std::string& peer, MessageBytes message) {
  Impl& I = *impl_;
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    try {
      I.handle_node_message(peer, std::move(message), out, tasks);
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
    std::lock_guard lock(I.mu);
    const auto it = I.inboxes.find(uid);
    if (it == I.inboxes.end() || !it->second.first) return {};
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
  I.locked([&](std::vector<Delivery>& out, std::vector<std::function<void()>>& tasks) {
    I.handle_node_down(address, node, why, out, tasks);
  });
}

}  // namespace collectived::engine

#include "engine/transport/verbs/node_transport.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <utility>

#include "ipc/error.h"

namespace collectived::engine::transport::verbs {

namespace {

// Messages a sender keeps in flight per peer before it waits for the oldest:
// enough to cover the round trip of a write's completion (one write at a
// time left the link idle for a round trip per message).
constexpr std::size_t kWindow = 8;

// What a rail's device keeps on a client mapping (engine::HostRegion): the
// invalidator that drops its registration with the mapping, and whether the
// device refused to register it.
struct RegionState {
  std::shared_ptr<void> invalidator;
  std::atomic<bool> refused{false};
};

}  // namespace

// The connection to one peer: a pair per rail (HCA).
struct NodeTransport::Rails {
  std::vector<std::shared_ptr<Pair>> pairs;

  const std::string& peer() const { return pairs.front()->peer(); }
  bool healthy() const {
    return std::all_of(pairs.begin(), pairs.end(), [](const auto& q) { return q->healthy(); });
  }
  /// The first rail's error ("" if none broke).
  std::string error() const {
    for (const auto& q : pairs) {
      if (std::string e = q->error(); !e.empty()) return e;
    }
    return "";
  }
  void fail(const std::string& why) const {
    for (const auto& q : pairs) q->fail(why);
  }
  std::string describe() const {
    std::string out;
    for (const auto& q : pairs) out += (out.empty() ? "" : " + ") + q->describe();
    return out;
  }
  PairStats stats() const {
    PairStats t;
    for (const auto& q : pairs) {
      const PairStats s = q->stats();
      t.writes_posted += s.writes_posted;
      t.bytes_written += s.bytes_written;
      t.chunks_received += s.chunks_received;
      t.credit_messages += s.credit_messages;
      t.credit_stalls += s.credit_stalls;
      t.rebuilds += s.rebuilds;
      t.spilled_chunks += s.spilled_chunks;
    }
    return t;
  }
};

// What the receivers of one connection (one thread per rail) share: the
// pieces of a message may arrive on every rail, and whole messages go on in
// the order they were sent.
struct NodeTransport::Reassembly {
  struct Partial {
    engine::MessageBytes data;
    std::uint64_t got = 0;
  };
  std::mutex mu;
  std::map<std::uint64_t, Partial> partial;
  std::map<std::uint64_t, engine::MessageBytes> complete;
  std::uint64_t expected = 1;
};

namespace {

std::string rails_error(const NodeTransport::Rails& r) {
  const std::string e = r.error();
  return e.empty() ? "verbs connection to node " + r.peer() + " closed" : e;
}

}  // namespace

struct NodeTransport::Peer {
  std::string address;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool stop = false;
  // The current connection, its receiver threads (one per rail) and the flag
  // that tells those receivers it was replaced (no peer-down report then).
  std::shared_ptr<Rails> pair;
  std::shared_ptr<std::atomic<bool>> retired;
  std::vector<std::thread> receivers;
  std::uint32_t pairs = 0;
  std::string node;
  std::string error;
  std::uint64_t in_place_messages = 0;
  std::uint64_t in_place_bytes = 0;
  std::uint64_t staged_bytes = 0;
  std::string in_place_error;
  std::thread sender;
  // One install at a time (two setups may finish together): the old
  // connection's receivers are joined outside `mu`.
  std::mutex install_mu;
};

NodeTransport::NodeTransport(std::vector<Device*> devices, Connector connector,
                                       Deliver deliver, Down down, Clock::duration send_deadline)
    : devices_(std::move(devices)),
      connector_(std::move(connector)),
      deliver_(std::move(deliver)),
      down_(std::move(down)),
      send_deadline_(send_deadline) {
  if (devices_.empty()) throw Error(Code::invalid_argument, "verbs transport without a device");
}

NodeTransport::~NodeTransport() {
  std::map<std::string, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(mu_);
    peers.swap(peers_);
  }
  for (auto& [address, p] : peers) {
    std::shared_ptr<Rails> pair;
    {
      std::lock_guard lock(p->mu);
      p->stop = true;
      pair = p->pair;
      if (p->retired) p->retired->store(true);
    }
    if (pair) pair->fail("the daemon is closing the verbs transport");
    p->cv.notify_all();
  }
  for (auto& [address, p] : peers) {
    if (p->sender.joinable()) p->sender.join();
    for (auto& t : p->receivers) {
      if (t.joinable()) t.join();
    }
    // Messages still queued are answered: their callers wait for `done`.
    for (auto& item : p->queue) {
      if (item.second) item.second(Code::aborted, "the verbs transport is closing");
    }
  }
}

bool NodeTransport::connected(const std::string& address) const {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(address);
    if (it == peers_.end()) return false;
    p = it->second;
  }
  std::lock_guard lock(p->mu);
  return p->pair && p->pair->healthy();
}

std::shared_ptr<NodeTransport::Peer> NodeTransport::peer_for(const std::string& address) {
  std::lock_guard lock(mu_);
  auto& slot = peers_[address];
  if (!slot) {
    slot = std::make_shared<Peer>();
    slot->address = address;
    Peer* p = slot.get();
    p->sender = std::thread([this, p] { sender_loop(*p); });
  }
  return slot;
}

void NodeTransport::add_pair(const std::string& address, std::unique_ptr<Pair> pair) {
  std::vector<std::unique_ptr<Pair>> rails;
  rails.push_back(std::move(pair));
  add_rails(address, std::move(rails));
}

void NodeTransport::add_rails(const std::string& address,
                                   std::vector<std::unique_ptr<Pair>> rails) {
  if (rails.empty() || rails.size() > devices_.size()) {
    throw Error(Code::invalid_argument, "verbs connection to " + address + " with " +
                                            std::to_string(rails.size()) + " rails on " +
                                            std::to_string(devices_.size()) + " devices");
  }
  auto r = std::make_shared<Rails>();
  for (auto& q : rails) r->pairs.push_back(std::shared_ptr<Pair>(q.release()));
  install(*peer_for(address), std::move(r));
}

void NodeTransport::install(Peer& p, std::shared_ptr<Rails> sp) {
  std::lock_guard installing(p.install_mu);
  // First the old connection goes, and with it the messages still in flight
  // on it: writes whose `done` was answered when they were posted, and pieces
  // the peer wrote that this side has not read. A peer builds a new connection
  // only when its own broke, so some of them are lost: unless an old receiver
  // already reported the node down, that report is made here, before the new
  // connection delivers anything (otherwise an operation waiting for a lost
  // message would wait for its deadline: the QP-error hang of issue 7, where
  // the peer rebuilt the pair before this side's probe noticed that it was dead).
  std::shared_ptr<Rails> old_pair;
  std::shared_ptr<std::atomic<bool>> old_retired;
  std::vector<std::thread> old_receivers;
  {
    std::lock_guard lock(p.mu);
    if (p.stop) return;
    old_pair = p.pair;  // stays visible (unhealthy once failed) until the new one is in
    old_retired = p.retired;
    old_receivers = std::move(p.receivers);
    p.receivers.clear();
  }
  if (old_pair) {
    const bool reported = old_retired->exchange(true);
    std::string why = old_pair->error();
    if (why.empty()) {
      why = "verbs connection to node " + old_pair->peer() +
            " was rebuilt by that node (its side broke); messages in flight on it are lost";
    }
    old_pair->fail("replaced by a new verbs connection");
    for (auto& t : old_receivers) {
      if (t.joinable()) t.join();
    }
    if (!reported) {
      {
        std::lock_guard lock(p.mu);
        p.error = why;
      }
      if (down_) down_(p.address, old_pair->peer(), why);
    }
  }
  auto retired = std::make_shared<std::atomic<bool>>(false);
  auto reassembly = std::make_shared<Reassembly>();
  {
    std::lock_guard lock(p.mu);
    if (p.stop) return;
    p.pair = sp;
    p.retired = retired;
    ++p.pairs;
    p.node = sp->peer();
    p.error.clear();
    for (std::size_t k = 0; k < sp->pairs.size(); ++k) {
      p.receivers.emplace_back(
          [this, pp = &p, sp, k, reassembly, retired] { receive_loop(*pp, sp, k, reassembly, retired); });
    }
  }
  p.cv.notify_all();
}

void NodeTransport::receive_loop(Peer& p, std::shared_ptr<Rails> rails, std::size_t rail,
                                      std::shared_ptr<Reassembly> ra,
                                      std::shared_ptr<std::atomic<bool>> retired) {
  const std::shared_ptr<Pair>& sp = rails->pairs[rail];
  while (!retired->load()) {
    try {
      const Chunk c = sp->next_chunk(std::nullopt, Clock::now() + std::chrono::milliseconds(200));
      std::lock_guard lock(ra->mu);
      Reassembly::Partial& m = ra->partial[c.tag];
      // Allocated once per message, not zero-filled: the chunks cover it.
      if (m.data.size() != c.total) m.data = engine::MessageBytes(c.total);
      if (!c.data.empty()) std::memcpy(m.data.data() + c.offset, c.data.data(), c.data.size());
      m.got += c.data.size();
      sp->release(c);
      if (m.got >= c.total) {
        ra->complete[c.tag] = std::move(m.data);
        ra->partial.erase(c.tag);
      }
      // In send order: pieces of different messages can finish out of
      // order (several writes in flight, several QPs, several rails).
      for (auto it = ra->complete.find(ra->expected); it != ra->complete.end();
           it = ra->complete.find(ra->expected)) {
        deliver_(p.address, std::move(it->second));
        ra->complete.erase(it);
        ++ra->expected;
      }
    } catch (const Error& e) {
      if (e.code() == Code::timeout) continue;
      // Replaced (install reports the node down then, if need be) or closing.
      if (retired->exchange(true)) return;
      const std::string why = rails_error(*rails);
      // The other rails' receivers stop with this one; their pairs are failed
      // so that writes waiting on them end now.
      rails->fail(why);
      {
        std::lock_guard guard(p.mu);
        p.error = why;
      }
      if (down_) down_(p.address, rails->peer(), why);
      return;
    }
  }
}

void NodeTransport::fail_pair(const std::string& address, const std::string& why) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(address);
    if (it == peers_.end()) return;
    p = it->second;
  }
  std::shared_ptr<Rails> pair;
  {
    std::lock_guard lock(p->mu);
    pair = p->pair;
  }
  if (pair && pair->healthy()) pair->fail(why);
}

// One peer's sender thread: connects when needed, stages messages into
// registered pool buffers or writes their large pieces in place, and keeps
// up to kWindow messages in flight.
//
// The writes of one message are kept until their local completions return
// `staging` to the spares of its rail. A message copied whole into `staging`
// had its `done` answered when it was posted (the caller's bytes were free
// then); one read in place holds its memory (`keep`) and its `done` until the
// writes completed, and a failure then is its answer. A write that fails
// breaks the pair, which reports the node down.
class NodeTransport::Sender {
 public:
  Sender(NodeTransport& t, Peer& p) : t_(t), p_(p), spare_(t.devices_.size()) {}
  void run();

 private:
  struct InFlight {
    std::shared_ptr<Rails> rails;
    std::vector<std::pair<std::shared_ptr<Pair>, std::uint64_t>> writes;
    std::size_t rail = 0;  // of `staging`
    Buffer staging;
    std::shared_ptr<const void> keep;
    Done done;
  };
  /// Which payload pieces of a message are written in place (per piece, one
  /// registered buffer per rail it is spread over; empty: copied), and the
  /// bytes of each kind.
  struct Layout {
    std::vector<std::vector<Buffer>> direct;
    std::size_t staged = 0;
    std::uint64_t in_place = 0;
  };

  void retire(InFlight& f, Code code, const std::string& why);
  void reap();
  void complete_oldest();
  bool awaited() const;
  std::shared_ptr<Rails> healthy_pair(Item& item);
  Buffer registered(engine::HostRegion* r, std::size_t k);
  Layout lay_out(const engine::OutMessage& m, std::size_t home, std::size_t rails);
  void post_writes(InFlight& f, const engine::OutMessage& m, const Layout& layout,
                   std::uint64_t tag);
  void send(Item item, const std::shared_ptr<Rails>& pair);

  NodeTransport& t_;
  Peer& p_;
  std::deque<InFlight> in_flight_;
  // Staging buffers from each rail's registered pool, reused.
  std::vector<std::vector<Buffer>> spare_;
  std::shared_ptr<Rails> last_pair_;
  std::uint64_t next_tag_ = 1;
  std::size_t next_rail_ = 0;
};

void NodeTransport::sender_loop(Peer& p) { Sender(*this, p).run(); }

void NodeTransport::Sender::retire(InFlight& f, Code code, const std::string& why) {
  if (f.staging && spare_[f.rail].size() < kWindow) spare_[f.rail].push_back(std::move(f.staging));
  f.keep.reset();
  if (f.done) std::exchange(f.done, nullptr)(code, why);
}

// Completed messages, oldest first, without waiting.
void NodeTransport::Sender::reap() {
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    Code code = Code::ok;
    std::string why;
    try {
      for (const auto& [q, id] : f.writes) {
        if (!q->written(id)) return;
      }
    } catch (const Error&) {
      // broken or dropped: the receiver reports the node down
      code = Code::remote;
      why = rails_error(*f.rails);
    }
    InFlight done = std::move(f);
    in_flight_.pop_front();
    retire(done, code, why);
  }
}

// The oldest message, waiting for its writes (window full, pair replaced, closing).
void NodeTransport::Sender::complete_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  Code code = Code::ok;
  std::string why;
  try {
    for (const auto& [q, id] : f.writes) q->wait_written(id, Clock::now() + t_.send_deadline_);
  } catch (const Error& e) {
    // as above
    code = e.code() == Code::timeout ? Code::timeout : Code::remote;
    why = f.rails->healthy() ? std::string(e.what()) : rails_error(*f.rails);
  }
  retire(f, code, why);
}

// Whether a message read in place still waits for its writes: its `done`
// comes from this thread, so it must not sleep on an empty queue meanwhile.
bool NodeTransport::Sender::awaited() const {
  return std::any_of(in_flight_.begin(), in_flight_.end(),
                     [](const InFlight& f) { return static_cast<bool>(f.done); });
}

void NodeTransport::Sender::run() {
  while (true) {
    Item item;
    bool drain = false;
    {
      std::unique_lock lock(p_.mu);
      if (p_.queue.empty() && !p_.stop && awaited()) {
        drain = true;
      } else {
        p_.cv.wait(lock, [&] { return p_.stop || !p_.queue.empty(); });
        if (p_.stop) break;
        item = std::move(p_.queue.front());
        p_.queue.pop_front();
      }
    }
    if (drain) {
      complete_oldest();
      continue;
    }
    std::shared_ptr<Rails> pair = healthy_pair(item);
    if (!pair) continue;
    if (pair != last_pair_) {
      // A new connection: both sides start counting tags again.
      while (!in_flight_.empty()) complete_oldest();
      last_pair_ = pair;
      next_tag_ = 1;
      next_rail_ = 0;
    }
    reap();
    if (in_flight_.size() >= kWindow) complete_oldest();
    send(std::move(item), pair);
  }
  while (!in_flight_.empty()) complete_oldest();
}

// The peer's working pair, connecting first where there is none. Null when
// none could be had: `item` and everything queued behind it were then handed
// over (the selection falls back to TCP) or failed, in order.
std::shared_ptr<NodeTransport::Rails> NodeTransport::Sender::healthy_pair(Item& item) {
  std::shared_ptr<Rails> pair;
  {
    std::lock_guard lock(p_.mu);
    pair = p_.pair;
  }
  if (pair && pair->healthy()) return pair;
  while (!in_flight_.empty()) complete_oldest();
  std::optional<Error> failed;
  if (!t_.connector_) {
    if (pair) {
      failed.emplace(Code::remote, rails_error(*pair));
    } else {
      failed.emplace(Code::unavailable, "no verbs connection to " + p_.address);
    }
  } else {
    try {
      t_.connector_(p_.address);
    } catch (const Error& e) {
      failed.emplace(e);
    }
  }
  if (!failed) {
    std::lock_guard lock(p_.mu);
    pair = p_.pair;
    if (pair && pair->healthy()) return pair;
    failed.emplace(Code::unavailable,
                   pair ? rails_error(*pair) : "no verbs connection to " + p_.address);
  }
  std::vector<Item> items;
  items.push_back(std::move(item));
  {
    std::lock_guard lock(p_.mu);
    while (!p_.queue.empty()) {
      items.push_back(std::move(p_.queue.front()));
      p_.queue.pop_front();
    }
    p_.error = failed->what();
  }
  if (t_.connect_failed_) {
    t_.connect_failed_(p_.address, *failed, std::move(items));
  } else {
    for (auto& i : items) {
      if (i.second) i.second(failed->code(), failed->what());
    }
  }
  return nullptr;
}

// Client memory registered with rail `k`'s device: once per mapping (the MR
// cache), dropped when the mapping goes (the invalidator attached to its
// region), before the memory is unmapped, so that a new mapping at the same
// address is never served it. Empty Buffer: not registered.
Buffer NodeTransport::Sender::registered(engine::HostRegion* r, std::size_t k) {
  Device& d = *t_.devices_[k];
  auto* base = const_cast<std::byte*>(r->base());
  r->attach(&d, [&] {
    auto st = std::make_shared<RegionState>();
    st->invalidator = d.invalidator(base, r->size());
    return st;
  });
  const auto st = std::static_pointer_cast<RegionState>(r->attached(&d));
  if (st->refused.load()) return {};
  try {
    return d.register_memory(base, r->size());
  } catch (const Error& e) {
    // Not fatal: this mapping's pieces are copied like any other (not tried
    // again: a refused registration costs as much as a good one), and status
    // says why.
    st->refused.store(true);
    std::lock_guard lock(p_.mu);
    p_.in_place_error = e.what();
    return {};
  }
}

// Which payload pieces are written in place, and on which rails: a piece
// large enough for a write per rail is spread over all of them.
NodeTransport::Sender::Layout NodeTransport::Sender::lay_out(const engine::OutMessage& m,
                                                             std::size_t home, std::size_t rails) {
  Layout l;
  l.direct.resize(m.payload.size());
  l.staged = m.head.size();
  const std::uint64_t min = t_.in_place_min_;
  for (std::size_t i = 0; i < m.payload.size(); ++i) {
    engine::HostRegion* r = i < m.regions.size() ? m.regions[i] : nullptr;
    const std::size_t len = m.payload[i].size();
    if (r != nullptr && min != 0 && len >= min) {
      const std::size_t split = std::max<std::uint64_t>(min, kInPlaceMinBytes);
      const std::size_t ways = len >= rails * split ? rails : 1;
      for (std::size_t w = 0; w < ways; ++w) {
        Buffer b = registered(r, (home + w) % rails);
        if (!b) {
          l.direct[i].clear();
          break;
        }
        l.direct[i].push_back(std::move(b));
      }
    }
    if (!l.direct[i].empty()) {
      l.in_place += len;
    } else {
      l.staged += len;
    }
  }
  return l;
}

// Head and the copied pieces gather into `f.staging`; each run of them
// between pieces written in place is one write, each piece in place one per
// rail it is spread over; the receiver reassembles them by offset.
void NodeTransport::Sender::post_writes(InFlight& f, const engine::OutMessage& m,
                                        const Layout& layout, std::uint64_t tag) {
  const std::size_t n = m.size();
  const std::size_t rails = f.rails->pairs.size();
  const std::size_t home = f.rail;
  const MessagePart whole{};
  auto part = [&](std::size_t offset) {
    return layout.in_place == 0 ? whole : MessagePart{offset, n};
  };
  const std::shared_ptr<Pair>& home_pair = f.rails->pairs[home];
  std::byte* stage = f.staging.data();
  if (!m.head.empty()) std::memcpy(stage, m.head.data(), m.head.size());
  std::size_t at = m.head.size();       // in the message
  std::size_t run_from = 0;             // message offset of the current staged run
  std::size_t run_stage = 0;            // its offset in staging
  std::size_t run_len = m.head.size();  // the head starts the first run
  for (std::size_t i = 0; i < m.payload.size(); ++i) {
    const auto& piece = m.payload[i];
    const std::vector<Buffer>& direct = layout.direct[i];
    if (direct.empty()) {
      if (!piece.empty()) std::memcpy(stage + run_stage + run_len, piece.data(), piece.size());
      run_len += piece.size();
      at += piece.size();
      continue;
    }
    const std::size_t ways = direct.size();
    // Equal shares, 4 KiB aligned, the last one takes the rest.
    const std::size_t share = (piece.size() / ways) & ~std::size_t{4095};
    std::size_t done_bytes = 0;
    for (std::size_t w = 0; w < ways; ++w) {
      const std::size_t len = w + 1 == ways ? piece.size() - done_bytes : share;
      const Buffer& b = direct[w];
      const std::shared_ptr<Pair>& q = f.rails->pairs[(home + w) % rails];
      const std::size_t from = static_cast<std::size_t>(piece.data() - b.data()) + done_bytes;
      if (w == 0 && run_len > 0) {
        // The staged run before the piece (the head, at least) rides in
        // front of its first share: one write (home rail), not two.
        f.writes.emplace_back(q, q->post_write(tag, f.staging, run_stage, run_len, b, from, len,
                                               part(run_from)));
        run_stage += run_len;
        run_len = 0;
      } else {
        f.writes.emplace_back(q, q->post_write(tag, b, from, len, part(at + done_bytes)));
      }
      done_bytes += len;
    }
    at += piece.size();
    run_from = at;
  }
  // An empty message is still one (zero-length) write.
  if (run_len > 0 || f.writes.empty()) {
    f.writes.emplace_back(home_pair,
                          home_pair->post_write(tag, f.staging, run_stage, run_len, part(run_from)));
  }
}

void NodeTransport::Sender::send(Item item, const std::shared_ptr<Rails>& pair) {
  // The message's head and copied pieces go on one rail, in turn.
  const std::size_t home = next_rail_++ % pair->pairs.size();
  InFlight f;
  f.rails = pair;
  f.rail = home;
  bool deferred = false;  // read in place: `done` waits for the writes
  try {
    const engine::OutMessage& m = item.first;
    const Layout layout = lay_out(m, home, pair->pairs.size());
    for (auto it = spare_[home].begin(); it != spare_[home].end(); ++it) {
      if (it->size() >= std::max<std::size_t>(layout.staged, 1)) {
        f.staging = std::move(*it);
        spare_[home].erase(it);
        break;
      }
    }
    if (!f.staging) {
      f.staging = t_.devices_[home]->allocate(std::max<std::size_t>(layout.staged, 4096));
    }
    post_writes(f, m, layout, next_tag_++);
    {
      std::lock_guard lock(p_.mu);
      p_.staged_bytes += layout.staged;
      if (layout.in_place > 0) {
        ++p_.in_place_messages;
        p_.in_place_bytes += layout.in_place;
      }
    }
    deferred = layout.in_place > 0;
    if (const std::uint64_t left = t_.force_after_.load(); left > 0) {
      if (t_.force_after_.fetch_sub(1) == 1) pair->pairs.front()->force_error();
    }
  } catch (const Error& e) {
    // Writes already posted read their memory until they complete.
    if (!f.writes.empty()) {
      f.keep = std::move(item.first.keep);
      in_flight_.push_back(std::move(f));
    }
    if (item.second) item.second(e.code(), e.what());
    return;
  }
  if (deferred) {
    f.keep = std::move(item.first.keep);
    f.done = std::move(item.second);
    in_flight_.push_back(std::move(f));
  } else {
    in_flight_.push_back(std::move(f));
    if (item.second) item.second(Code::ok, "");
  }
}

std::vector<NodeTransport::Item> NodeTransport::take_queued(const std::string& address) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(address);
    if (it == peers_.end()) return {};
    p = it->second;
  }
  std::vector<Item> items;
  std::lock_guard lock(p->mu);
  while (!p->queue.empty()) {
    items.push_back(std::move(p->queue.front()));
    p->queue.pop_front();
  }
  return items;
}

void NodeTransport::send(const std::string& address, engine::OutMessage message,
                              Done done) {
  std::shared_ptr<Peer> p = peer_for(address);
  {
    std::lock_guard lock(p->mu);
    p->queue.emplace_back(std::move(message), std::move(done));
  }
  p->cv.notify_all();
}

std::vector<VerbsPeerStatus> NodeTransport::status() const {
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(mu_);
    for (const auto& [a, p] : peers_) peers.push_back(p);
  }
  std::vector<VerbsPeerStatus> out;
  for (const auto& p : peers) {
    VerbsPeerStatus s;
    std::shared_ptr<Rails> pair;
    {
      std::lock_guard lock(p->mu);
      s.address = p->address;
      s.node = p->node;
      s.pairs = p->pairs;
      s.error = p->error;
      s.in_place_messages = p->in_place_messages;
      s.in_place_bytes = p->in_place_bytes;
      s.staged_bytes = p->staged_bytes;
      s.in_place_error = p->in_place_error;
      pair = p->pair;
    }
    if (pair) {
      s.healthy = pair->healthy();
      s.pair = pair->describe();
      s.rails = static_cast<std::uint32_t>(pair->pairs.size());
      for (const auto& q : pair->pairs) s.rail_bytes.push_back(q->stats().bytes_written);
      s.stats = pair->stats();
      if (!s.healthy && s.error.empty()) s.error = rails_error(*pair);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace collectived::engine::transport::verbs

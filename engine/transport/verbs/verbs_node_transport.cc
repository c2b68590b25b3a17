#include "engine/transport/verbs/verbs_node_transport.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include "ipc/error.h"

namespace collectived::verbs {

namespace {

// Writes a sender keeps in flight per peer before it waits for the oldest:
// enough to cover the round trip of a write's completion (one write at a
// time left the link idle for a round trip per message).
constexpr std::size_t kWindow = 8;

std::string pair_error(const Pair& pair) {
  const std::string e = pair.error();
  return e.empty() ? "verbs connection to node " + pair.peer() + " closed" : e;
}

}  // namespace

struct VerbsNodeTransport::Peer {
  std::string address;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool stop = false;
  // The current pair, its receiver thread and the flag that tells that
  // receiver it was replaced (no peer-down report then).
  std::shared_ptr<Pair> pair;
  std::shared_ptr<std::atomic<bool>> retired;
  std::thread receiver;
  std::uint32_t pairs = 0;
  std::string node;
  std::string error;
  std::thread sender;
  // One install at a time (two setups may finish together): the old pair's
  // receiver is joined outside `mu`.
  std::mutex install_mu;
};

VerbsNodeTransport::VerbsNodeTransport(Device& device, Connector connector, Deliver deliver,
                                       Down down, Clock::duration send_deadline)
    : device_(device),
      connector_(std::move(connector)),
      deliver_(std::move(deliver)),
      down_(std::move(down)),
      send_deadline_(send_deadline) {}

VerbsNodeTransport::~VerbsNodeTransport() {
  std::map<std::string, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(mu_);
    peers.swap(peers_);
  }
  for (auto& [address, p] : peers) {
    std::shared_ptr<Pair> pair;
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
    if (p->receiver.joinable()) p->receiver.join();
    // Messages still queued are answered: their callers wait for `done`.
    for (auto& item : p->queue) {
      if (item.second) item.second(Code::aborted, "the verbs transport is closing");
    }
  }
}

bool VerbsNodeTransport::connected(const std::string& address) const {
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

std::shared_ptr<VerbsNodeTransport::Peer> VerbsNodeTransport::peer_for(const std::string& address) {
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

void VerbsNodeTransport::add_pair(const std::string& address, std::unique_ptr<Pair> pair) {
  install(*peer_for(address), std::move(pair));
}

void VerbsNodeTransport::install(Peer& p, std::unique_ptr<Pair> pair) {
  std::shared_ptr<Pair> sp(pair.release());
  std::lock_guard installing(p.install_mu);
  // First the old pair goes, and with it the messages still in flight on it:
  // writes whose `done` was answered when they were posted, and pieces the
  // peer wrote that this side has not read. A peer builds a new pair only
  // when its own broke, so some of them are lost: unless the old receiver
  // already reported the node down, that report is made here, before the new
  // pair delivers anything (otherwise an operation waiting for a lost message
  // would wait for its deadline: the QP-error hang of issue 7, where the peer
  // rebuilt the pair before this side's probe noticed that it was dead).
  std::shared_ptr<Pair> old_pair;
  std::shared_ptr<std::atomic<bool>> old_retired;
  std::thread old_receiver;
  {
    std::lock_guard lock(p.mu);
    if (p.stop) return;
    old_pair = p.pair;  // stays visible (unhealthy once failed) until the new one is in
    old_retired = p.retired;
    old_receiver = std::move(p.receiver);
  }
  if (old_pair) {
    const bool reported = old_retired->exchange(true);
    std::string why = old_pair->error();
    if (why.empty()) {
      why = "verbs connection to node " + old_pair->peer() +
            " was rebuilt by that node (its side broke); messages in flight on it are lost";
    }
    old_pair->fail("replaced by a new verbs connection");
    if (old_receiver.joinable()) old_receiver.join();
    if (!reported) {
      {
        std::lock_guard lock(p.mu);
        p.error = why;
      }
      if (down_) down_(p.address, old_pair->peer(), why);
    }
  }
  auto retired = std::make_shared<std::atomic<bool>>(false);
  {
    std::lock_guard lock(p.mu);
    if (p.stop) return;
    p.pair = sp;
    p.retired = retired;
    ++p.pairs;
    p.node = sp->peer();
    p.error.clear();
    p.receiver = std::thread([this, pp = &p, sp, retired] { receive_loop(*pp, sp, retired); });
  }
  p.cv.notify_all();
}

void VerbsNodeTransport::receive_loop(Peer& p, std::shared_ptr<Pair> sp,
                                      std::shared_ptr<std::atomic<bool>> retired) {
  struct Partial {
    engine::MessageBytes data;
    std::uint64_t got = 0;
  };
  std::map<std::uint64_t, Partial> partial;
  std::map<std::uint64_t, engine::MessageBytes> complete;
  std::uint64_t expected = 1;
  while (!retired->load()) {
    try {
      const Chunk c = sp->next_chunk(std::nullopt, Clock::now() + std::chrono::milliseconds(200));
      Partial& m = partial[c.tag];
      // Allocated once per message, not zero-filled: the chunks cover it.
      if (m.data.size() != c.total) m.data = engine::MessageBytes(c.total);
      if (!c.data.empty()) std::memcpy(m.data.data() + c.offset, c.data.data(), c.data.size());
      m.got += c.data.size();
      sp->release(c);
      if (m.got >= c.total) {
        complete[c.tag] = std::move(m.data);
        partial.erase(c.tag);
      }
      // In send order: pieces of different messages can finish out of
      // order (several writes in flight, several QPs).
      for (auto it = complete.find(expected); it != complete.end(); it = complete.find(expected)) {
        deliver_(p.address, std::move(it->second));
        complete.erase(it);
        ++expected;
      }
    } catch (const Error& e) {
      if (e.code() == Code::timeout) continue;
      // Replaced (install reports the node down then, if need be) or closing.
      if (retired->exchange(true)) return;
      const std::string why = pair_error(*sp);
      {
        std::lock_guard guard(p.mu);
        p.error = why;
      }
      if (down_) down_(p.address, sp->peer(), why);
      return;
    }
  }
}

void VerbsNodeTransport::fail_pair(const std::string& address, const std::string& why) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(address);
    if (it == peers_.end()) return;
    p = it->second;
  }
  std::shared_ptr<Pair> pair;
  {
    std::lock_guard lock(p->mu);
    pair = p->pair;
  }
  if (pair && pair->healthy()) pair->fail(why);
}

void VerbsNodeTransport::sender_loop(Peer& p) {
  // A write whose `done` was answered when it was posted (the message is
  // copied into `staging`, so the caller's bytes are free), kept until its
  // local completion returns `staging` to the spares. A write that fails
  // after that breaks the pair, which reports the node down.
  struct InFlight {
    std::uint64_t id;
    std::shared_ptr<Pair> pair;
    Buffer staging;
  };
  std::deque<InFlight> in_flight;
  std::vector<Buffer> spare;  // staging buffers from the registered pool, reused
  std::shared_ptr<Pair> last_pair;
  std::uint64_t next_tag = 1;

  auto retire = [&](InFlight& f) {
    if (spare.size() < kWindow) spare.push_back(std::move(f.staging));
  };
  // Completed writes, oldest first, without waiting.
  auto reap = [&] {
    while (!in_flight.empty()) {
      try {
        if (!in_flight.front().pair->written(in_flight.front().id)) return;
      } catch (const Error&) {
        // broken or dropped: the receiver reports the node down
      }
      retire(in_flight.front());
      in_flight.pop_front();
    }
  };
  // The oldest write, waiting for it (window full, pair replaced, closing).
  auto complete_oldest = [&] {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    try {
      f.pair->wait_written(f.id, Clock::now() + send_deadline_);
    } catch (const Error&) {
      // as above
    }
    retire(f);
  };

  while (true) {
    Item item;
    {
      std::unique_lock lock(p.mu);
      p.cv.wait(lock, [&] { return p.stop || !p.queue.empty(); });
      if (p.stop) break;
      item = std::move(p.queue.front());
      p.queue.pop_front();
    }
    std::shared_ptr<Pair> pair;
    {
      std::lock_guard lock(p.mu);
      pair = p.pair;
    }
    if (!pair || !pair->healthy()) {
      while (!in_flight.empty()) complete_oldest();
      std::optional<Error> failed;
      if (!connector_) {
        if (pair) {
          failed.emplace(Code::remote, pair_error(*pair));
        } else {
          failed.emplace(Code::unavailable, "no verbs connection to " + p.address);
        }
      } else {
        try {
          connector_(p.address);
        } catch (const Error& e) {
          failed.emplace(e);
        }
      }
      if (!failed) {
        std::lock_guard lock(p.mu);
        pair = p.pair;
        if (!pair || !pair->healthy()) {
          failed.emplace(Code::unavailable,
                         pair ? pair_error(*pair) : "no verbs connection to " + p.address);
        }
      }
      if (failed) {
        // This message and everything queued behind it: handed over (the
        // selection falls back to TCP) or failed, in order.
        std::vector<Item> items;
        items.push_back(std::move(item));
        {
          std::lock_guard lock(p.mu);
          while (!p.queue.empty()) {
            items.push_back(std::move(p.queue.front()));
            p.queue.pop_front();
          }
          p.error = failed->what();
        }
        if (connect_failed_) {
          connect_failed_(p.address, *failed, std::move(items));
        } else {
          for (auto& i : items) {
            if (i.second) i.second(failed->code(), failed->what());
          }
        }
        continue;
      }
    }
    if (pair != last_pair) {
      // A new pair: both sides start counting tags again.
      while (!in_flight.empty()) complete_oldest();
      last_pair = pair;
      next_tag = 1;
    }
    reap();
    if (in_flight.size() >= kWindow) complete_oldest();
    try {
      const engine::OutMessage& m = item.first;
      const std::size_t n = m.size();
      Buffer staging;
      for (auto it = spare.begin(); it != spare.end(); ++it) {
        if (it->size() >= std::max<std::size_t>(n, 1)) {
          staging = std::move(*it);
          spare.erase(it);
          break;
        }
      }
      if (!staging) staging = device_.allocate(std::max<std::size_t>(n, 4096));
      // Head and payload gathered into the registered buffer: the payload
      // (the caller's memory, not registered with this device) is read here
      // only, so `done` can run as soon as the write is posted.
      std::byte* at = staging.data();
      if (!m.head.empty()) std::memcpy(at, m.head.data(), m.head.size());
      at += m.head.size();
      for (const auto& piece : m.payload) {
        if (!piece.empty()) std::memcpy(at, piece.data(), piece.size());
        at += piece.size();
      }
      const std::uint64_t id = pair->post_write(next_tag++, staging, 0, n);
      in_flight.push_back({id, pair, std::move(staging)});
      if (const std::uint64_t left = force_after_.load(); left > 0) {
        if (force_after_.fetch_sub(1) == 1) pair->force_error();
      }
    } catch (const Error& e) {
      if (item.second) item.second(e.code(), e.what());
      continue;
    }
    if (item.second) item.second(Code::ok, "");
  }
  while (!in_flight.empty()) complete_oldest();
}

std::vector<VerbsNodeTransport::Item> VerbsNodeTransport::take_queued(const std::string& address) {
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

void VerbsNodeTransport::send(const std::string& address, engine::OutMessage message,
                              Done done) {
  std::shared_ptr<Peer> p = peer_for(address);
  {
    std::lock_guard lock(p->mu);
    p->queue.emplace_back(std::move(message), std::move(done));
  }
  p->cv.notify_all();
}

std::vector<VerbsPeerStatus> VerbsNodeTransport::status() const {
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lock(mu_);
    for (const auto& [a, p] : peers_) peers.push_back(p);
  }
  std::vector<VerbsPeerStatus> out;
  for (const auto& p : peers) {
    VerbsPeerStatus s;
    std::shared_ptr<Pair> pair;
    {
      std::lock_guard lock(p->mu);
      s.address = p->address;
      s.node = p->node;
      s.pairs = p->pairs;
      s.error = p->error;
      pair = p->pair;
    }
    if (pair) {
      s.healthy = pair->healthy();
      s.pair = pair->describe();
      s.stats = pair->stats();
      if (!s.healthy && s.error.empty()) s.error = pair_error(*pair);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace collectived::verbs

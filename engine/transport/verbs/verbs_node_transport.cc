#include "engine/transport/verbs/verbs_node_transport.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include "ipc/error.h"

namespace collectived::verbs {

struct VerbsNodeTransport::Peer {
  std::string address;
  std::unique_ptr<Pair> pair;
  std::string connect_error;

  // Sending: a queue drained by one thread, so that messages go in order and
  // send() never blocks on the network.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::vector<std::byte>, Done>> queue;
  std::uint64_t next_tag = 1;
  std::atomic<bool> stop{false};
  std::atomic<bool> down_reported{false};
  std::thread sender;
  std::thread receiver;

  ~Peer() {
    stop = true;
    cv.notify_all();
    if (sender.joinable()) sender.join();
    if (receiver.joinable()) receiver.join();
  }
};

namespace {

std::string pair_error(const Pair& pair) {
  const std::string e = pair.error();
  return e.empty() ? "verbs connection to node " + pair.peer() + " closed" : e;
}

}  // namespace

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
  for (auto& [address, peer] : peers) {
    if (peer->pair) peer->pair->fail("the daemon is closing the verbs transport");
  }
  peers.clear();  // joins the threads
}

bool VerbsNodeTransport::connected(const std::string& address) const {
  std::lock_guard lock(mu_);
  auto it = peers_.find(address);
  return it != peers_.end() && it->second->pair && it->second->pair->healthy();
}

void VerbsNodeTransport::add_pair(const std::string& address, std::unique_ptr<Pair> pair) {
  add_pair(address, std::move(pair), "");
}

void VerbsNodeTransport::add_pair(const std::string& address, std::unique_ptr<Pair> pair,
                                  const std::string& connect_error) {
  auto peer = std::make_shared<Peer>();
  peer->address = address;
  peer->pair = std::move(pair);
  peer->connect_error = connect_error;
  Peer* p = peer.get();

  p->sender = std::thread([this, p] {
    std::optional<Buffer> staging;
    while (true) {
      std::pair<std::vector<std::byte>, Done> item;
      {
        std::unique_lock lock(p->mu);
        p->cv.wait(lock, [&] { return p->stop || !p->queue.empty(); });
        if (p->queue.empty()) return;
        item = std::move(p->queue.front());
        p->queue.pop_front();
      }
      if (!p->pair) {
        if (item.second) item.second(Code::unavailable, p->connect_error);
        continue;
      }
      try {
        const std::size_t n = item.first.size();
        // One staging buffer, grown as needed, from the registered pool.
        if (!staging || staging->size() < std::max<std::size_t>(n, 1)) {
          staging.reset();
          staging = device_.allocate(std::max<std::size_t>(n, 4096));
        }
        if (n > 0) std::memcpy(staging->data(), item.first.data(), n);
        const std::uint64_t id = p->pair->post_write(p->next_tag++, *staging, 0, n);
        p->pair->wait_written(id, Clock::now() + send_deadline_);
        if (item.second) item.second(Code::ok, "");
      } catch (const Error& e) {
        if (item.second) item.second(e.code(), e.what());
      }
    }
  });

  if (p->pair) p->receiver = std::thread([this, p] {
    struct Partial {
      std::vector<std::byte> data;
      std::uint64_t got = 0;
    };
    std::map<std::uint64_t, Partial> partial;
    std::map<std::uint64_t, std::vector<std::byte>> complete;
    std::uint64_t expected = 1;
    while (!p->stop) {
      try {
        const Chunk c = p->pair->next_chunk(std::nullopt, Clock::now() + std::chrono::milliseconds(200));
        Partial& m = partial[c.tag];
        if (m.data.size() != c.total) m.data.resize(c.total);
        if (!c.data.empty()) std::memcpy(m.data.data() + c.offset, c.data.data(), c.data.size());
        m.got += c.data.size();
        p->pair->release(c);
        if (m.got >= c.total) {
          complete[c.tag] = std::move(m.data);
          partial.erase(c.tag);
        }
        // In send order: pieces of different messages can finish out of order
        // when a pair has several QPs.
        for (auto it = complete.find(expected); it != complete.end(); it = complete.find(expected)) {
          deliver_(p->address, std::move(it->second));
          complete.erase(it);
          ++expected;
        }
      } catch (const Error& e) {
        if (e.code() == Code::timeout) continue;
        if (!p->stop && !p->down_reported.exchange(true) && down_) {
          down_(p->address, p->pair->peer(), pair_error(*p->pair));
        }
        return;
      }
    }
  });

  std::shared_ptr<Peer> old;
  {
    std::lock_guard lock(mu_);
    auto& slot = peers_[address];
    old = std::move(slot);
    slot = std::move(peer);
  }
  // `old` (a pair replaced by a new connection) joins its threads here.
  if (old && old->pair) old->pair->fail("replaced by a new verbs connection");
}

std::shared_ptr<VerbsNodeTransport::Peer> VerbsNodeTransport::peer_for(const std::string& address,
                                                                      bool create) {
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(address);
    // A broken pair is replaced through the connector (the connection is rebuilt).
    if (it != peers_.end() &&
        ((it->second->pair && it->second->pair->healthy()) || !create || !connector_)) {
      return it->second;
    }
  }
  if (!create || !connector_) return nullptr;
  std::unique_ptr<Pair> pair;
  std::string error;
  try {
    pair = connector_(address);
  } catch (const Error& e) {
    error = e.what();
  }
  // A failed connection is a peer without a pair: its sender fails what is
  // queued (never inside send()), and the next send to it tries again.
  add_pair(address, std::move(pair), error);
  std::lock_guard lock(mu_);
  auto it = peers_.find(address);
  return it == peers_.end() ? nullptr : it->second;
}

void VerbsNodeTransport::send(const std::string& address, engine::OutMessage out, Done done) {
  std::vector<std::byte> message = out.flatten();
  std::shared_ptr<Peer> peer = peer_for(address, true);
  if (!peer) add_pair(address, nullptr, "no verbs connection to " + address);
  peer = peer_for(address, false);
  {
    std::lock_guard lock(peer->mu);
    peer->queue.emplace_back(std::move(message), std::move(done));
  }
  peer->cv.notify_one();
}

}  // namespace collectived::verbs

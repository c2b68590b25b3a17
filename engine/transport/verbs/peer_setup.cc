#include "engine/transport/verbs/peer_setup.h"

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>

#include "engine/transport/verbs/device.h"
#include "engine/transport/verbs/devices.h"
#include "engine/transport/verbs/gpudirect.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "engine/transport/verbs/pair.h"
#include "ipc/peer.capnp.h"

namespace collectived::engine::transport::verbs {

namespace {

// Exchange messages of one setup held before the setup thread reads them: a
// setup has two per rail (parameters, ready), and each side waits for the
// other's before it sends its next; more is a confused or hostile peer.
constexpr std::size_t kMaxBuffered = 16;

std::vector<std::byte> encode(capnp::MallocMessageBuilder& mb) {
  const auto words = capnp::messageToFlatArray(mb);
  const auto bytes = words.asBytes();
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.begin(), bytes.size());
  return out;
}

std::uint64_t random_attempt() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  std::uint64_t id = 0;
  while (id == 0) id = rng();
  return id;
}

}  // namespace

// One verbs setup with a peer, initiator or responder side. Guarded by mu_.
struct PeerSetup::Setup {
  std::uint64_t attempt = 0;
  bool initiator = false;
  std::string peer_node;  // from the peer's open (responder) or accept (initiator)
  std::uint32_t peer_rails = 1;  // HCAs the peer opened (its open or accept)
  bool accepted = false;
  bool peer_gave_up = false;  // its refuse/abort: no abort back
  std::optional<Error> error;
  std::map<std::uint32_t, std::vector<std::byte>> data;
  std::uint32_t next_in = 0;
  std::uint32_t next_out = 0;
};

// Per peer: the setup in progress and the outcome of the last one. Guarded by mu_.
struct PeerSetup::Link {
  std::string node;
  std::shared_ptr<Setup> running;
  std::uint64_t finished = 0;  // setups finished (either way)
  Code last_code = Code::ok;
  std::string last_error;
  std::uint64_t last_ok_attempt = 0;
};

// ExchangeChannel over the peer link: the setup's data messages.
class PeerSetup::SetupChannel final : public ExchangeChannel {
 public:
  SetupChannel(PeerSetup& t, std::string address, std::shared_ptr<Setup> setup)
      : t_(t), address_(std::move(address)), setup_(std::move(setup)) {}

  void send(std::span<const std::byte> message) override {
    capnp::MallocMessageBuilder mb;
    auto m = mb.initRoot<peerwire::VerbsSetup>();
    m.setAttempt(setup_->attempt);
    {
      std::lock_guard lock(t_.mu_);
      m.setSeq(setup_->next_out++);
    }
    m.setData(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(message.data()),
                                  message.size()));
    t_.send_setup(address_, encode(mb), setup_);
  }

  std::vector<std::byte> receive(Clock::time_point deadline) override {
    std::unique_lock lock(t_.mu_);
    Setup& s = *setup_;
    const bool ready = t_.cv_.wait_until(lock, deadline, [&] {
      return t_.stopping_ || s.error || s.data.count(s.next_in) != 0;
    });
    if (t_.stopping_) throw Error(Code::aborted, "the daemon is stopping");
    if (s.error) throw *s.error;
    if (!ready) {
      throw Error(Code::timeout, "no verbs connection parameters from " + address_ +
                                     " within deadlines.connect_ms");
    }
    auto it = s.data.find(s.next_in++);
    std::vector<std::byte> out = std::move(it->second);
    s.data.erase(it);
    return out;
  }

 private:
  PeerSetup& t_;
  std::string address_;
  std::shared_ptr<Setup> setup_;
};

PeerSetup::PeerSetup(const config::Profile& profile, Options options, std::string local_address,
                     tcp::Device& peers, engine::NodeReceiver& engine, engine::Logger& log)
    : profile_(profile),
      options_(std::move(options)),
      local_address_(std::move(local_address)),
      peers_(peers),
      engine_(engine),
      log_(log) {}

PeerSetup::~PeerSetup() {
  shutdown();
  for (auto& [thread, done] : threads_) thread.join();
  // Joins the senders (their connector waits ended with shutdown()) and receivers.
  verbs_.reset();
  devices_.clear();
}

void PeerSetup::shutdown() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void PeerSetup::open(NodeTransport::ConnectFailed connect_failed) {
  const Options& options = options_;
  try {
    // Test hook: tests of a machine without libibverbs.
    lib_ = !options.ibverbs_soname.empty() ? IbverbsLibrary::load(options.ibverbs_soname)
                                           : IbverbsLibrary::load();
    // No device at all (no HCA, no driver): say that, not what a named device's
    // lookup would answer (ibv_get_device_list fails with ENOSYS without the
    // kernel's InfiniBand core).
    if (discover_devices(*lib_).empty()) {
      throw Error(Code::unavailable, "no RDMA device: " + no_devices_reason());
    }
    // Every HCA port the profile lists, each a rail to every peer; a listed
    // one that cannot be opened stops verbs altogether (a node that silently
    // runs on fewer rails than its profile says is the kind of surprise this
    // daemon exists to prevent). None listed: every active port that opens.
    if (options.hcas.empty()) devices_ = open_devices(lib_, options, profile_.node.name);
    for (const config::VerbsHca& hca : options.hcas) {
      devices_.push_back(Device::open(lib_, options, profile_.node.name, hca));
    }
  } catch (const Error& e) {
    verbs_reason_ = e.what();
    devices_.clear();
    log_.warn("verbs_unavailable",
              {{"reason", verbs_reason_}, {"action", "serving every peer over tcp"}});
    return;
  }
  for (const auto& d : devices_) {
    device_text_ += (device_text_.empty() ? "" : " + ") + d->describe();
  }
  const GpuDirectStatus g = detect_gpudirect(lib_.get(), std::nullopt);
  gpudirect_route_ = g.route;
  gpudirect_reason_ = g.reason;
  std::vector<Device*> rails;
  for (const auto& d : devices_) rails.push_back(d.get());
  verbs_ = std::make_unique<NodeTransport>(
      std::move(rails), [this](const std::string& address) { connect(address); },
      [this](const std::string& address, engine::MessageBytes message) {
        engine_.node_message(address, std::move(message));
      },
      [this](const std::string& address, const std::string& node, const std::string& why) {
        log_.warn("verbs_peer_down", {{"peer", address}, {"node", node}, {"reason", why}});
        engine_.node_down(address, node, why);
      },
      profile_.deadlines.operation);
  verbs_->on_connect_failed(std::move(connect_failed));
  verbs_->set_in_place_min_bytes(options.in_place_min_bytes);
  // Test hook (tests/rdma): a QP error after this many messages.
  if (options.qp_error_after != 0) verbs_->force_error_after(options.qp_error_after);
  log_.info("transport_selected", {{"transport", "verbs"},
                                   {"device", device_text_},
                                   {"gpudirect", gpudirect_route_},
                                   {"gpudirect_reason", gpudirect_reason_},
                                   {"fallback", "tcp, per peer"}});
}

void PeerSetup::peer_down(const std::string& address, const std::string& why) {
  {
    std::lock_guard lock(mu_);
    Link& link = links_[address];
    link.last_ok_attempt = 0;  // a restarted peer starts from nothing
    if (link.running && !link.running->error) {
      link.running->error.emplace(Code::remote, "the TCP connection to " + address +
                                                    " went down during the verbs setup: " + why);
    }
  }
  cv_.notify_all();
  verbs_->fail_pair(address, "its TCP peer connection went down: " + why);
}

void PeerSetup::send_setup(const std::string& address, std::vector<std::byte> bytes,
                                    std::shared_ptr<Setup> setup) {
  peers_.send(address, kVerbsChannel, std::move(bytes),
              [this, address, setup](const tcp::PeerResult& r) {
                if (r.ok()) return;
                {
                  std::lock_guard lock(mu_);
                  const std::string why = "verbs setup with " + address + ": " + r.message;
                  if (setup) {
                    if (!setup->error) setup->error.emplace(Code::remote, why);
                  } else {
                    // A request that could not be sent: the waiting connector learns why.
                    Link& link = links_[address];
                    if (!link.running) {
                      ++link.finished;
                      link.last_code = Code::remote;
                      link.last_error = why;
                    }
                  }
                }
                cv_.notify_all();
              });
}

void PeerSetup::connect(const std::string& address) {
  std::unique_lock lock(mu_);
  if (stopping_) throw Error(Code::aborted, "the daemon is stopping");
  Link& link = links_[address];
  const std::uint64_t generation = link.finished;
  if (!link.running) {
    if (local_address_ < address) {
      start_attempt(address, link, random_attempt(), true, "", 1);
    } else {
      // The peer initiates: ask it to (naming the pair this side last had, so
      // that a stale request does not tear down a newer pair).
      capnp::MallocMessageBuilder mb;
      auto m = mb.initRoot<peerwire::VerbsSetup>();
      m.setAttempt(link.last_ok_attempt);
      m.setRequest(profile_.node.name);
      lock.unlock();
      send_setup(address, encode(mb), nullptr);
      lock.lock();
    }
  }
  const auto wait = 2 * std::max<std::chrono::milliseconds>(profile_.deadlines.connect,
                                                            std::chrono::seconds(1)) +
                    std::chrono::seconds(1);
  const bool done = cv_.wait_for(lock, wait, [&] { return stopping_ || link.finished > generation; });
  if (stopping_) throw Error(Code::aborted, "the daemon is stopping");
  if (!done) {
    throw Error(Code::timeout, "no verbs connection to " + address + " within " +
                                   std::to_string(wait.count()) +
                                   " ms (2 x deadlines.connect_ms + 1 s)");
  }
  if (link.last_code != Code::ok) throw Error(link.last_code, link.last_error);
}

void PeerSetup::start_attempt(const std::string& address, Link& link,
                                       std::uint64_t attempt, bool initiator,
                                       std::string peer_node, std::uint32_t peer_rails) {
  auto s = std::make_shared<Setup>();
  s->attempt = attempt;
  s->initiator = initiator;
  s->peer_node = std::move(peer_node);
  s->peer_rails = peer_rails;
  if (link.running && !link.running->error) {
    link.running->error.emplace(Code::aborted, "superseded by another verbs setup");
  }
  link.running = s;
  // Reap finished setup threads.
  for (auto it = threads_.begin(); it != threads_.end();) {
    if (it->second->load()) {
      it->first.join();
      it = threads_.erase(it);
    } else {
      ++it;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  threads_.emplace_back(std::thread([this, address, s, done] {
                          run_attempt(address, s);
                          done->store(true);
                        }),
                        done);
}

void PeerSetup::run_attempt(const std::string& address, std::shared_ptr<Setup> s) {
  const auto deadline =
      Clock::now() + std::max<std::chrono::milliseconds>(profile_.deadlines.connect,
                                                         std::chrono::seconds(1));
  try {
    {
      capnp::MallocMessageBuilder mb;
      auto m = mb.initRoot<peerwire::VerbsSetup>();
      m.setAttempt(s->attempt);
      if (s->initiator) {
        m.setOpen(profile_.node.name);
      } else {
        m.setAccept(profile_.node.name);
      }
      m.setRails(static_cast<std::uint32_t>(devices_.size()));
      send_setup(address, encode(mb), s);
    }
    std::string peer_node;
    std::uint32_t their_rails = 1;
    {
      std::unique_lock lock(mu_);
      const bool ok = cv_.wait_until(lock, deadline, [&] {
        return stopping_ || s->error || s->accepted || !s->initiator;
      });
      if (stopping_) throw Error(Code::aborted, "the daemon is stopping");
      if (s->error) throw *s->error;
      if (!ok) {
        throw Error(Code::timeout, "node at " + address +
                                       " did not answer the verbs setup within deadlines.connect_ms");
      }
      peer_node = s->peer_node;
      their_rails = s->peer_rails;
    }
    SetupChannel channel(*this, address, s);
    // Rails: both sides said in open/accept how many HCAs they opened; both
    // use the smaller number, HCA k joined to the peer's HCA k (profile order).
    const std::size_t n = std::min<std::size_t>(devices_.size(), their_rails);
    std::vector<std::unique_ptr<Pair>> pairs;
    std::string text;
    for (std::size_t k = 0; k < n; ++k) {
      pairs.push_back(devices_[k]->connect(channel, peer_node, deadline));
      text += (text.empty() ? "" : " + ") + pairs.back()->describe();
    }
    if (n < devices_.size()) {
      log_.warn("verbs_fewer_rails", {{"peer", address},
                                      {"node", peer_node},
                                      {"rails", n},
                                      {"local_hcas", devices_.size()},
                                      {"reason", "the peer opened " + std::to_string(their_rails) +
                                                     " HCAs"}});
    }
    verbs_->add_rails(address, std::move(pairs));
    finish(address, s, Code::ok, "", std::move(text));
  } catch (const Error& e) {
    bool tell = true;
    {
      std::lock_guard lock(mu_);
      tell = !s->peer_gave_up && !stopping_;
    }
    if (tell) {
      capnp::MallocMessageBuilder mb;
      auto m = mb.initRoot<peerwire::VerbsSetup>();
      m.setAttempt(s->attempt);
      m.setAbort(e.what());
      send_setup(address, encode(mb), nullptr);
    }
    finish(address, s, e.code(), e.what(), "");
  }
}

void PeerSetup::finish(const std::string& address, const std::shared_ptr<Setup>& s,
                                Code code, std::string error, std::string pair) {
  bool current = false;
  {
    std::lock_guard lock(mu_);
    Link& link = links_[address];
    if (link.running == s) {
      current = true;
      link.running.reset();
      ++link.finished;
      link.last_code = code;
      link.last_error = error;
      if (code == Code::ok) {
        link.last_ok_attempt = s->attempt;
        link.node = s->peer_node;
      }
    }
  }
  cv_.notify_all();
  if (code == Code::ok) {
    log_.info("verbs_connected", {{"peer", address},
                                  {"node", s->peer_node},
                                  {"role", s->initiator ? "initiator" : "responder"},
                                  {"queue_pairs", pair}});
  } else if (current) {
    log_.warn("verbs_setup_failed", {{"peer", address}, {"reason", error}});
  }
}

void PeerSetup::on_message(const std::string& peer,
                                          engine::MessageBytes payload) {
  if (payload.empty() || payload.size() % sizeof(capnp::word) != 0) {
    log_.warn("verbs_setup_refused", {{"peer", peer}, {"reason", "not a whole message"}});
    return;
  }
  kj::Array<capnp::word> words = kj::heapArray<capnp::word>(payload.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), payload.data(), payload.size());
  std::vector<std::byte> reply;
  try {
    capnp::ReaderOptions limits;
    limits.traversalLimitInWords = 1u << 16;
    capnp::FlatArrayMessageReader reader(words, limits);
    auto m = reader.getRoot<peerwire::VerbsSetup>();
    const std::uint64_t attempt = m.getAttempt();
    auto refuse = [&](std::uint64_t a) {
      capnp::MallocMessageBuilder mb;
      auto r = mb.initRoot<peerwire::VerbsSetup>();
      r.setAttempt(a);
      r.setRefuse("collectived on node " + profile_.node.name + " does not use verbs: " +
                  verbs_reason_);
      reply = encode(mb);
    };
    std::lock_guard lock(mu_);
    Link& link = links_[peer];
    Setup* s = link.running && link.running->attempt == attempt ? link.running.get() : nullptr;
    switch (m.which()) {
      case peerwire::VerbsSetup::REQUEST:
        link.node = m.getRequest().cStr();
        if (!verbs_) {
          refuse(0);
        } else if (!link.running && !stopping_ &&
                   (attempt == 0 || attempt == link.last_ok_attempt || link.last_ok_attempt == 0)) {
          start_attempt(peer, link, random_attempt(), true, "", 1);
        }
        break;
      case peerwire::VerbsSetup::OPEN:
        if (!verbs_) {
          refuse(attempt);
        } else if (link.running && link.running->initiator && link.running->attempt > attempt) {
          // Both sides initiated (they disagree on whose address is lower): the
          // larger attempt id wins on both.
          capnp::MallocMessageBuilder mb;
          auto r = mb.initRoot<peerwire::VerbsSetup>();
          r.setAttempt(attempt);
          r.setAbort("superseded by attempt " + std::to_string(link.running->attempt));
          reply = encode(mb);
        } else if (!stopping_) {
          link.node = m.getOpen().cStr();
          start_attempt(peer, link, attempt, false, m.getOpen().cStr(),
                        std::max<std::uint32_t>(1, m.getRails()));
        }
        break;
      case peerwire::VerbsSetup::ACCEPT:
        if (s) {
          s->accepted = true;
          s->peer_node = m.getAccept().cStr();
          s->peer_rails = std::max<std::uint32_t>(1, m.getRails());
          link.node = s->peer_node;
        }
        break;
      case peerwire::VerbsSetup::REFUSE:
        if (s) {
          s->peer_gave_up = true;
          if (!s->error) s->error.emplace(Code::unavailable, m.getRefuse().cStr());
        } else if (attempt == 0 && !link.running) {
          ++link.finished;
          link.last_code = Code::unavailable;
          link.last_error = m.getRefuse().cStr();
        }
        break;
      case peerwire::VerbsSetup::DATA:
        if (s) {
          if (s->data.size() >= kMaxBuffered) {
            if (!s->error) s->error.emplace(Code::protocol, "too many verbs setup messages from " + peer);
          } else {
            auto d = m.getData();
            s->data[m.getSeq()] = std::vector<std::byte>(
                reinterpret_cast<const std::byte*>(d.begin()),
                reinterpret_cast<const std::byte*>(d.end()));
          }
        }
        break;
      case peerwire::VerbsSetup::ABORT:
        if (s) {
          s->peer_gave_up = true;
          if (!s->error) {
            s->error.emplace(Code::unavailable, "the daemon at " + peer + " gave up the verbs setup: " +
                                                    std::string(m.getAbort().cStr()));
          }
        }
        break;
      default:
        break;  // a newer peer's message kind
    }
  } catch (const kj::Exception& e) {
    log_.warn("verbs_setup_refused",
              {{"peer", peer}, {"reason", std::string(e.getDescription().cStr())}});
    return;
  }
  cv_.notify_all();
  if (!reply.empty()) send_setup(peer, std::move(reply), nullptr);
}

// ---- status ----------------------------------------------------------------------------------

void PeerSetup::fill_status(wire::StatusReply::Builder status) const {
  std::map<std::string, VerbsPeerStatus> vs;
  if (verbs_) {
    for (auto& p : verbs_->status()) vs.emplace(p.address, std::move(p));
  }
  for (auto p : status.getPeers()) {
    if (!verbs_) continue;
    const std::string address = p.getAddress().cStr();
    auto v = vs.find(address);
    if (v != vs.end()) {
      auto o = p.initVerbs();
      o.setHealthy(v->second.healthy);
      o.setQueuePairs(v->second.pair.c_str());
      o.setPairs(v->second.pairs);
      o.setError(v->second.error.c_str());
      o.setBytesWritten(v->second.stats.bytes_written);
      o.setWrites(v->second.stats.writes_posted);
      o.setCreditStalls(v->second.stats.credit_stalls);
      o.setInPlaceMessages(v->second.in_place_messages);
      o.setInPlaceBytes(v->second.in_place_bytes);
      o.setStagedBytes(v->second.staged_bytes);
      o.setInPlaceError(v->second.in_place_error.c_str());
      auto rb = o.initRailBytes(static_cast<unsigned>(v->second.rail_bytes.size()));
      for (unsigned k = 0; k < rb.size(); ++k) rb.set(k, v->second.rail_bytes[k]);
    }
  }
  auto v = status.initVerbs();
  v.setEnabled(verbs_ != nullptr);
  v.setReason(verbs_ ? "verbs is listed before tcp; tcp serves peers that cannot use it"
                     : verbs_reason_.c_str());
  v.setDevice(device_text_.c_str());
  DeviceStats ds;  // summed over the rails' devices
  for (const auto& d : devices_) {
    const DeviceStats one = d->stats();
    ds.pool_bytes += one.pool_bytes;
    ds.pool_in_use += one.pool_in_use;
    ds.mr_cache_entries += one.mr_cache_entries;
    ds.mr_cache_hits += one.mr_cache_hits;
    ds.mr_cache_misses += one.mr_cache_misses;
  }
  v.setPoolBytes(ds.pool_bytes);
  v.setPoolInUse(ds.pool_in_use);
  v.setMrCacheEntries(ds.mr_cache_entries);
  v.setMrCacheHits(ds.mr_cache_hits);
  v.setMrCacheMisses(ds.mr_cache_misses);
  v.setGpuDirect(gpudirect_route_.c_str());
  v.setGpuDirectReason(gpudirect_reason_.c_str());
}

}  // namespace collectived::engine::transport::verbs

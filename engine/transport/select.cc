#include "engine/transport/select.h"

#include <algorithm>

namespace collectived::engine::transport {
namespace {

const char* choice_name(bool verbs) { return verbs ? "verbs" : "tcp"; }

}  // namespace

SelectingTransport::SelectingTransport(const config::Profile& profile, verbs::Options verbs_options,
                                       std::string local_address, tcp::Device& peers,
                                       engine::NodeReceiver& engine, engine::Logger& log)
    : profile_(profile),
      peers_(peers),
      engine_(engine),
      log_(log),
      tcp_(peers),
      verbs_(profile, std::move(verbs_options), std::move(local_address), peers, engine, log) {}

SelectingTransport::~SelectingTransport() { shutdown(); }

void SelectingTransport::shutdown() { verbs_.shutdown(); }

bool SelectingTransport::verbs_first() const {
  const auto& t = profile_.transports;
  const auto v = std::find(t.begin(), t.end(), config::TransportKind::verbs);
  const auto c = std::find(t.begin(), t.end(), config::TransportKind::tcp);
  return v != t.end() && (c == t.end() || v < c);
}

void SelectingTransport::start() {
  tcp::NodeTransport::connect(peers_, engine_);
  // Replaces NodeTransport's handler: the engine learns it all the same, and
  // the verbs side re-decides and rebuilds for that peer.
  peers_.on_peer_down([this](const std::string& peer, const std::string& node, Code,
                             const std::string& why) { peer_down(peer, node, why); });
  peers_.on_data(verbs::kVerbsChannel, [this](const std::string& peer, std::uint64_t,
                                              std::uint64_t, engine::MessageBytes payload) {
    verbs_.on_message(peer, std::move(payload));
  });
  open_verbs();
}

void SelectingTransport::open_verbs() {
  std::string reason;
  const auto& t = profile_.transports;
  if (std::find(t.begin(), t.end(), config::TransportKind::verbs) == t.end()) {
    reason = "the profile's transports do not list verbs";
  } else if (!verbs_first()) {
    reason = "the profile's transports list tcp before verbs";
  }
  if (!reason.empty()) {
    log_.info("transport_selected", {{"transport", "tcp"}, {"reason", reason}});
    verbs_.disable(std::move(reason));
    return;
  }
  verbs_.open([this](const std::string& address, const Error& why,
                     std::vector<verbs::NodeTransport::Item> items) {
    connect_failed(address, why, std::move(items));
  });
}

void SelectingTransport::send(const std::string& address, engine::OutMessage message,
                              Done done) {
  if (!verbs_.transport()) {
    tcp_.send(address, std::move(message), std::move(done));
    return;
  }
  std::lock_guard lock(choice_mu_);
  PeerChoice& c = choices_[address];
  if (c.choice == Choice::undecided) {
    c.choice = Choice::verbs;
    c.reason = "verbs is listed before tcp";
  }
  if (c.choice == Choice::tcp) {
    tcp_.send(address, std::move(message), std::move(done));
  } else {
    verbs_.transport()->send(address, std::move(message), std::move(done));  // only queues
  }
}

void SelectingTransport::connect_failed(const std::string& address, const Error& why,
                                        std::vector<std::pair<engine::OutMessage, Done>> items) {
  if (why.code() == Code::remote || why.code() == Code::aborted) {
    // The peer daemon cannot be reached at all (TCP would fail the same way),
    // or this daemon stops: fail what waited, and try verbs again next time.
    for (auto& [message, done] : items) {
      if (done) done(why.code(), why.what());
    }
    return;
  }
  std::lock_guard lock(choice_mu_);
  PeerChoice& c = choices_[address];
  c.choice = Choice::tcp;
  c.reason = std::string("fell back from verbs: ") + why.what();
  log_.warn("transport_fallback",
            {{"peer", address}, {"from", "verbs"}, {"to", "tcp"}, {"reason", why.what()}});
  // In order: what needed the pair, what queued behind it, then (under
  // choice_mu_, so nothing can overtake) anything queued since.
  for (auto& [message, done] : items) tcp_.send(address, std::move(message), std::move(done));
  for (auto& [message, done] : verbs_.transport()->take_queued(address)) {
    tcp_.send(address, std::move(message), std::move(done));
  }
}

void SelectingTransport::peer_down(const std::string& address, const std::string& node,
                                   const std::string& why) {
  engine_.node_down(address, node, why);
  if (!verbs_.transport()) return;
  {
    std::lock_guard lock(choice_mu_);
    choices_.erase(address);  // decided again on the next message (it may come back with verbs)
  }
  verbs_.peer_down(address, why);
}

void SelectingTransport::fill_status(wire::StatusReply::Builder status) const {
  std::map<std::string, PeerChoice> choices;
  {
    std::lock_guard lock(choice_mu_);
    choices = choices_;
  }
  for (auto p : status.getPeers()) {
    const std::string address = p.getAddress().cStr();
    if (!verbs_.transport()) {
      p.setTransport("tcp");
      p.setTransportReason(verbs_.reason().c_str());
      continue;
    }
    auto c = choices.find(address);
    if (c != choices.end() && c->second.choice != Choice::undecided) {
      p.setTransport(choice_name(c->second.choice == Choice::verbs));
      p.setTransportReason(c->second.reason.c_str());
    }
  }
  verbs_.fill_status(status);
}

}  // namespace collectived::engine::transport

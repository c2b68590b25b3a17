// The daemon's NodeTransport: per peer daemon, the transport the profile's
// `transports` order prefers among those that work, with the fallback to TCP
// logged with its reason.
//
//   SelectingTransport t(profile, verbs_options, own_address, peers, engine, log);
//   t.start();                           // opens verbs if listed before tcp; says why not
//   engine.set_node_transport(&t);
//
// Verbs (its setup over the peer links: engine/transport/verbs/peer_setup.h):
// without the library, a device or a working port the daemon logs why and
// serves every peer over TCP. A peer that refuses verbs or cannot finish the
// setup is served over TCP from then on (until its TCP connection goes
// down), logged as `transport_fallback`. A pair that breaks (QP error, dead
// peer) reports the node down to the engine and is rebuilt by the next
// message.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "config/profile.h"
#include "engine/log.h"
#include "engine/transport/tcp/device.h"
#include "engine/transport/tcp/node_transport.h"
#include "engine/transport/transport.h"
#include "engine/transport/verbs/options.h"
#include "engine/transport/verbs/peer_setup.h"
#include "ipc/protocol.capnp.h"

namespace collectived::engine::transport {

class SelectingTransport final : public engine::NodeTransport {
 public:
  /// `local_address`: this daemon's listen address ("host:port"), as peers
  /// name it. `verbs_options`: verbs::Options::from_profile(profile), and
  /// the daemon's test hooks.
  SelectingTransport(const config::Profile& profile, verbs::Options verbs_options,
                     std::string local_address, tcp::Device& peers, engine::NodeReceiver& engine,
                     engine::Logger& log);
  ~SelectingTransport() override;
  SelectingTransport(const SelectingTransport&) = delete;
  SelectingTransport& operator=(const SelectingTransport&) = delete;

  /// Routes the peer channels to the engine and opens verbs when the profile
  /// lists it before tcp (logging what was opened, or why nothing). On the
  /// event-loop thread, after peers.listen(). Never throws for verbs trouble.
  void start();
  /// Stops setting up verbs connections (waiters fail); at daemon shutdown.
  void shutdown();

  void send(const std::string& address, engine::OutMessage message, Done done) override;

  /// Adds the transport columns to StatusReply.peers (filled by
  /// tcp::fill_peer_status first) and fills StatusReply.verbs.
  void fill_status(wire::StatusReply::Builder status) const;

 private:
  enum class Choice { undecided, verbs, tcp };
  struct PeerChoice {
    Choice choice = Choice::undecided;
    std::string reason;
  };

  void open_verbs();
  bool verbs_first() const;
  void connect_failed(const std::string& address, const Error& why,
                      std::vector<std::pair<engine::OutMessage, Done>> items);
  void peer_down(const std::string& address, const std::string& node, const std::string& why);

  const config::Profile& profile_;
  tcp::Device& peers_;
  engine::NodeReceiver& engine_;
  engine::Logger& log_;
  tcp::NodeTransport tcp_;

  mutable std::mutex choice_mu_;  // before the verbs setup's lock and the verbs peers' locks
  std::map<std::string, PeerChoice> choices_;

  // Last: destroyed first, joining the verbs threads that may still call
  // connect_failed().
  verbs::PeerSetup verbs_;
};

}  // namespace collectived::engine::transport

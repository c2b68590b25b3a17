// The daemon's NodeTransport: per peer daemon, the transport the profile's
// `transports` order prefers among those that work, with the fallback to TCP
// logged with its reason.
//
//   SelectingTransport t(profile, own_address, peers, engine, log);
//   t.start();                           // opens verbs if listed before tcp; says why not
//   engine.set_node_transport(&t);
//
// Verbs: at start the daemon loads libibverbs and opens the profile's HCA port
// (or the first active one); without the library, a device or a working port
// it logs why and serves every peer over TCP. Per peer, the first engine
// message builds a verbs pair: the queue-pair parameters travel over the
// authenticated TCP peer connection (channel kVerbsChannel, ipc/peer.capnp
// VerbsSetup). Only the daemon with the lower listen address initiates; the
// other one asks it to, so that two daemons sending at once build one pair.
// The setup runs on the peer's sender thread (initiator side: a setup thread),
// never on the event loop and never under the engine lock. A peer that
// refuses verbs or cannot finish the setup is served over TCP from then on
// (until its TCP connection goes down), logged as `transport_fallback`. A
// pair that breaks (QP error, dead peer) reports the node down to the engine
// and is rebuilt by the next message.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config/profile.h"
#include "engine/engine.h"
#include "engine/log.h"
#include "engine/transport/tcp/peer_manager.h"
#include "engine/transport/tcp/peer_transport.h"
#include "engine/transport/transport.h"
#include "ipc/protocol.capnp.h"

namespace collectived::verbs {
class Device;
class IbverbsLibrary;
class VerbsNodeTransport;
}  // namespace collectived::verbs

namespace collectived::transport {

/// The peer-connection channel of verbs setup messages (ipc/peer.capnp VerbsSetup).
inline constexpr std::uint64_t kVerbsChannel = 3;

class SelectingTransport final : public engine::NodeTransport {
 public:
  /// `local_address`: this daemon's listen address ("host:port"), as peers name it.
  SelectingTransport(const config::Profile& profile, std::string local_address,
                     tcp::PeerManager& peers, engine::Engine& engine, engine::Logger& log);
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
  struct Setup;
  struct Link;
  enum class Choice { undecided, verbs, tcp };
  struct PeerChoice {
    Choice choice = Choice::undecided;
    std::string reason;
  };

  void open_verbs();
  bool verbs_first() const;
  // Verbs setup (the exchange over the peer link).
  void connect(const std::string& address);  // VerbsNodeTransport::Connector
  void on_setup_message(const std::string& peer, engine::MessageBytes payload);  // event loop
  void start_attempt(const std::string& address, Link& link, std::uint64_t attempt,
                     bool initiator, std::string peer_node,
                     std::uint32_t peer_rails);  // under mu_
  void run_attempt(const std::string& address, std::shared_ptr<Setup> setup);
  void finish(const std::string& address, const std::shared_ptr<Setup>& setup, Code code,
              std::string error, std::string pair);
  void send_setup(const std::string& address, std::vector<std::byte> bytes,
                  std::shared_ptr<Setup> setup);
  void connect_failed(const std::string& address, const Error& why,
                      std::vector<std::pair<engine::OutMessage, Done>> items);
  void peer_down(const std::string& address, const std::string& node, const std::string& why);
  class SetupChannel;
  friend class SetupChannel;

  const config::Profile& profile_;
  const std::string local_address_;
  tcp::PeerManager& peers_;
  engine::Engine& engine_;
  engine::Logger& log_;
  tcp::PeerTransport tcp_;

  // Verbs, when opened (else verbs_reason_ says why not).
  std::shared_ptr<const verbs::IbverbsLibrary> lib_;
  std::vector<std::unique_ptr<verbs::Device>> devices_;  // rail k on devices_[k]
  std::unique_ptr<verbs::VerbsNodeTransport> verbs_;
  std::string verbs_reason_;
  std::string device_text_;
  std::string gpudirect_route_;
  std::string gpudirect_reason_;

  mutable std::mutex choice_mu_;  // before Link/Setup state (mu_) and the verbs peers' locks
  std::map<std::string, PeerChoice> choices_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Link> links_;
  bool stopping_ = false;
  // Setup threads, each with the flag it sets when done (joined when done, and
  // all at destruction).
  std::vector<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> threads_;
};

}  // namespace collectived::transport

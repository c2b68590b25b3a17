// Verbs pairs set up over the daemon's authenticated TCP peer connections
// (engine/transport/select.h chooses per peer between them and TCP). At
// start: libibverbs loaded, every verbs.hcas port opened (none listed: every
// active port that opens), GPUDirect detected, or why not. Per peer, the
// first message that needs a pair builds one: the queue-pair parameters
// travel as VerbsSetup messages (ipc/peer.capnp) on channel kVerbsChannel.
// Only the daemon with the lower listen address initiates; the other asks it
// to, so that two daemons sending at once build one pair; if they disagree
// about the order, the larger attempt id wins. The setup runs on the peer's
// sender thread (initiator side: a setup thread), never on the event loop
// and never under the engine lock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "config/profile.h"
#include "engine/log.h"
#include "engine/transport/tcp/device.h"
#include "engine/transport/transport.h"
#include "engine/transport/verbs/node_transport.h"
#include "engine/transport/verbs/options.h"
#include "ipc/protocol.capnp.h"

namespace collectived::engine::transport::verbs {

class Device;
class IbverbsLibrary;

/// The peer-connection channel of verbs setup messages (ipc/peer.capnp VerbsSetup).
inline constexpr std::uint64_t kVerbsChannel = 3;

class PeerSetup {
 public:
  /// `local_address`: this daemon's listen address ("host:port"), as peers name it.
  PeerSetup(const config::Profile& profile, Options options, std::string local_address,
            tcp::Device& peers, engine::NodeReceiver& engine, engine::Logger& log);
  ~PeerSetup();
  PeerSetup(const PeerSetup&) = delete;
  PeerSetup& operator=(const PeerSetup&) = delete;

  /// Verbs is not used, for `reason` (peers that ask are told it).
  void disable(std::string reason) { verbs_reason_ = std::move(reason); }
  /// Loads libibverbs, opens the HCA ports and makes the node transport,
  /// logging what was opened (transport_selected) or why nothing
  /// (verbs_unavailable). Never throws for verbs trouble. `connect_failed`:
  /// where the messages go of a peer whose pair cannot be built.
  void open(NodeTransport::ConnectFailed connect_failed);
  /// A VerbsSetup message from `peer` (kVerbsChannel; event loop).
  void on_message(const std::string& peer, engine::MessageBytes payload);
  /// The TCP connection to `address` went down: its setup fails, its pair breaks.
  void peer_down(const std::string& address, const std::string& why);
  /// Stops setting up verbs connections (waiters fail); at daemon shutdown.
  void shutdown();

  /// The node transport over verbs pairs; null when verbs is not used.
  NodeTransport* transport() const { return verbs_.get(); }
  /// Why verbs is not used ("" when it is).
  const std::string& reason() const { return verbs_reason_; }
  /// Fills the peers' verbs columns of StatusReply.peers, and StatusReply.verbs.
  void fill_status(wire::StatusReply::Builder status) const;

 private:
  struct Setup;
  struct Link;
  class SetupChannel;
  friend class SetupChannel;

  void connect(const std::string& address);  // NodeTransport::Connector
  void start_attempt(const std::string& address, Link& link, std::uint64_t attempt,
                     bool initiator, std::string peer_node,
                     std::uint32_t peer_rails);  // under mu_
  void run_attempt(const std::string& address, std::shared_ptr<Setup> setup);
  void finish(const std::string& address, const std::shared_ptr<Setup>& setup, Code code,
              std::string error, std::string pair);
  void send_setup(const std::string& address, std::vector<std::byte> bytes,
                  std::shared_ptr<Setup> setup);

  const config::Profile& profile_;
  const Options options_;
  const std::string local_address_;
  tcp::Device& peers_;
  engine::NodeReceiver& engine_;
  engine::Logger& log_;

  // When opened (else verbs_reason_ says why not).
  std::shared_ptr<const IbverbsLibrary> lib_;
  std::vector<std::unique_ptr<Device>> devices_;  // rail k on devices_[k]
  std::unique_ptr<NodeTransport> verbs_;
  std::string verbs_reason_;
  std::string device_text_;
  std::string gpudirect_route_;
  std::string gpudirect_reason_;

  mutable std::mutex mu_;  // after the selection's choice lock, before the verbs peers' locks
  std::condition_variable cv_;
  std::map<std::string, Link> links_;
  bool stopping_ = false;
  // Setup threads, each with the flag it sets when done (joined when done, and
  // all at destruction).
  std::vector<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> threads_;
};

}  // namespace collectived::engine::transport::verbs

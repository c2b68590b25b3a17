// The engine's NodeTransport (engine/transport/transport.h) over verbs pairs:
// what the daemon plugs in, per peer, once verbs is selected for it
// (engine/transport/select.h). The connection to a peer is one pair per rail:
// the node's HCA k joined to the peer's HCA k (verbs.hcas, in profile order;
// as many rails as the node with fewer HCAs has). Each engine message is one
// or more tagged writes (tag = per-peer sequence number): its head and small
// pieces from a registered pool buffer, large pieces of client memory in
// place, spread over the rails; the receiving side reassembles the pieces of
// every rail and hands whole messages on in the order they were sent. A broken
// pair reports the peer down once (the engine then fails the communicators
// spanning it); the next message to that peer builds new ones.
//
// Threads: send() only queues (it never blocks on the network or on a
// connection being built). Per peer, a sender thread connects when needed
// (through the Connector), stages messages into pool buffers and keeps up to
// `kWindow` messages in flight; a receiver thread per rail reassembles.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/transport/transport.h"
#include "engine/transport/verbs/device.h"

namespace collectived::engine::transport::verbs {

/// One peer as status shows it.
struct VerbsPeerStatus {
  std::string address;
  std::string node;         ///< "" until a pair was made
  bool healthy = false;     ///< a working pair exists
  std::string pair;         ///< Pair::describe() of the current pairs, " + " between rails ("" = none)
  std::uint32_t rails = 0;  ///< pairs (HCAs) of the current connection
  std::vector<std::uint64_t> rail_bytes;  ///< bytes written on each of them
  std::uint32_t pairs = 0;  ///< pairs installed since start (1 + rebuilds)
  std::string error;        ///< why the last pair broke or could not be made
  PairStats stats;          ///< of the current pairs, summed over the rails
  /// Since start: messages whose payload pieces were written straight from
  /// the client's memory (registered once per mapping), their bytes, and the
  /// bytes copied into the pool instead (heads, scratch, pieces under
  /// kInPlaceMinBytes).
  std::uint64_t in_place_messages = 0;
  std::uint64_t in_place_bytes = 0;
  std::uint64_t staged_bytes = 0;
  /// The last failure to register client memory (its pieces were copied
  /// instead: a memlock limit, an HCA out of MRs); "" if none.
  std::string in_place_error;
};

/// Payload pieces in client memory smaller than this are copied into the pool
/// with the head: a piece written in place is a write of its own, with a
/// slot and a completion, which costs more than copying a few KiB. The
/// default of verbs.in_place_min_bytes (set_in_place_min_bytes).
inline constexpr std::size_t kInPlaceMinBytes = 16 * 1024;

class NodeTransport final : public engine::NodeTransport {
 public:
  /// A whole message from the daemon at `address` (Engine::node_message).
  using Deliver = std::function<void(const std::string& address, engine::MessageBytes message)>;
  /// The pair to `address` (node `node`) broke (Engine::node_down).
  using Down = std::function<void(const std::string& address, const std::string& node,
                                  const std::string& why)>;
  /// Makes sure a pair to `address` gets installed (add_pair), blocking until
  /// it is or throwing Error why not. Runs on the peer's sender thread only
  /// (never inside send()). May be empty: pairs only via add_pair.
  using Connector = std::function<void(const std::string& address)>;
  using Item = std::pair<engine::OutMessage, Done>;
  /// The Connector failed: `items` (the message that needed the pair first,
  /// then whatever was queued behind it, in order) are handed over instead of
  /// failed. Called on the sender thread without any of this object's locks.
  using ConnectFailed =
      std::function<void(const std::string& address, const Error& why, std::vector<Item> items)>;

  /// `devices`: the node's HCAs, rail k on devices[k] (at least one; they
  /// outlive this object).
  NodeTransport(std::vector<Device*> devices, Connector connector, Deliver deliver,
                     Down down, Clock::duration send_deadline);
  NodeTransport(Device& device, Connector connector, Deliver deliver, Down down,
                     Clock::duration send_deadline)
      : NodeTransport(std::vector<Device*>{&device}, std::move(connector),
                           std::move(deliver), std::move(down), send_deadline) {}
  ~NodeTransport() override;

  /// Queues `message`, as one tagged message of one or more writes. Payload
  /// pieces that lie in a client mapping (OutMessage::regions) of at least
  /// verbs.in_place_min_bytes are written in place from that memory, registered with
  /// the device once per mapping (the MR cache; the mapping's HostRegion drops
  /// it before the memory is unmapped); the head and the other pieces are
  /// copied into one registered staging buffer of the pool. `done` runs on the
  /// peer's sender thread: once the writes are posted when everything was
  /// copied, else once they completed (the payload is read until then); with
  /// the error (naming the node) when they cannot be posted or fail. A write
  /// that fails breaks the pair, which reports the node down.
  void send(const std::string& address, engine::OutMessage message, Done done) override;

  /// Uses `rails` for `address`, rail k made on devices[k] (replacing the
  /// previous ones, which are closed without reporting the peer down).
  void add_rails(const std::string& address, std::vector<std::unique_ptr<Pair>> rails);
  /// One rail.
  void add_pair(const std::string& address, std::unique_ptr<Pair> pair);
  /// Whether a healthy pair to `address` exists.
  bool connected(const std::string& address) const;
  /// Breaks the pair to `address` (its peer daemon's TCP link went down): the
  /// next message builds a new one.
  void fail_pair(const std::string& address, const std::string& why);
  /// Removes and returns the messages queued for `address` and not yet written.
  std::vector<Item> take_queued(const std::string& address);
  /// See ConnectFailed; set before the first send.
  void on_connect_failed(ConnectFailed handler) { connect_failed_ = std::move(handler); }
  /// Pieces of client memory at least this large are written in place; 0:
  /// none (verbs.in_place_min_bytes). Set before the first send.
  void set_in_place_min_bytes(std::uint64_t bytes) { in_place_min_ = bytes; }
  /// Test hook: after `writes` more messages to any peer, move that pair's QPs
  /// to the error state once (Options::qp_error_after).
  void force_error_after(std::uint64_t writes) { force_after_ = writes; }

  std::vector<VerbsPeerStatus> status() const;

  struct Peer;
  struct Rails;
  struct Reassembly;

 private:
  class Sender;  // one peer's sender thread (node_transport.cc)
  std::shared_ptr<Peer> peer_for(const std::string& address);
  void sender_loop(Peer& p);
  void install(Peer& p, std::shared_ptr<Rails> rails);
  void receive_loop(Peer& p, std::shared_ptr<Rails> rails, std::size_t rail,
                    std::shared_ptr<Reassembly> reassembly,
                    std::shared_ptr<std::atomic<bool>> retired);

  std::vector<Device*> devices_;
  Connector connector_;
  Deliver deliver_;
  Down down_;
  ConnectFailed connect_failed_;
  Clock::duration send_deadline_;
  std::atomic<std::uint64_t> force_after_{0};
  std::uint64_t in_place_min_ = kInPlaceMinBytes;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
};

}  // namespace collectived::engine::transport::verbs

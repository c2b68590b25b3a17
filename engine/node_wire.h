// The messages between engines on the wire (ipc/node.capnp): a message is
// [u32 header words][u32 0][Cap'n Proto header][raw bytes], the raw bytes
// read in place by the transport (zero copy). Encoding and decoding only:
// what a message means is engine/node_messages.cc's.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <sys/types.h>

#include "engine/comm.h"
#include "engine/transport/transport.h"
#include "ipc/node.capnp.h"

namespace collectived::engine::detail {



/// A message: [u32 header words][u32 0][header][raw bytes]. The raw bytes
/// are `raw`, read in place by the transport (zero copy); `keep` owns them if
/// they may outlive the sender.
/// `find_region` names the client mapping a raw piece lies in, if any
/// (OutMessage::regions).
OutMessage encode(capnp::MessageBuilder& mb, std::span<const std::span<const std::byte>> raw = {},
                  std::shared_ptr<const void> keep = nullptr,
                  const std::function<HostRegion*(std::span<const std::byte>)>& find_region = {});

/// A received message: its header, and where its raw bytes start.
struct Decoded {
  MessageBytes bytes;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader;
  nodewire::NodeMessage::Reader msg;
  std::size_t raw_offset = 0;
};

/// Throws Error(Code::protocol) for a message that cannot be one.
std::unique_ptr<Decoded> decode(MessageBytes bytes);

std::string to_hex(const std::string& bytes);
std::string text(capnp::Text::Reader t);
std::string data(capnp::Data::Reader d);
capnp::Data::Reader data_of(const std::string& bytes);
/// The control messages, each from the daemon at `from` (its rendezvous
/// address). A rank's join of the rendezvous `rendezvous` (at the receiver).
OutMessage join_message(const std::string& from, const std::string& id,
                        const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank,
                        pid_t pid, const std::string& node);
/// The rendezvous daemon's refusal of rank `rank` (-1: every rank) of the
/// rendezvous `key` (16 id bytes, '@', the rendezvous address).
OutMessage join_refusal(const std::string& from, const std::string& key, int rank, Code code,
                        const std::string& why);
/// The rendezvous daemon's answer once every rank joined: the rank map.
OutMessage join_map(const std::string& from, const std::string& id, const std::string& uid,
                    const std::string& name, const std::vector<int>& node_of_rank,
                    const std::vector<pid_t>& pids, const std::vector<std::string>& addresses,
                    const std::vector<std::string>& names);
/// A joined rank of the sender's node is gone before the rendezvous completed.
OutMessage join_cancel(const std::string& from, const std::string& id,
                       const std::string& rendezvous, std::uint32_t rank, const std::string& why);
/// The sender broke the communicator `uid` from sequence number `floor` on.
OutMessage broken_message(const std::string& from, const std::string& uid, Code code,
                          const std::string& why, std::uint64_t floor);
/// Operation `seq` of the communicator `uid` failed at the sender.
OutMessage slot_failed_message(const std::string& from, const std::string& uid, std::uint64_t seq,
                               Code code, const std::string& why);

/// Data of operation `seq` under `tag` from node `from_node`, carrying the
/// sender's description and plan (mismatches are named on arrival); the
/// payload is `pieces`, read in place (encode).
OutMessage op_data_message(const std::string& from, const std::string& uid, std::uint64_t seq,
                           std::uint64_t tag, int from_node, const Desc& desc, int desc_rank,
                           const NodePlan& plan, std::span<const std::span<const std::byte>> pieces,
                           std::shared_ptr<const void> keep,
                           const std::function<HostRegion*(std::span<const std::byte>)>& find_region);
/// A send of rank `from_rank` to rank `to_rank` (its `index`-th to it): the
/// bytes of `piece`, read in place, lying in `region` (null: none).
OutMessage p2p_message(const std::string& from, const std::string& uid, int from_node,
                       int from_rank, int to_rank, std::uint64_t index, std::uint64_t count,
                       DType dtype, std::span<const std::byte> piece,
                       std::shared_ptr<const void> keep, HostRegion* region);

/// What the sender's ranks agreed on (the sender's Desc).
Desc desc_of(nodewire::OpData::Reader d);

}  // namespace collectived::engine::detail

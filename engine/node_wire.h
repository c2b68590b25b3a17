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
/// What the sender's ranks agreed on (the sender's Desc).
Desc desc_of(nodewire::OpData::Reader d);
/// Writes `desc` and `plan` into an operation's data message.
void set_desc(nodewire::OpData::Builder d, const Desc& desc, int desc_rank, const NodePlan& plan);

}  // namespace collectived::engine::detail

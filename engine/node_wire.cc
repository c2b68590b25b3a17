#include "engine/node_wire.h"

#include <array>
#include <cstring>

namespace collectived::engine::detail {

namespace {
constexpr std::size_t kHeadPrefix = 8;  // [u32 header words][u32 0]
}  // namespace

OutMessage encode(capnp::MessageBuilder& mb, std::span<const std::span<const std::byte>> raw,
                  std::shared_ptr<const void> keep,
                  const std::function<HostRegion*(std::span<const std::byte>)>& find_region) {
  const auto words = capnp::messageToFlatArray(mb);
  const auto header = words.asBytes();
  OutMessage out;
  const auto nwords = static_cast<std::uint32_t>(words.size());
  const std::array<std::uint32_t, 2> prefix{nwords, 0};
  // One allocation, two copies (inserting into the empty vector makes GCC 12
  // see a bogus overflow).
  out.head.resize(kHeadPrefix + header.size());
  std::memcpy(out.head.data(), prefix.data(), kHeadPrefix);
  std::memcpy(out.head.data() + kHeadPrefix, header.begin(), header.size());
  bool any_region = false;
  for (const auto& p : raw) {
    if (p.empty()) continue;
    out.payload.push_back(p);
    out.regions.push_back(find_region ? find_region(p) : nullptr);
    any_region = any_region || out.regions.back() != nullptr;
  }
  if (!any_region) out.regions.clear();
  out.keep = std::move(keep);
  return out;
}

std::unique_ptr<Decoded> decode(MessageBytes bytes) {
  if (bytes.size() < kHeadPrefix) throw Error(Code::protocol, "message shorter than its prefix");
  std::uint32_t nwords = 0;
  std::memcpy(&nwords, bytes.data(), 4);
  if (nwords == 0 || kHeadPrefix + std::uint64_t{nwords} * 8 > bytes.size()) {
    throw Error(Code::protocol, "header of " + std::to_string(nwords) +
                                    " words does not fit a message of " +
                                    std::to_string(bytes.size()) + " bytes");
  }
  auto d = std::make_unique<Decoded>();
  d->bytes = std::move(bytes);
  // MessageBytes is aligned for any scalar type, so the words are too.
  kj::ArrayPtr<const capnp::word> words(reinterpret_cast<const capnp::word*>(d->bytes.data() + kHeadPrefix),
                                        nwords);
  capnp::ReaderOptions limits;
  limits.traversalLimitInWords = 1u << 24;
  limits.nestingLimit = 16;
  d->reader = std::make_unique<capnp::FlatArrayMessageReader>(words, limits);
  d->msg = d->reader->getRoot<nodewire::NodeMessage>();
  d->raw_offset = kHeadPrefix + std::size_t{nwords} * 8;
  return d;
}

std::string to_hex(const std::string& bytes) { return hex_prefix(bytes, bytes.size()); }

std::string text(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }
std::string data(capnp::Data::Reader d) {
  return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
}

Desc desc_of(nodewire::OpData::Reader d) {
  Desc desc;
  desc.kind = static_cast<OpKind>(d.getKind());
  desc.dtype = static_cast<DType>(d.getDtype());
  desc.redop = static_cast<RedOp>(d.getRedop());
  desc.count = d.getCount();
  desc.root = d.getRoot();
  return desc;
}

capnp::Data::Reader data_of(const std::string& bytes) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size());
}

OutMessage join_message(const std::string& from, const std::string& id,
                        const std::string& rendezvous, std::uint32_t nranks, std::uint32_t rank,
                        pid_t pid, const std::string& node) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto j = m.initJoin();
  j.setId(data_of(id));
  j.setRendezvous(rendezvous);
  j.setNranks(nranks);
  j.setRank(rank);
  j.setPid(pid);
  j.setNode(node);
  return encode(mb);
}

OutMessage join_refusal(const std::string& from, const std::string& key, int rank, Code code,
                        const std::string& why) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto r = m.initJoinReply();
  // The key is the 16 id bytes (which may contain '@'), '@', the address.
  const std::size_t at = 16;
  const std::string id = key.substr(0, at);
  r.setId(data_of(id));
  r.setRendezvous(key.substr(at + 1));
  r.setCode(static_cast<std::uint16_t>(code));
  r.setMessage(why);
  r.setRank(rank);
  return encode(mb);
}

OutMessage join_map(const std::string& from, const std::string& id, const std::string& uid,
                    const std::string& name, const std::vector<int>& node_of_rank,
                    const std::vector<pid_t>& pids, const std::vector<std::string>& addresses,
                    const std::vector<std::string>& names) {
  capnp::MallocMessageBuilder mb(1024);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto r = m.initJoinReply();
  r.setId(data_of(id));
  r.setRendezvous(from);
  r.setRank(-1);
  r.setUid(uid);
  r.setName(name);
  const auto nranks = static_cast<unsigned>(node_of_rank.size());
  auto nor = r.initNodeOfRank(nranks);
  auto por = r.initPidOfRank(nranks);
  for (unsigned k = 0; k < nranks; ++k) {
    nor.set(k, static_cast<std::uint32_t>(node_of_rank[k]));
    por.set(k, pids[k]);
  }
  auto na = r.initNodeAddresses(static_cast<unsigned>(addresses.size()));
  auto nn = r.initNodeNames(static_cast<unsigned>(names.size()));
  for (std::size_t k = 0; k < addresses.size(); ++k) {
    na.set(static_cast<unsigned>(k), addresses[k]);
    nn.set(static_cast<unsigned>(k), names[k]);
  }
  return encode(mb);
}

OutMessage join_cancel(const std::string& from, const std::string& id,
                       const std::string& rendezvous, std::uint32_t rank, const std::string& why) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto c = m.initJoinCancel();
  c.setId(data_of(id));
  c.setRendezvous(rendezvous);
  c.setRank(rank);
  c.setMessage(why);
  return encode(mb);
}

OutMessage broken_message(const std::string& from, const std::string& uid, Code code,
                          const std::string& why, std::uint64_t floor) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto b = m.initBroken();
  b.setUid(uid);
  b.setCode(static_cast<std::uint16_t>(code));
  b.setMessage(why);
  b.setFloor(floor);
  return encode(mb);
}

OutMessage slot_failed_message(const std::string& from, const std::string& uid, std::uint64_t seq,
                               Code code, const std::string& why) {
  capnp::MallocMessageBuilder mb(256);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto f = m.initSlotFailed();
  f.setUid(uid);
  f.setSeq(seq);
  f.setCode(static_cast<std::uint16_t>(code));
  f.setMessage(why);
  return encode(mb);
}

OutMessage op_data_message(const std::string& from, const std::string& uid, std::uint64_t seq,
                           std::uint64_t tag, int from_node, const Desc& desc, int desc_rank,
                           const NodePlan& plan, std::span<const std::span<const std::byte>> pieces,
                           std::shared_ptr<const void> keep,
                           const std::function<HostRegion*(std::span<const std::byte>)>& find_region) {
  capnp::MallocMessageBuilder mb(128);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto d = m.initData();
  d.setUid(uid);
  d.setSeq(seq);
  d.setTag(tag);
  d.setFromNode(static_cast<std::uint32_t>(from_node));
  d.setKind(static_cast<std::uint8_t>(desc.kind));
  d.setDtype(static_cast<std::uint8_t>(desc.dtype));
  d.setRedop(static_cast<std::uint8_t>(desc.redop));
  d.setCount(desc.count);
  d.setRoot(desc.root);
  d.setDescRank(static_cast<std::uint32_t>(desc_rank));
  d.setPlanAlgorithm(static_cast<std::uint8_t>(plan.algorithm));
  d.setPlanChunk(plan.chunk);
  return encode(mb, pieces, std::move(keep), find_region);
}

OutMessage p2p_message(const std::string& from, const std::string& uid, int from_node,
                       int from_rank, int to_rank, std::uint64_t index, std::uint64_t count,
                       DType dtype, std::span<const std::byte> piece,
                       std::shared_ptr<const void> keep, HostRegion* region) {
  capnp::MallocMessageBuilder mb(128);
  auto m = mb.initRoot<nodewire::NodeMessage>();
  m.setFrom(from);
  auto d = m.initData();
  d.setUid(uid);
  d.setP2p(true);
  d.setFromRank(static_cast<std::uint32_t>(from_rank));
  d.setToRank(static_cast<std::uint32_t>(to_rank));
  d.setIndex(index);
  d.setCount(count);
  d.setDtype(static_cast<std::uint8_t>(dtype));
  d.setFromNode(static_cast<std::uint32_t>(from_node));
  return encode(mb, std::span<const std::span<const std::byte>>(&piece, 1), std::move(keep),
                [region](std::span<const std::byte>) { return region; });
}

}  // namespace collectived::engine::detail

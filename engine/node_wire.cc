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

void set_desc(nodewire::OpData::Builder d, const Desc& desc, int desc_rank, const NodePlan& plan) {
  d.setKind(static_cast<std::uint8_t>(desc.kind));
  d.setDtype(static_cast<std::uint8_t>(desc.dtype));
  d.setRedop(static_cast<std::uint8_t>(desc.redop));
  d.setCount(desc.count);
  d.setRoot(desc.root);
  d.setDescRank(static_cast<std::uint32_t>(desc_rank));
  d.setPlanAlgorithm(static_cast<std::uint8_t>(plan.algorithm));
  d.setPlanChunk(plan.chunk);
}

}  // namespace collectived::engine::detail

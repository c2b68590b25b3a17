#include "engine/transport/verbs/pair.h"

#include "engine/transport/verbs/pair_impl.h"

namespace collectived::engine::transport::verbs {

Pair::Pair(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Pair::~Pair() = default;

const std::string& Pair::peer() const { return impl_->peer; }

std::uint64_t Pair::post_write(std::uint64_t tag, const Buffer& buffer, std::size_t offset,
                               std::size_t length, MessagePart part) {
  return post_write(tag, Buffer{}, 0, 0, buffer, offset, length, part);
}

std::uint64_t Pair::post_write(std::uint64_t tag, const Buffer& prefix, std::size_t prefix_offset,
                               std::size_t prefix_length, const Buffer& buffer, std::size_t offset,
                               std::size_t length, MessagePart part) {
  Impl& p = *impl_;
  auto check_range = [&](const Buffer& b, std::size_t off, std::size_t len) {
    if (off > b.size() || len > b.size() - off) {
      throw Error(Code::invalid_argument, "verbs write to " + p.name() + ": range " +
                                              std::to_string(off) + "+" + std::to_string(len) +
                                              " outside the buffer of " +
                                              std::to_string(b.size()) + " bytes");
    }
  };
  check_range(buffer, offset, length);
  if (prefix_length > 0) check_range(prefix, prefix_offset, prefix_length);
  const std::size_t all = prefix_length + length;
  if (part.total != 0 && (part.offset > part.total || all > part.total - part.offset)) {
    throw Error(Code::invalid_argument, "verbs write to " + p.name() + ": part " +
                                            std::to_string(part.offset) + "+" +
                                            std::to_string(all) + " outside the message of " +
                                            std::to_string(part.total) + " bytes");
  }
  std::lock_guard lock(p.mu);
  if (p.broken) p.throw_broken();
  // Not connected and not broken: rebuild() is under way (its new queue pairs
  // exist). The write is queued and posted once the pair is connected: the
  // peer may already be connected and writing to this side (it finishes the
  // exchange first when it reads our ready message before we read its), and a
  // reply to such a write must not fail (the verbs_pair_test flake of issue 7:
  // verbs_peer's echo of the first message after a rebuild was lost that way).
  const std::uint64_t id = p.next_id++;
  Impl::WriteOp& op = p.ops[id];
  op.tag = tag;
  if (prefix_length > 0) {
    op.prefix = prefix;
    op.prefix_offset = prefix_offset;
    op.prefix_length = prefix_length;
  }
  op.buffer = buffer;
  op.offset = offset;
  op.length = all;
  op.part = part;
  p.pending.push_back(id);
  ++p.stats.writes_posted;
  p.pump();
  return id;
}

void Pair::wait_written(std::uint64_t id, Clock::time_point deadline) {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  if (p.dropped.count(id) != 0) {
    throw Error(Code::aborted, "verbs write " + std::to_string(id) + " to " + p.name() +
                                   " was dropped when the connection was rebuilt");
  }
  p.wait(lock, deadline, [&] { return id < p.next_id && p.ops.count(id) == 0; },
         [&] { return "completion of write " + std::to_string(id); });
}

bool Pair::written(std::uint64_t id) const {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  if (p.dropped.count(id) != 0) {
    throw Error(Code::aborted, "verbs write " + std::to_string(id) + " to " + p.name() +
                                   " was dropped when the connection was rebuilt");
  }
  if (id < p.next_id && p.ops.count(id) == 0) return true;
  if (p.broken) p.throw_broken();
  return false;
}

Chunk Pair::next_chunk(std::optional<std::uint64_t> tag, Clock::time_point deadline) {
  Impl& p = *impl_;
  std::unique_lock lock(p.mu);
  Chunk out;
  auto find = [&] {
    for (auto it = p.arrived.begin(); it != p.arrived.end(); ++it) {
      if (!tag || it->tag == *tag) {
        out = *it;
        p.arrived.erase(it);
        return true;
      }
    }
    return false;
  };
  auto find_or_spill = [&] {
    if (find()) return true;
    if (tag) {
      p.spill();
    } else {
      p.pump();  // deferred credits (release) go out before waiting
    }
    return false;
  };
  p.wait(lock, deadline, find_or_spill, [&] {
    return tag ? "a message with tag " + std::to_string(*tag) : std::string("a message");
  });
  return out;
}

void Pair::release(const Chunk& chunk) {
  Impl& p = *impl_;
  std::lock_guard lock(p.mu);
  if (chunk.spilled || chunk.generation != p.generation || chunk.slot >= p.slot_held.size() ||
      !p.slot_held[chunk.slot]) {
    return;
  }
  p.give_back(chunk.slot);
  // Credits go back in batches: right away when nothing else waits to be
  // read (or a quarter of the slots is pending), else with the next batch
  // (the progress thread's pump, or a reader that finds nothing).
  std::uint32_t queued = 0;
  for (const auto& c : p.credits_to_send) queued += c.second;
  if (p.arrived.empty() || queued >= std::max<std::uint32_t>(1, p.slot_count / 4)) p.pump();
}

void Pair::receive(std::uint64_t tag, std::span<std::byte> destination,
                   Clock::time_point deadline) {
  std::uint64_t got = 0;
  do {
    const Chunk c = next_chunk(tag, deadline);
    if (c.total != destination.size()) {
      release(c);
      throw Error(Code::mismatch, "verbs message with tag " + std::to_string(tag) + " from " +
                                      impl_->name() + " has " + std::to_string(c.total) +
                                      " bytes, the receiver expects " +
                                      std::to_string(destination.size()));
    }
    if (!c.data.empty()) std::memcpy(destination.data() + c.offset, c.data.data(), c.data.size());
    got += c.data.size();
    release(c);
  } while (got < destination.size());
}

bool Pair::healthy() const {
  std::lock_guard lock(impl_->mu);
  return impl_->connected && !impl_->broken;
}

std::string Pair::error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->broken ? impl_->error : std::string();
}

void Pair::fail(const std::string& reason) {
  std::lock_guard lock(impl_->mu);
  impl_->set_broken(Code::remote, "verbs connection to " + impl_->name() + ": " + reason);
}

void Pair::force_error() {
  Impl& p = *impl_;
  std::lock_guard lock(p.mu);
  p.set_broken(Code::remote, "verbs connection to " + p.name() +
                                 ": queue pairs moved to the error state (force_error)");
  for (auto& qp : p.qps) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    try {
      qp->modify(a, IBV_QP_STATE, "->ERR", p.peer);
    } catch (const Error&) {
      // already in error or gone: nothing more to stop
    }
  }
}

void Pair::rebuild(ExchangeChannel& channel, Clock::time_point deadline) {
  Impl& p = *impl_;
  {
    std::lock_guard lock(p.mu);
    for (const auto& [id, op] : p.ops) p.dropped.insert(id);
    p.set_broken(Code::aborted, "verbs connection to " + p.name() + " is being rebuilt");
    ++p.stats.rebuilds;
  }
  p.establish(channel, deadline);
}

std::string Pair::describe() const {
  const Impl& p = *impl_;
  std::lock_guard lock(p.mu);
  std::ostringstream s;
  s << p.core->where() << " qpn";
  for (std::size_t i = 0; i < p.qps.size(); ++i) s << (i ? "," : " ") << p.qps[i]->qpn();
  s << " -> " << p.peer << " qpn";
  for (std::size_t i = 0; i < p.remote.qpns.size(); ++i) s << (i ? "," : " ") << p.remote.qpns[i];
  s << ", mtu " << p.remote.mtu << ", " << p.slot_count << " slots of " << size_text(p.slot_payload)
    << " here, " << p.remote.slot_count << " of " << size_text(p.remote.slot_payload) << " there";
  return s.str();
}

PairStats Pair::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace collectived::engine::transport::verbs

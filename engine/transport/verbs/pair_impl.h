// Private to verbs/pair.cc and verbs/device.cc: the device core that pairs
// share and keep alive (wire formats: verbs/wire.h), and Pair::Impl, a pair's state, driven by the callers and by its
// device's progress thread (Device::Impl::progress_loop).
#pragma once

#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "engine/transport/verbs/devices.h"
#include "engine/transport/verbs/ibverbs_functions.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "engine/transport/verbs/memory.h"
#include "engine/transport/verbs/resources.h"
#include "ipc/error.h"

#include "engine/transport/verbs/device.h"
#include "engine/transport/verbs/pair.h"
#include "engine/transport/verbs/wire.h"

namespace collectived::engine::transport::verbs {

using namespace detail;

// ---- Device core: what pairs share and keep alive ----------------------------------

struct Core {
  LibraryPtr lib;
  Options options;
  std::string node;
  std::unique_ptr<Context> ctx;
  std::unique_ptr<ProtectionDomain> pd;
  std::unique_ptr<CompletionChannel> channel;
  std::shared_ptr<RegisteredPool> pool;
  std::unique_ptr<MrCache> mr_cache;
  std::uint32_t port = 1;
  bool ethernet = false;
  int gid_index = 0;
  std::uint8_t gid[16]{};
  std::string gid_text;
  std::string gid_type;
  std::uint16_t lid = 0;
  std::uint32_t mtu = 0;  // bytes, already min(active, profile)
  std::uint32_t max_qp_wr = 0;
  std::uint32_t max_sge = 0;
  std::uint32_t max_cqe = 0;

  const IbverbsFunctions& fn() const { return lib->fn(); }
  std::string where() const { return ctx->name() + ":" + std::to_string(port); }

  ~Core() {
    // Order: registrations, then the PD, the channel, the context.
    mr_cache.reset();
    pool.reset();
    pd.reset();
    channel.reset();
    ctx.reset();
  }
};

// ---- Pair -------------------------------------------------------------------------

struct Pair::Impl {
  std::shared_ptr<Core> core;
  std::string peer;

  mutable std::mutex mu;
  std::condition_variable cv;

  std::unique_ptr<CompletionQueue> cq;
  std::vector<std::unique_ptr<QueuePair>> qps;
  std::vector<std::uint32_t> sq_outstanding;
  std::uint32_t sq_depth = 0;
  std::uint32_t rq_depth = 0;
  std::uint32_t next_qp = 0;

  // Local receive slots (the peer writes here) and the headers of our writes.
  std::unique_ptr<RegisteredPool::Block> slots;
  std::unique_ptr<RegisteredPool::Block> headers;
  std::uint32_t slot_count = 0;
  std::uint64_t slot_payload = 0;
  std::uint64_t slot_stride = 0;

  Endpoint remote;
  std::uint64_t generation = 0;
  bool connected = false;
  bool broken = false;
  Code error_code = Code::ok;
  std::string error;

  // Sending.
  struct WriteOp {
    std::uint64_t tag = 0;
    Buffer prefix;  // optional: bytes written before `buffer`'s
    std::size_t prefix_offset = 0;
    std::size_t prefix_length = 0;
    Buffer buffer;
    std::size_t offset = 0;
    std::size_t length = 0;  // prefix_length + the bytes of `buffer`
    MessagePart part;
    std::size_t posted = 0;  // bytes
    std::uint32_t outstanding = 0;
    bool all_posted = false;
  };
  std::map<std::uint64_t, WriteOp> ops;
  std::deque<std::uint64_t> pending;        // ops with bytes not yet posted, in order
  std::deque<std::uint32_t> free_remote;    // remote slots we may write
  std::deque<std::pair<std::uint32_t, std::uint32_t>> credits_to_send;  // (first, count)
  std::set<std::uint64_t> dropped;          // op ids failed by a rebuild
  std::uint64_t next_id = 1;
  bool probe_in_flight = false;

  // Receiving.
  std::deque<Chunk> arrived;
  std::vector<bool> slot_held;

  PairStats stats;

  SlotHeader* header_for(std::uint32_t remote_slot) const {
    return reinterpret_cast<SlotHeader*>(headers->data() + remote_slot * kHeaderBytes);
  }
  std::byte* slot_addr(std::uint32_t slot) const { return slots->data() + slot * slot_stride; }

  std::string name() const { return "node " + peer; }

  // Records the first error; later ones (flushes that follow it) add nothing.
  void set_broken(Code code, std::string message) {
    if (broken) return;
    broken = true;
    error_code = code;
    error = std::move(message);
    cv.notify_all();
  }
  [[noreturn]] void throw_broken() const { throw Error(error_code, error); }

  void post_recv(std::uint32_t qp) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    // WRITE WITH IMMEDIATE consumes a receive request but writes no bytes
    // through it: no scatter list needed.
    wr.wr_id = wr_id(generation, WrKind::recv, qp, 0);
    wr.num_sge = 0;
    const int rc = ibv_post_recv(qps[qp]->get(), &wr, &bad);
    if (rc != 0) {
      set_broken(Code::system, "verbs connection to " + name() + ": ibv_post_recv on " +
                                   core->where() + ": " + std::strerror(rc));
    }
  }

  // Picks a queue pair with room in its send queue (round robin); -1 if none.
  int pick_qp() {
    for (std::size_t i = 0; i < qps.size(); ++i) {
      const std::uint32_t q = (next_qp + i) % qps.size();
      if (sq_outstanding[q] < sq_depth) {
        next_qp = (q + 1) % qps.size();
        return static_cast<int>(q);
      }
    }
    return -1;
  }

  bool post_send(std::uint32_t q, ibv_send_wr& wr, const char* what) {
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qps[q]->get(), &wr, &bad);
    if (rc != 0) {
      set_broken(Code::system, "verbs connection to " + name() + ": ibv_post_send (" + what +
                                   ") on " + core->where() + " qpn " +
                                   std::to_string(qps[q]->qpn()) + ": " + std::strerror(rc));
      return false;
    }
    ++sq_outstanding[q];
    return true;
  }

  // Posts what credits and send-queue room allow. Called with `mu` held.
  void pump() {
    if (broken || !connected) return;
    while (!credits_to_send.empty()) {
      const int q = pick_qp();
      if (q < 0) return;
      const auto [first, count] = credits_to_send.front();
      ibv_send_wr wr{};
      wr.wr_id = wr_id(generation, WrKind::credit, q, first);
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.num_sge = 0;  // zero-length: only the immediate travels
      wr.imm_data = htonl(credit_imm(first, count));
      wr.wr.rdma.remote_addr = remote.slot_addr;
      wr.wr.rdma.rkey = remote.slot_rkey;
      if (!post_send(q, wr, "credit")) return;
      credits_to_send.pop_front();
      ++stats.credit_messages;
    }
    while (!pending.empty()) {
      auto it = ops.find(pending.front());
      if (it == ops.end()) {
        pending.pop_front();
        continue;
      }
      WriteOp& op = it->second;
      if (free_remote.empty()) {
        ++stats.credit_stalls;
        return;
      }
      const int q = pick_qp();
      if (q < 0) return;
      const std::uint32_t slot = free_remote.front();
      const std::size_t n = std::min<std::size_t>(remote.slot_payload, op.length - op.posted);
      SlotHeader* h = header_for(slot);
      h->magic = kSlotMagic;
      h->length = static_cast<std::uint32_t>(n);
      h->tag = op.tag;
      h->offset = op.part.offset + op.posted;
      h->total = op.part.total != 0 ? op.part.total : op.length;
      // Header, then the op's bytes [posted, posted + n): the part of the
      // prefix not yet written, then the buffer's.
      ibv_sge sge[3]{};
      int nsge = 1;
      sge[0].addr = reinterpret_cast<std::uintptr_t>(h);
      sge[0].length = kHeaderBytes;
      sge[0].lkey = headers->lkey();
      std::size_t from = op.posted;
      std::size_t left = n;
      if (from < op.prefix_length && left > 0) {
        const std::size_t k = std::min(left, op.prefix_length - from);
        sge[nsge].addr = reinterpret_cast<std::uintptr_t>(op.prefix.data() + op.prefix_offset + from);
        sge[nsge].length = static_cast<std::uint32_t>(k);
        sge[nsge].lkey = op.prefix.lkey();
        ++nsge;
        from += k;
        left -= k;
      }
      if (left > 0) {
        sge[nsge].addr = reinterpret_cast<std::uintptr_t>(op.buffer.data() + op.offset +
                                                          (from - op.prefix_length));
        sge[nsge].length = static_cast<std::uint32_t>(left);
        sge[nsge].lkey = op.buffer.lkey();
        ++nsge;
      }
      ibv_send_wr wr{};
      wr.wr_id = wr_id(generation, WrKind::data, q, it->first);
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.sg_list = sge;
      wr.num_sge = nsge;
      wr.imm_data = htonl(slot);
      wr.wr.rdma.remote_addr = remote.slot_addr + slot * remote.slot_stride;
      wr.wr.rdma.rkey = remote.slot_rkey;
      if (!post_send(q, wr, "RDMA WRITE")) return;
      free_remote.pop_front();
      op.posted += n;
      ++op.outstanding;
      stats.bytes_written += n;
      if (op.posted == op.length) {
        op.all_posted = true;
        pending.pop_front();
      }
    }
  }

  void post_probe() {
    if (broken || !connected || probe_in_flight) return;
    const int q = pick_qp();
    if (q < 0) return;
    // A zero-length RDMA WRITE: consumes nothing at the peer but must be
    // acknowledged by its QP, so a dead peer shows up as a retry error.
    ibv_send_wr wr{};
    wr.wr_id = wr_id(generation, WrKind::probe, q, 0);
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.num_sge = 0;
    wr.wr.rdma.remote_addr = remote.slot_addr;
    wr.wr.rdma.rkey = remote.slot_rkey;
    if (post_send(q, wr, "probe")) probe_in_flight = true;
  }

  std::string wc_error(const ibv_wc& wc) const {
    const std::uint32_t q = wr_qp(wc.wr_id);
    const char* op = "receive";
    switch (wr_kind(wc.wr_id)) {
      case WrKind::data: op = "RDMA WRITE"; break;
      case WrKind::credit: op = "credit write"; break;
      case WrKind::probe: op = "liveness probe"; break;
      case WrKind::recv: op = "receive"; break;
    }
    std::ostringstream m;
    m << "verbs connection to " << name() << " failed: " << core->fn().wc_status_str(wc.status)
      << " (status " << wc.status << ", vendor error 0x" << std::hex << wc.vendor_err << std::dec
      << ") on " << op << ", " << core->where();
    if (q < qps.size()) m << " qpn " << qps[q]->qpn();
    if (q < remote.qpns.size()) m << " -> " << peer << " qpn " << remote.qpns[q];
    if (wc.status == IBV_WC_RETRY_EXC_ERR) {
      m << "; the peer did not acknowledge within verbs.retry_count=" << core->options.retry_count
        << " x verbs.timeout=" << core->options.timeout
        << ": its daemon is dead or unreachable, or its QP is in error";
    }
    return m.str();
  }

  // One completion. Called with `mu` held.
  void handle(const ibv_wc& wc) {
    if (wr_generation(wc.wr_id) != (generation & kGenerationMask)) return;  // before a rebuild
    const std::uint32_t q = wr_qp(wc.wr_id);
    const WrKind kind = wr_kind(wc.wr_id);
    if (kind != WrKind::recv && q < sq_outstanding.size() && sq_outstanding[q] > 0) {
      --sq_outstanding[q];
    }
    if (wc.status != IBV_WC_SUCCESS) {
      if (kind == WrKind::probe) probe_in_flight = false;
      set_broken(Code::remote, wc_error(wc));
      return;
    }
    switch (kind) {
      case WrKind::data: {
        // Op ids are unique below 2^40 (more writes than that wrap the lookup).
        auto it = ops.find(wr_value(wc.wr_id));
        if (it != ops.end() && --it->second.outstanding == 0 && it->second.all_posted) {
          ops.erase(it);
          cv.notify_all();
        }
        break;
      }
      case WrKind::probe:
        probe_in_flight = false;
        break;
      case WrKind::credit:
        break;
      case WrKind::recv: {
        if (q < qps.size()) post_recv(q);
        if ((wc.wc_flags & IBV_WC_WITH_IMM) == 0) break;
        const std::uint32_t imm = ntohl(wc.imm_data);
        if ((imm & kCreditBit) != 0) {
          const std::uint32_t first = imm & 0xffff;
          const std::uint32_t count = (imm >> 16) & 0x7fff;
          for (std::uint32_t s = first; s < first + count && s < remote.slot_count; ++s) {
            free_remote.push_back(s);
          }
          break;
        }
        const std::uint32_t slot = imm;
        if (slot >= slot_count) {
          set_broken(Code::protocol, "verbs connection to " + name() + ": write into slot " +
                                         std::to_string(slot) + " of " +
                                         std::to_string(slot_count));
          return;
        }
        const auto* h = reinterpret_cast<const SlotHeader*>(slot_addr(slot));
        if (h->magic != kSlotMagic || h->length > slot_payload || h->offset > h->total ||
            h->length > h->total - h->offset) {
          set_broken(Code::protocol, "verbs connection to " + name() + ": malformed slot header in slot " +
                                         std::to_string(slot));
          return;
        }
        Chunk c;
        c.tag = h->tag;
        c.offset = h->offset;
        c.total = h->total;
        c.data = std::span<const std::byte>(slot_addr(slot) + kHeaderBytes, h->length);
        c.slot = slot;
        c.generation = generation;
        slot_held[slot] = true;
        arrived.push_back(c);
        ++stats.chunks_received;
        cv.notify_all();
        break;
      }
    }
  }

  // Polls this pair's CQ once; returns the number of completions handled.
  int poll() {
    std::lock_guard lock(mu);
    if (!cq) return 0;
    ibv_wc wc[16];
    const int n = ibv_poll_cq(cq->get(), 16, wc);
    if (n < 0) {
      set_broken(Code::system, "verbs connection to " + name() + ": ibv_poll_cq on " +
                                   core->where() + " failed");
      return 0;
    }
    for (int i = 0; i < n; ++i) handle(wc[i]);
    if (n > 0) pump();
    return n;
  }

  void arm() {
    std::lock_guard lock(mu);
    if (cq) ibv_req_notify_cq(cq->get(), 0);
  }

  // Connection set-up (pair_connect.cc): fresh QPs and our side's
  // parameters (prepare, `mu` held), INIT -> RTR -> RTS against the peer's
  // (activate, `mu` held), and the exchange of both over `channel`
  // (establish: a failure breaks the pair).
  Endpoint prepare();
  void activate(const Endpoint& local, const Endpoint& r);
  void establish(ExchangeChannel& channel, Clock::time_point deadline);
  void establish_once(ExchangeChannel& channel, Clock::time_point deadline);

  // Copies every arrived chunk still in its slot to the heap and gives the
  // slots back (see Pair::next_chunk). Called with `mu` held.
  void spill() {
    for (Chunk& c : arrived) {
      if (c.spilled || c.generation != generation) continue;
      auto copy = std::make_shared<std::vector<std::byte>>(c.data.begin(), c.data.end());
      c.data = std::span<const std::byte>(copy->data(), copy->size());
      c.spilled = std::move(copy);
      give_back(c.slot);
      ++stats.spilled_chunks;
    }
    pump();
  }

  // Queues the credit for local slot `slot`. Called with `mu` held.
  void give_back(std::uint32_t slot) {
    slot_held[slot] = false;
    // Coalesce with the last queued credit when adjacent.
    if (!credits_to_send.empty() &&
        credits_to_send.back().first + credits_to_send.back().second == slot) {
      ++credits_to_send.back().second;
    } else {
      credits_to_send.emplace_back(slot, 1);
    }
  }

  // Waits on `cv` until `done()` or the deadline, probing the peer while it
  // takes long, so that a dead peer fails the wait before its deadline.
  template <typename Done>
  void wait(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, Done done,
            const std::function<std::string()>& what) {
    constexpr auto kProbeEvery = std::chrono::milliseconds(500);
    // The waiter polls the completion queue itself for a while (no hand-off
    // through the progress thread and a condition variable), then sleeps.
    const auto poll_until = Clock::now() + std::chrono::microseconds(core->options.wait_poll_us);
    while (!done()) {
      if (broken) throw_broken();
      const auto now = Clock::now();
      if (now >= deadline) {
        throw Error(Code::timeout, "verbs connection to " + name() + ": " + what() +
                                       " did not happen before the deadline");
      }
      if (now < poll_until) {
        lock.unlock();
        poll();
        lock.lock();
        continue;
      }
      if (cv.wait_until(lock, std::min(deadline, now + kProbeEvery)) == std::cv_status::timeout) {
        post_probe();
      }
    }
  }
};

}  // namespace collectived::engine::transport::verbs

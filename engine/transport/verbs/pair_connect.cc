// A verbs pair's connection set-up (Pair::Impl, pair_impl.h): fresh QPs,
// the exchange of endpoints over the peer's side channel, RESET -> INIT ->
// RTR -> RTS.
#include "engine/transport/verbs/pair_impl.h"

namespace collectived::engine::transport::verbs {

// Creates fresh QPs (RESET -> INIT, receives posted) and returns our side's
// parameters. Called with `mu` held.
Endpoint Pair::Impl::prepare() {
  ++generation;
  connected = false;
  qps.clear();  // destroying a QP discards its outstanding work requests
  const Options& o = core->options;
  // Send queue: data writes (one per remote slot in flight) + credits (one
  // per local slot) + a probe; receive queue: data + credits arriving.
  sq_depth = std::min<std::uint32_t>(2 * o.slots_per_peer + 2, core->max_qp_wr);
  rq_depth = std::min<std::uint32_t>(2 * o.slots_per_peer + 2, core->max_qp_wr);
  sq_outstanding.assign(o.qps_per_connection, 0);
  std::random_device rd;
  Endpoint local;
  local.node = core->node;
  local.lid = core->lid;
  std::memcpy(local.gid, core->gid, 16);
  local.mtu = core->mtu;
  for (std::uint32_t i = 0; i < o.qps_per_connection; ++i) {
    // Scatter-gather entries per write: slot header, prefix, payload.
    qps.push_back(std::make_unique<QueuePair>(*core->pd, cq->get(), sq_depth, rq_depth, 3));
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<std::uint8_t>(core->port);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    qps.back()->modify(a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                       "RESET->INIT", peer);
    local.qpns.push_back(qps.back()->qpn());
    local.psns.push_back(rd() & 0xffffff);
  }
  local.slot_addr = reinterpret_cast<std::uintptr_t>(slots->data());
  local.slot_rkey = slots->rkey();
  local.slot_count = slot_count;
  local.slot_stride = slot_stride;
  local.slot_payload = slot_payload;
  // Receives go in before RTR: a write that arrives first must find one.
  for (std::uint32_t q = 0; q < qps.size(); ++q) {
    for (std::uint32_t i = 0; i < rq_depth; ++i) post_recv(q);
  }
  if (broken) throw_broken();
  // Reset the data path.
  ops.clear();
  pending.clear();
  credits_to_send.clear();
  arrived.clear();
  slot_held.assign(slot_count, false);
  probe_in_flight = false;
  return local;
}

// INIT -> RTR -> RTS against the peer's parameters. Called with `mu` held.
void Pair::Impl::activate(const Endpoint& local, const Endpoint& r) {
  const Options& o = core->options;
  // Both sides keep the smaller number of QPs (nodes' profiles may differ).
  const std::size_t n = std::min(qps.size(), r.qpns.size());
  qps.resize(n);
  sq_outstanding.resize(n);
  const std::uint32_t mtu = std::min(core->mtu, r.mtu);
  for (std::size_t i = 0; i < n; ++i) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = mtu_enum(mtu);
    a.dest_qp_num = r.qpns[i];
    a.rq_psn = r.psns[i];
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;  // 0.64 ms before a sender retries a receive-not-ready
    a.ah_attr.port_num = static_cast<std::uint8_t>(core->port);
    a.ah_attr.dlid = r.lid;
    a.ah_attr.sl = 0;
    if (core->ethernet) {
      // RoCE has no LIDs: the address is the GID, carried in a GRH.
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
      a.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(core->gid_index);
      a.ah_attr.grh.hop_limit = 64;
    }
    qps[i]->modify(a,
                   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                   "INIT->RTR", peer);
    ibv_qp_attr s{};
    s.qp_state = IBV_QPS_RTS;
    s.timeout = static_cast<std::uint8_t>(o.timeout);
    s.retry_cnt = static_cast<std::uint8_t>(o.retry_count);
    // 7 = retry receive-not-ready forever: flow control keeps receives posted,
    // and a dead peer is caught by the transport retries instead.
    s.rnr_retry = 7;
    s.sq_psn = local.psns[i];
    s.max_rd_atomic = 1;
    qps[i]->modify(s,
                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                   "RTR->RTS", peer);
  }
  remote = r;
  remote.qpns.resize(n);
  remote.psns.resize(n);
  remote.mtu = mtu;
  free_remote.clear();
  for (std::uint32_t s = 0; s < r.slot_count; ++s) free_remote.push_back(s);
  // Our headers array has one entry per remote slot.
  if (headers == nullptr || headers->size() < r.slot_count * kHeaderBytes) {
    headers = core->pool->allocate(r.slot_count * kHeaderBytes);
  }
}

void Pair::Impl::establish(ExchangeChannel& channel, Clock::time_point deadline) {
  try {
    establish_once(channel, deadline);
  } catch (const Error& e) {
    std::lock_guard lock(mu);
    set_broken(e.code(), e.what());
    throw;
  }
}

void Pair::Impl::establish_once(ExchangeChannel& channel, Clock::time_point deadline) {
  Endpoint local;
  {
    std::lock_guard lock(mu);
    broken = false;
    error.clear();
    error_code = Code::ok;
    local = prepare();
  }
  channel.send(encode(local));
  const Endpoint r = decode(channel.receive(deadline), peer);
  if (r.node != peer) {
    throw Error(Code::protocol, "verbs connection parameters came from node " + r.node +
                                    ", expected " + peer);
  }
  {
    std::lock_guard lock(mu);
    activate(local, r);
  }
  // Neither side writes before the other reached RTS (a write into a QP
  // still in INIT would be dropped and retried).
  Writer w;
  w.u32(kReadyMagic);
  w.u64(generation);
  channel.send(w.out());
  const std::vector<std::byte> ready = channel.receive(deadline);
  Reader rr(ready, peer);
  if (rr.u32() != kReadyMagic) {
    throw Error(Code::protocol, "expected the verbs ready message from " + peer);
  }
  std::lock_guard lock(mu);
  connected = true;
  pump();  // writes posted while the exchange ran
  cv.notify_all();
}

}  // namespace collectived::engine::transport::verbs

#include "engine/transport/verbs/resources.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "ipc/error.h"

namespace collectived::engine::transport::verbs {
namespace {

// Verbs calls return NULL or -1 with errno set, or return the error number itself.
[[noreturn]] void fail(const std::string& what, int err) {
  throw Error(Code::system, what + ": " + std::strerror(err));
}

}  // namespace

Context::Context(LibraryPtr lib, const std::string& name) : lib_(std::move(lib)), name_(name) {
  const IbverbsFunctions& f = lib_->fn();
  int count = 0;
  ibv_device** list = f.get_device_list(&count);
  if (list == nullptr) fail("ibv_get_device_list", errno);
  std::string present;
  for (int i = 0; i < count; ++i) {
    const std::string dev = f.get_device_name(list[i]);
    if (dev == name) {
      ctx_ = f.open_device(list[i]);
      const int err = errno;
      if (ctx_ == nullptr) {
        f.free_device_list(list);
        fail("ibv_open_device " + name, err);
      }
      break;
    }
    present += (present.empty() ? "" : ", ") + dev;
  }
  f.free_device_list(list);
  if (ctx_ == nullptr) {
    throw Error(Code::not_found, "RDMA device " + name + " not found (present: " +
                                     (present.empty() ? std::string("none") : present) + ")");
  }
}

Context::~Context() {
  if (ctx_ != nullptr) fn().close_device(ctx_);
}

ProtectionDomain::ProtectionDomain(const Context& ctx) : ctx_(ctx) {
  pd_ = ctx.fn().alloc_pd(ctx.get());
  if (pd_ == nullptr) fail("ibv_alloc_pd on " + ctx.name(), errno);
}

ProtectionDomain::~ProtectionDomain() {
  if (pd_ != nullptr) ctx_.fn().dealloc_pd(pd_);
}

CompletionChannel::CompletionChannel(const Context& ctx) : ctx_(ctx) {
  ch_ = ctx.fn().create_comp_channel(ctx.get());
  if (ch_ == nullptr) fail("ibv_create_comp_channel on " + ctx.name(), errno);
  // Non-blocking: the progress thread poll()s it and then drains every event.
  const int flags = ::fcntl(ch_->fd, F_GETFL);
  if (flags < 0 || ::fcntl(ch_->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    const int err = errno;
    ctx.fn().destroy_comp_channel(ch_);
    ch_ = nullptr;
    fail("O_NONBLOCK on the completion channel of " + ctx.name(), err);
  }
}

CompletionChannel::~CompletionChannel() {
  if (ch_ != nullptr) ctx_.fn().destroy_comp_channel(ch_);
}

int CompletionChannel::fd() const { return ch_->fd; }

CompletionQueue::CompletionQueue(const Context& ctx, int entries, CompletionChannel* channel,
                                 void* user)
    : ctx_(ctx) {
  cq_ = ctx.fn().create_cq(ctx.get(), entries, user, channel != nullptr ? channel->get() : nullptr,
                           0);
  if (cq_ == nullptr) {
    fail("ibv_create_cq (" + std::to_string(entries) + " entries) on " + ctx.name(), errno);
  }
}

CompletionQueue::~CompletionQueue() {
  if (cq_ != nullptr) ctx_.fn().destroy_cq(cq_);
}

QueuePair::QueuePair(const ProtectionDomain& pd, ibv_cq* cq, std::uint32_t send_wr,
                     std::uint32_t recv_wr, std::uint32_t send_sge)
    : pd_(pd) {
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  // Signal only what asks for it: every write here asks (its completion
  // frees the source buffer), so this is explicit rather than implied.
  init.sq_sig_all = 0;
  init.cap.max_send_wr = send_wr;
  init.cap.max_recv_wr = recv_wr;
  init.cap.max_send_sge = send_sge;
  init.cap.max_recv_sge = 1;
  qp_ = pd.context().fn().create_qp(pd.get(), &init);
  if (qp_ == nullptr) {
    fail("ibv_create_qp (RC, " + std::to_string(send_wr) + " send / " + std::to_string(recv_wr) +
             " receive work requests) on " + pd.context().name(),
         errno);
  }
}

QueuePair::~QueuePair() {
  if (qp_ != nullptr) pd_.context().fn().destroy_qp(qp_);
}

void QueuePair::modify(ibv_qp_attr& attr, int mask, const char* step, const std::string& peer) {
  const int rc = pd_.context().fn().modify_qp(qp_, &attr, mask);
  if (rc != 0) {
    // ibv_modify_qp returns the error number (and some providers also set errno).
    const int err = rc > 0 ? rc : errno;
    throw Error(Code::system, std::string("ibv_modify_qp ") + step + " of qpn " +
                                  std::to_string(qpn()) + " on " + pd_.context().name() +
                                  " (peer " + peer + "): " + std::strerror(err));
  }
}

ibv_qp_state QueuePair::state() const {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (pd_.context().fn().query_qp(qp_, &attr, IBV_QP_STATE, &init) != 0) return IBV_QPS_UNKNOWN;
  return attr.qp_state;
}

MemoryRegion::MemoryRegion(const ProtectionDomain& pd, void* addr, std::size_t length, int access)
    : pd_(pd) {
  mr_ = pd.context().fn().reg_mr(pd.get(), addr, length, access);
  if (mr_ == nullptr) {
    const int err = errno;
    std::string hint;
    if (err == ENOMEM || err == EPERM) {
      hint = " (pinned memory is limited by RLIMIT_MEMLOCK: raise LimitMEMLOCK in the unit)";
    }
    fail("ibv_reg_mr of " + std::to_string(length) + " bytes on " + pd.context().name() + hint,
         err);
  }
}

MemoryRegion::~MemoryRegion() {
  if (mr_ != nullptr) pd_.context().fn().dereg_mr(mr_);
}

}  // namespace collectived::engine::transport::verbs

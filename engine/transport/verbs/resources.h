// Non-copyable RAII owners of verbs objects: device context, protection
// domain, completion channel, completion queue, queue pair, memory region.
// Each keeps the library alive (shared_ptr) and releases its object through
// the resolved table; each failed creation throws an Error naming the device
// and errno's text. Internal to the verbs transport (includes verbs.h).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "engine/transport/verbs/ibverbs_functions.h"
#include "engine/transport/verbs/ibverbs_library.h"

namespace collectived::engine::transport::verbs {

using LibraryPtr = std::shared_ptr<const IbverbsLibrary>;

/// An opened HCA (ibv_context).
class Context {
 public:
  /// Opens the device named `name`; throws not_found listing the devices present.
  Context(LibraryPtr lib, const std::string& name);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  ibv_context* get() const { return ctx_; }
  const std::string& name() const { return name_; }
  const IbverbsFunctions& fn() const { return lib_->fn(); }
  const LibraryPtr& library() const { return lib_; }

 private:
  LibraryPtr lib_;
  std::string name_;
  ibv_context* ctx_ = nullptr;
};

class ProtectionDomain {
 public:
  explicit ProtectionDomain(const Context& ctx);
  ~ProtectionDomain();
  ProtectionDomain(const ProtectionDomain&) = delete;
  ProtectionDomain& operator=(const ProtectionDomain&) = delete;
  ibv_pd* get() const { return pd_; }
  const Context& context() const { return ctx_; }

 private:
  const Context& ctx_;
  ibv_pd* pd_ = nullptr;
};

/// A completion channel: the descriptor a progress thread sleeps on once
/// busy-polling found nothing (made non-blocking here).
class CompletionChannel {
 public:
  explicit CompletionChannel(const Context& ctx);
  ~CompletionChannel();
  CompletionChannel(const CompletionChannel&) = delete;
  CompletionChannel& operator=(const CompletionChannel&) = delete;
  ibv_comp_channel* get() const { return ch_; }
  int fd() const;

 private:
  const Context& ctx_;
  ibv_comp_channel* ch_ = nullptr;
};

class CompletionQueue {
 public:
  CompletionQueue(const Context& ctx, int entries, CompletionChannel* channel, void* user);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;
  ibv_cq* get() const { return cq_; }

 private:
  const Context& ctx_;
  ibv_cq* cq_ = nullptr;
};

/// A reliable-connected queue pair (created in RESET).
class QueuePair {
 public:
  QueuePair(const ProtectionDomain& pd, ibv_cq* cq, std::uint32_t send_wr, std::uint32_t recv_wr,
            std::uint32_t send_sge);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;
  ibv_qp* get() const { return qp_; }
  std::uint32_t qpn() const { return qp_->qp_num; }
  /// ibv_modify_qp; throws naming `step` ("RESET->INIT"), the device, the qpn and errno.
  void modify(ibv_qp_attr& attr, int mask, const char* step, const std::string& peer);
  /// The QP's current state (ibv_query_qp).
  ibv_qp_state state() const;

 private:
  const ProtectionDomain& pd_;
  ibv_qp* qp_ = nullptr;
};

/// A registered memory region.
class MemoryRegion {
 public:
  MemoryRegion(const ProtectionDomain& pd, void* addr, std::size_t length, int access);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ibv_mr* get() const { return mr_; }
  std::byte* addr() const { return static_cast<std::byte*>(mr_->addr); }
  std::size_t length() const { return mr_->length; }
  std::uint32_t lkey() const { return mr_->lkey; }
  std::uint32_t rkey() const { return mr_->rkey; }

 private:
  const ProtectionDomain& pd_;
  ibv_mr* mr_ = nullptr;
};

}  // namespace collectived::engine::transport::verbs

// The function table of the dlopen'ed libibverbs (see ibverbs_library.h).
// Included only by the verbs transport's own sources.
//
// verbs.h declares two kinds of "functions":
//  * exported symbols of libibverbs.so.1 (ibv_open_device, ibv_reg_mr, ...):
//    they are called only through the pointers below, resolved at load; a
//    direct call would not link (no binary links libibverbs, and
//    -Wl,--no-undefined refuses the reference);
//  * static inline functions that jump through the context's provider ops
//    (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq): they
//    need no symbol and are called as declared in verbs.h.
// Some exported names are also macros wrapping an inline function
// (ibv_query_port, ibv_reg_mr, ibv_get_device_list); the members here have
// other names, so those macros never expand on them.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>

namespace collectived::engine::transport::verbs {

struct IbverbsFunctions {
  // Devices.
  ibv_device** (*get_device_list)(int* num_devices) = nullptr;
  void (*free_device_list)(ibv_device** list) = nullptr;
  const char* (*get_device_name)(ibv_device* device) = nullptr;
  __be64 (*get_device_guid)(ibv_device* device) = nullptr;
  ibv_context* (*open_device)(ibv_device* device) = nullptr;
  int (*close_device)(ibv_context* context) = nullptr;
  int (*query_device)(ibv_context* context, ibv_device_attr* attr) = nullptr;
  // The exported symbol takes the old (compat) layout; see query_port() below.
  int (*query_port_compat)(ibv_context* context, std::uint8_t port,
                           _compat_ibv_port_attr* attr) = nullptr;
  int (*query_gid)(ibv_context* context, std::uint8_t port, int index, ibv_gid* gid) = nullptr;
  const char* (*port_state_str)(ibv_port_state state) = nullptr;
  // Protection domains and memory regions.
  ibv_pd* (*alloc_pd)(ibv_context* context) = nullptr;
  int (*dealloc_pd)(ibv_pd* pd) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, std::size_t length, int access) = nullptr;
  int (*dereg_mr)(ibv_mr* mr) = nullptr;
  // Optional (rdma-core >= 34): nullptr when absent.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, std::uint64_t offset, std::size_t length,
                           std::uint64_t iova, int fd, int access) = nullptr;
  // Completion queues and channels.
  ibv_comp_channel* (*create_comp_channel)(ibv_context* context) = nullptr;
  int (*destroy_comp_channel)(ibv_comp_channel* channel) = nullptr;
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context,
                       ibv_comp_channel* channel, int comp_vector) = nullptr;
  int (*destroy_cq)(ibv_cq* cq) = nullptr;
  int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) = nullptr;
  void (*ack_cq_events)(ibv_cq* cq, unsigned int nevents) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status status) = nullptr;
  // Queue pairs.
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr) = nullptr;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) = nullptr;
  int (*query_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask, ibv_qp_init_attr* init) = nullptr;
  int (*destroy_qp)(ibv_qp* qp) = nullptr;

  /// ibv_query_port as verbs.h's inline wrapper does it: the provider's
  /// extended op when the context has one, else the exported compat symbol.
  int query_port(ibv_context* context, std::uint8_t port, ibv_port_attr* attr) const;
};

}  // namespace collectived::engine::transport::verbs

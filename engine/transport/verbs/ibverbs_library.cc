#include "engine/transport/verbs/ibverbs_library.h"

#include <dlfcn.h>

#include <cstring>

#include "engine/transport/verbs/ibverbs_functions.h"
#include "ipc/error.h"

namespace collectived::engine::transport::verbs {
namespace {

std::string dlerror_text() {
  const char* text = dlerror();
  return text != nullptr ? text : "no dlerror text";
}

// Resolves one symbol into `slot`; a required one that is missing throws.
template <typename Fn>
void resolve(void* handle, const std::string& soname, const char* symbol, Fn*& slot,
             bool required = true) {
  dlerror();  // clear: a symbol's value may legitimately be null
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    if (!required) return;
    throw Error(Code::unavailable,
                soname + " has no symbol " + symbol + " (" + dlerror_text() +
                    "): the library is not rdma-core's libibverbs or too old; install Debian's "
                    "libibverbs1 (rdma-core) and the provider package ibverbs-providers");
  }
  slot = reinterpret_cast<Fn*>(address);
}

}  // namespace

int IbverbsFunctions::query_port(ibv_context* context, std::uint8_t port,
                                 ibv_port_attr* attr) const {
  // Same logic as verbs.h's ___ibv_query_port, but the fallback goes through
  // the resolved symbol instead of a link-time reference.
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx == nullptr) {
    std::memset(attr, 0, sizeof *attr);
    return query_port_compat(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(context, port, attr, sizeof *attr);
}

std::shared_ptr<const IbverbsLibrary> IbverbsLibrary::load(std::string_view soname) {
  std::shared_ptr<IbverbsLibrary> lib(new IbverbsLibrary());
  lib->soname_ = std::string(soname);
  dlerror();
  // RTLD_NOW: the library's own dependencies resolve now, not at some later call.
  lib->handle_ = dlopen(lib->soname_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib->handle_ == nullptr) {
    throw Error(Code::unavailable,
                "cannot load " + lib->soname_ + " (" + dlerror_text() +
                    "): install Debian's libibverbs1 (rdma-core) and the provider package "
                    "ibverbs-providers to use RDMA; the verbs transport is off");
  }
  lib->fn_ = std::make_unique<IbverbsFunctions>();
  IbverbsFunctions& f = *lib->fn_;
  void* h = lib->handle_;
  const std::string& n = lib->soname_;
  resolve(h, n, "ibv_get_device_list", f.get_device_list);
  resolve(h, n, "ibv_free_device_list", f.free_device_list);
  resolve(h, n, "ibv_get_device_name", f.get_device_name);
  resolve(h, n, "ibv_get_device_guid", f.get_device_guid);
  resolve(h, n, "ibv_open_device", f.open_device);
  resolve(h, n, "ibv_close_device", f.close_device);
  resolve(h, n, "ibv_query_device", f.query_device);
  resolve(h, n, "ibv_query_port", f.query_port_compat);
  resolve(h, n, "ibv_query_gid", f.query_gid);
  resolve(h, n, "ibv_port_state_str", f.port_state_str);
  resolve(h, n, "ibv_alloc_pd", f.alloc_pd);
  resolve(h, n, "ibv_dealloc_pd", f.dealloc_pd);
  resolve(h, n, "ibv_reg_mr", f.reg_mr);
  resolve(h, n, "ibv_dereg_mr", f.dereg_mr);
  resolve(h, n, "ibv_reg_dmabuf_mr", f.reg_dmabuf_mr, /*required=*/false);
  resolve(h, n, "ibv_create_comp_channel", f.create_comp_channel);
  resolve(h, n, "ibv_destroy_comp_channel", f.destroy_comp_channel);
  resolve(h, n, "ibv_create_cq", f.create_cq);
  resolve(h, n, "ibv_destroy_cq", f.destroy_cq);
  resolve(h, n, "ibv_get_cq_event", f.get_cq_event);
  resolve(h, n, "ibv_ack_cq_events", f.ack_cq_events);
  resolve(h, n, "ibv_wc_status_str", f.wc_status_str);
  resolve(h, n, "ibv_create_qp", f.create_qp);
  resolve(h, n, "ibv_modify_qp", f.modify_qp);
  resolve(h, n, "ibv_query_qp", f.query_qp);
  resolve(h, n, "ibv_destroy_qp", f.destroy_qp);

  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(f.open_device), &info) != 0 && info.dli_fname != nullptr) {
    lib->path_ = info.dli_fname;
  } else {
    lib->path_ = lib->soname_;
  }
  return lib;
}

IbverbsLibrary::~IbverbsLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

bool IbverbsLibrary::has_dmabuf() const { return fn_->reg_dmabuf_mr != nullptr; }

}  // namespace collectived::engine::transport::verbs

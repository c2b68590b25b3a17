// libibverbs, loaded at run time: one object that dlopens libibverbs.so.1 and
// resolves every symbol the verbs transport calls, at load, into a table.
//
// Why: a binary linked against libibverbs does not start on a machine without
// it, and one that resolves lazily fails at the first call of a missing symbol
// ("undefined symbol: ibv_dereg_mr") in the middle of a job. Here a missing
// library or symbol is one Error at start, naming it and the Debian package.
//
// This header is free of <infiniband/verbs.h>: the table's type, with the
// verbs types in its signatures, lives in ibverbs_functions.h, which only the
// verbs transport includes.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace collectived::engine::transport::verbs {

struct IbverbsFunctions;

/// The dlopen'ed libibverbs and its resolved function table. Non-copyable; share
/// it (shared_ptr) with every object that calls verbs, so the library outlives them.
class IbverbsLibrary {
 public:
  /// The soname of rdma-core's libibverbs (Debian: libibverbs1).
  static constexpr std::string_view kDefaultSoname = "libibverbs.so.1";

  /// dlopens `soname` and resolves every required symbol. Throws Error(unavailable)
  /// naming the library or the first missing symbol, dlerror()'s text and the
  /// Debian package to install. Optional symbols (ibv_reg_dmabuf_mr) may be absent.
  static std::shared_ptr<const IbverbsLibrary> load(std::string_view soname = kDefaultSoname);

  ~IbverbsLibrary();
  IbverbsLibrary(const IbverbsLibrary&) = delete;
  IbverbsLibrary& operator=(const IbverbsLibrary&) = delete;

  /// The resolved functions (ibverbs_functions.h).
  const IbverbsFunctions& fn() const { return *fn_; }

  /// The soname as asked for and the file it resolved to (dladdr), for logs and `doctor`.
  const std::string& soname() const { return soname_; }
  const std::string& path() const { return path_; }

  /// Whether ibv_reg_dmabuf_mr exists (rdma-core >= 34): the dma-buf route of GPUDirect RDMA.
  bool has_dmabuf() const;

 private:
  IbverbsLibrary() = default;

  void* handle_ = nullptr;
  std::string soname_;
  std::string path_;
  std::unique_ptr<IbverbsFunctions> fn_;
};

}  // namespace collectived::engine::transport::verbs

// CPU tensors in memory the daemon maps: the connection to the node's daemon
// that a process's groups share, and a CPU allocator whose large blocks are
// memfd memory registered with that daemon (collective_host_alloc), so that
// collectives on CPU tensors run on the tensors themselves, with no copy.
//
// Why an allocator (issue G item 5): torch's CPU tensors live in private
// anonymous memory that the daemon cannot map. Copying each operation through
// shared staging costs two passes over the data per rank, which on a small
// host is as much as the collective itself. DDP's buckets, FSDP's flat
// parameters and the tensors users allocate after init_process_group come
// from the allocator, so the hot path needs no copy; anything else (tensors
// from before, numpy views, small tensors) is staged through the same pool.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/collective.h"

namespace collectived::client::torch_backend {

/// One connection to the node's daemon, shared by the process groups of a
/// process and by the allocator. Never destroyed while blocks from it may
/// still back tensors: collective_disconnect unmaps them.
class NodeConnection {
 public:
  /// Connects to `socket` (empty: $COLLECTIVED_SOCKET, else the default).
  /// Throws c10::Error saying what was tried and how to fix it.
  explicit NodeConnection(const std::string& socket);
  ~NodeConnection();
  NodeConnection(const NodeConnection&) = delete;
  NodeConnection& operator=(const NodeConnection&) = delete;

  collective_client_t* get() const { return client_; }
  const std::string& socket() const { return socket_; }
  /// The daemon still answers (a status round trip).
  bool alive();

 private:
  collective_client_t* client_ = nullptr;
  std::string socket_;
};

/// The process's connection for `socket`: the existing one while its daemon
/// answers, else a new one. Connections are kept for the life of the process
/// (see NodeConnection).
std::shared_ptr<NodeConnection> node_connection(const std::string& socket);

/// Blocks of registered host memory, in size classes (four per power of two,
/// at most 25% rounding), cached after free up to a byte limit.
class SharedHostAllocator final : public c10::Allocator {
 public:
  /// Allocations below this many bytes go to the allocator that was there
  /// before (small tensors are many, and cheap to stage).
  static constexpr std::size_t kMinBytes = 64 << 10;

  /// Puts the allocator in place of torch's CPU allocator (once per process;
  /// later calls return the same one). COLLECTIVED_TORCH_CPU_ALLOCATOR=0
  /// leaves torch's allocator: then every CPU collective is staged.
  static SharedHostAllocator* install(std::shared_ptr<NodeConnection> node);
  /// The installed allocator, or null.
  static SharedHostAllocator* installed();

  c10::DataPtr allocate(std::size_t n) override;
  /// Frees what this allocator handed out, ours or the fallback's (torch's
  /// raw_allocate/raw_deallocate, used by its matrix kernels' scratch).
  c10::DeleterFnPtr raw_deleter() const override { return &SharedHostAllocator::free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  /// Registered memory for staging, whatever its size. Throws c10::Error.
  c10::DataPtr allocate_registered(std::size_t n);
  /// [p, p + bytes) lies in one live block of this allocator's connection.
  bool registered(const void* p, std::size_t bytes) const;
  const std::shared_ptr<NodeConnection>& node() const { return node_; }

  /// In a child after fork(): the blocks are the parent's shared mappings,
  /// and the connection is the parent's; the child allocates as torch would.
  void forked();

 private:
  SharedHostAllocator(std::shared_ptr<NodeConnection> node, c10::Allocator* fallback,
                      std::size_t cache_limit);
  static void free_block(void* ctx);
  void release(void* p);
  static std::size_t size_class(std::size_t n);

  std::shared_ptr<NodeConnection> node_;
  c10::Allocator* fallback_;
  const std::size_t cache_limit_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> live_;                 // base -> class bytes
  std::map<std::size_t, std::vector<void*>> cached_;           // class bytes -> free blocks
  std::size_t cached_bytes_ = 0;
  bool forked_ = false;
  bool failed_ = false;  // registration refused once: the fallback from then on
};

}  // namespace collectived::client::torch_backend

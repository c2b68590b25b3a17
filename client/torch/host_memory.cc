#include "client/torch/host_memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>

namespace collectived::client::torch_backend {

namespace {

std::string resolved_socket(const std::string& socket) {
  if (!socket.empty()) return socket;
  if (const char* env = std::getenv("COLLECTIVED_SOCKET"); env != nullptr && env[0] != '\0') {
    return env;
  }
  return COLLECTIVE_DEFAULT_SOCKET;
}

// The allocator torch calls (process-global by torch's design: c10 keeps one
// CPU allocator per process). Never freed: tensors may outlive everything.
std::atomic<SharedHostAllocator*> g_allocator{nullptr};

}  // namespace

NodeConnection::NodeConnection(const std::string& socket) : socket_(resolved_socket(socket)) {
  const std::string name = "torch pid " + std::to_string(::getpid());
  const collective_result_t r = collective_connect(socket_.c_str(), name.c_str(), &client_);
  TORCH_CHECK(r == COLLECTIVE_OK, "collectived: no daemon at ", socket_, " (",
              collective_last_error(),
              "). Start collectived on this node (systemctl start collectived), or point "
              "COLLECTIVED_SOCKET at the socket of a running one (its client.socket).");
}

NodeConnection::~NodeConnection() {
  if (client_ != nullptr) collective_disconnect(client_);
}

bool NodeConnection::alive() {
  collective_status_t s{};
  return collective_status(client_, &s) == COLLECTIVE_OK;
}

std::shared_ptr<NodeConnection> node_connection(const std::string& socket) {
  static std::mutex mu;
  // Every connection made stays referenced here: blocks registered on one
  // must stay mapped while tensors may use them (see NodeConnection).
  static auto* all = new std::vector<std::shared_ptr<NodeConnection>>();
  const std::string path = resolved_socket(socket);
  std::lock_guard lock(mu);
  for (auto it = all->rbegin(); it != all->rend(); ++it) {
    if ((*it)->socket() == path) {
      if ((*it)->alive()) return *it;
      break;  // its daemon is gone: a new connection, the old one stays mapped
    }
  }
  all->push_back(std::make_shared<NodeConnection>(path));
  return all->back();
}

SharedHostAllocator::SharedHostAllocator(std::shared_ptr<NodeConnection> node,
                                         c10::Allocator* fallback, std::size_t cache_limit)
    : node_(std::move(node)), fallback_(fallback), cache_limit_(cache_limit) {}

SharedHostAllocator* SharedHostAllocator::installed() { return g_allocator.load(); }

SharedHostAllocator* SharedHostAllocator::install(std::shared_ptr<NodeConnection> node) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (auto* a = g_allocator.load()) return a;
  if (const char* env = std::getenv("COLLECTIVED_TORCH_CPU_ALLOCATOR");
      env != nullptr && std::strcmp(env, "0") == 0) {
    return nullptr;
  }
  std::size_t limit = std::size_t{1} << 30;
  if (const char* env = std::getenv("COLLECTIVED_TORCH_CACHE_BYTES"); env != nullptr && env[0]) {
    limit = std::strtoull(env, nullptr, 10);
  }
  auto* a = new SharedHostAllocator(std::move(node), c10::GetCPUAllocator(), limit);
  // A forked child (DataLoader workers) must not hand out the parent's
  // shared blocks, nor talk on the parent's socket.
  static bool at_fork = [] {
    return ::pthread_atfork(nullptr, nullptr, [] {
      if (auto* x = g_allocator.load()) x->forked();
    }) == 0;
  }();
  (void)at_fork;
  g_allocator.store(a);
  // Above the default's priority 0, so that torch's later defaults do not win.
  c10::SetCPUAllocator(a, /*priority=*/10);
  return a;
}

void SharedHostAllocator::forked() {
  // Called in the child only, single-threaded: no lock may be held by a
  // thread that no longer exists, so the state is replaced, not locked.
  new (&mu_) std::mutex();
  forked_ = true;
}

std::size_t SharedHostAllocator::size_class(std::size_t n) {
  // Four classes per power of two, pages at least.
  const std::size_t page = 4096;
  if (n <= page) return page;
  const int top = std::bit_width(n - 1);            // 2^(top-1) < n <= 2^top
  const std::size_t step = std::max<std::size_t>(page, std::size_t{1} << (top - 3));
  return (n + step - 1) / step * step;
}

c10::DataPtr SharedHostAllocator::allocate(std::size_t n) {
  {
    std::lock_guard lock(mu_);
    if (n < kMinBytes || forked_ || failed_) return fallback_->allocate(n);
  }
  try {
    return allocate_registered(n);
  } catch (const c10::Error&) {
    // The daemon refused (memory.max_registered_bytes, or it is gone): torch's
    // own memory from now on; collectives on it are staged.
    std::lock_guard lock(mu_);
    failed_ = true;
    return fallback_->allocate(n);
  }
}

c10::DataPtr SharedHostAllocator::allocate_registered(std::size_t n) {
  const std::size_t bytes = size_class(std::max<std::size_t>(n, 1));
  void* p = nullptr;
  {
    std::lock_guard lock(mu_);
    TORCH_CHECK(!forked_, "collectived: registered memory is not available in a forked child");
    auto it = cached_.find(bytes);
    if (it != cached_.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= bytes;
    }
  }
  if (p == nullptr) {
    const collective_result_t r = collective_host_alloc(node_->get(), bytes, &p);
    TORCH_CHECK(r == COLLECTIVE_OK, "collectived: registering ", bytes,
                " bytes of host memory with the daemon at ", node_->socket(), ": ",
                collective_last_error());
  }
  {
    std::lock_guard lock(mu_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
  }
  return c10::DataPtr(p, p, &SharedHostAllocator::free_block, c10::Device(c10::DeviceType::CPU));
}

void SharedHostAllocator::free_block(void* ctx) {
  if (auto* a = g_allocator.load()) a->release(ctx);
}

void SharedHostAllocator::release(void* p) {
  std::unique_lock lock(mu_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == live_.end()) {
    // The fallback's memory, freed through raw_deallocate.
    lock.unlock();
    if (c10::DeleterFnPtr d = fallback_->raw_deleter()) d(p);
    return;
  }
  if (forked_) return;  // the parent's block: it stays the parent's
  const std::size_t bytes = it->second;
  live_.erase(it);
  if (cached_bytes_ + bytes <= cache_limit_) {
    cached_[bytes].push_back(p);
    cached_bytes_ += bytes;
    return;
  }
  lock.unlock();
  collective_host_free(node_->get(), p);
}

bool SharedHostAllocator::registered(const void* p, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  if (forked_) return false;
  auto it = live_.upper_bound(a);
  if (it == live_.begin()) return false;
  --it;
  return a + bytes <= it->first + it->second;
}

void SharedHostAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

}  // namespace collectived::client::torch_backend

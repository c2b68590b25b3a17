#include "engine/transport/verbs/device.h"

#include "engine/transport/verbs/pair_impl.h"

namespace collectived::engine::transport::verbs {

// ---- Device -----------------------------------------------------------------------

struct Device::Impl {
  std::shared_ptr<Core> core;
  std::mutex pairs_mu;
  std::vector<std::weak_ptr<Pair::Impl>> pairs;
  std::atomic<std::uint64_t> pairs_version{0};
  int wake_fd = -1;
  std::atomic<bool> stop{false};
  std::thread progress;

  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  // Busy-polls every pair's CQ; after spin_us without work yields the CPU, and
  // after yield_us without work arms the CQs and sleeps on the completion channel
  // (a verbs event) or the wake descriptor (new pair, stop).
  void progress_loop() {
    std::vector<std::shared_ptr<Pair::Impl>> snapshot;
    std::uint64_t seen = ~0ull;
    auto idle_since = Clock::now();
    const std::chrono::microseconds spin(core->options.spin_us);
    const std::chrono::microseconds yield(std::max(core->options.spin_us, core->options.yield_us));
    while (!stop.load(std::memory_order_relaxed)) {
      // A pair whose owner let go is referenced by the snapshot alone: drop it here.
      bool stale = false;
      for (auto& p : snapshot) stale = stale || p.use_count() == 1;
      if (stale || pairs_version.load() != seen) {
        std::lock_guard lock(pairs_mu);
        seen = pairs_version.load();
        snapshot.clear();
        for (auto it = pairs.begin(); it != pairs.end();) {
          if (auto sp = it->lock()) {
            snapshot.push_back(std::move(sp));
            ++it;
          } else {
            it = pairs.erase(it);
          }
        }
      }
      int work = 0;
      for (auto& p : snapshot) work += p->poll();
      if (work > 0) {
        idle_since = Clock::now();
        continue;
      }
      const auto idle = Clock::now() - idle_since;
      if (idle < spin) continue;
      if (idle < yield) {
        sched_yield();
        continue;
      }
      for (auto& p : snapshot) p->arm();
      // A completion between the last poll and arming raised no event: poll again.
      for (auto& p : snapshot) work += p->poll();
      if (work > 0) {
        idle_since = Clock::now();
        continue;
      }
      pollfd fds[2] = {{core->channel->fd(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
      // The wake descriptor covers stop and new pairs; the timeout is a safety net.
      const int ready = ::poll(fds, 2, 1000);
      // Read and acknowledge every event now (ibv_destroy_cq waits for read events to be acked).
      ibv_cq* cq = nullptr;
      void* user = nullptr;
      while (core->fn().get_cq_event(core->channel->get(), &cq, &user) == 0) {
        core->fn().ack_cq_events(cq, 1);
      }
      std::uint64_t v = 0;
      while (::read(wake_fd, &v, sizeof v) > 0) {
      }
      // After a wake-up, busy-poll again from the start (not after the timeout:
      // an idle device goes straight back to sleep).
      if (ready > 0) idle_since = Clock::now();
    }
  }

  ~Impl() {
    stop = true;
    if (progress.joinable()) {
      wake();
      progress.join();
    }
    if (wake_fd >= 0) ::close(wake_fd);
  }
};

Device::Device(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Device::~Device() {
  // Pairs that outlive the device fail; their core (PD, pool) stays until they go.
  std::lock_guard lock(impl_->pairs_mu);
  for (auto& w : impl_->pairs) {
    if (auto p = w.lock()) {
      std::lock_guard plock(p->mu);
      p->set_broken(Code::aborted, "verbs device " + impl_->core->where() + " was closed");
    }
  }
}

std::unique_ptr<Device> Device::open(std::shared_ptr<const IbverbsLibrary> lib,
                                     const Options& options, std::string local_node,
                                     std::optional<config::VerbsHca> hca) {
  if (!hca) {
    for (const DeviceInfo& d : discover_devices(*lib)) {
      for (const PortInfo& p : d.ports) {
        if (p.active && !hca) hca = config::VerbsHca{d.name, p.number};
      }
    }
    if (!hca) {
      throw Error(Code::unavailable, "no active RDMA port: " + no_devices_reason());
    }
  }
  auto core = std::make_shared<Core>();
  core->lib = lib;
  core->options = options;
  core->node = std::move(local_node);
  core->port = hca->port;
  core->ctx = std::make_unique<Context>(lib, hca->name);
  const IbverbsFunctions& f = lib->fn();

  ibv_device_attr dattr{};
  if (const int rc = f.query_device(core->ctx->get(), &dattr); rc != 0) {
    throw_errno("ibv_query_device " + hca->name, rc > 0 ? rc : errno);
  }
  if (hca->port < 1 || hca->port > dattr.phys_port_cnt) {
    throw Error(Code::not_found, "RDMA device " + hca->name + " has no port " +
                                     std::to_string(hca->port) + " (ports 1.." +
                                     std::to_string(dattr.phys_port_cnt) + "; verbs.hcas)");
  }
  core->max_qp_wr = static_cast<std::uint32_t>(dattr.max_qp_wr);
  core->max_sge = static_cast<std::uint32_t>(dattr.max_sge);
  core->max_cqe = static_cast<std::uint32_t>(dattr.max_cqe);
  const PortInfo port = query_port_info(f, core->ctx->get(), hca->name, hca->port);
  if (!port.active) {
    throw Error(Code::unavailable, "RDMA port " + core->where() + " is " + port.state +
                                       ", not active (cable, switch or subnet manager)");
  }
  core->ethernet = port.link_layer == "Ethernet";
  core->lid = port.lid;
  if (options.gid_index >= 0) {
    core->gid_index = options.gid_index;
  } else {
    const std::optional<int> chosen = choose_gid_index(port);
    if (!chosen) throw Error(Code::unavailable, "RDMA port " + core->where() + " has no GID");
    core->gid_index = *chosen;
  }
  ibv_gid gid{};
  if (f.query_gid(core->ctx->get(), static_cast<std::uint8_t>(hca->port), core->gid_index, &gid) !=
      0) {
    throw Error(Code::invalid_argument, "GID index " + std::to_string(core->gid_index) + " of " +
                                            core->where() + " cannot be read (verbs.gid_index)");
  }
  std::memcpy(core->gid, gid.raw, 16);
  core->gid_text = format_gid(gid.raw);
  core->gid_type = read_gid_attrs("/sys", hca->name, hca->port, core->gid_index).type;
  core->mtu = port.active_mtu;
  if (options.mtu != 0) core->mtu = std::min(core->mtu, options.mtu);
  if (core->max_sge < 3) {
    throw Error(Code::unavailable, core->where() + " supports " + std::to_string(core->max_sge) +
                                       " scatter-gather entries per work request; 3 are needed");
  }

  core->pd = std::make_unique<ProtectionDomain>(*core->ctx);
  core->channel = std::make_unique<CompletionChannel>(*core->ctx);
  core->pool = RegisteredPool::create(*core->pd, options.pool_bytes);
  core->mr_cache = std::make_unique<MrCache>(*core->pd, options.mr_cache_entries);

  auto impl = std::make_unique<Impl>();
  impl->core = core;
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0) throw_errno("eventfd for the verbs progress thread");
  Impl* raw = impl.get();
  impl->progress = std::thread([raw] { raw->progress_loop(); });
  return std::unique_ptr<Device>(new Device(std::move(impl)));
}

Buffer Device::allocate(std::size_t size) {
  std::shared_ptr<RegisteredPool::Block> block = impl_->core->pool->allocate(size);
  Buffer b;
  b.data_ = block->data();
  b.size_ = size;
  b.lkey_ = block->lkey();
  b.owner_ = std::move(block);
  return b;
}

Buffer Device::register_memory(void* data, std::size_t size) {
  std::shared_ptr<MemoryRegion> mr = impl_->core->mr_cache->get(data, size);
  Buffer b;
  b.data_ = static_cast<std::byte*>(data);
  b.size_ = size;
  b.lkey_ = mr->lkey();
  b.owner_ = std::move(mr);
  return b;
}

void Device::invalidate(void* data, std::size_t size) { impl_->core->mr_cache->invalidate(data, size); }

std::shared_ptr<void> Device::invalidator(void* data, std::size_t size) {
  struct Invalidator {
    std::weak_ptr<Core> core;
    void* data;
    std::size_t size;
    ~Invalidator() {
      if (auto c = core.lock(); c && c->mr_cache) c->mr_cache->invalidate(data, size);
    }
  };
  return std::shared_ptr<void>(new Invalidator{impl_->core, data, size});
}

std::unique_ptr<Pair> Device::connect(ExchangeChannel& channel, const std::string& peer_node,
                                      Clock::time_point deadline) {
  const std::shared_ptr<Core>& core = impl_->core;
  const Options& o = core->options;
  auto p = std::make_shared<Pair::Impl>();
  p->core = core;
  p->peer = peer_node;
  p->slot_count = o.slots_per_peer;
  p->slot_payload = o.slot_bytes;
  p->slot_stride = kHeaderBytes + o.slot_bytes;
  p->slots = core->pool->allocate(p->slot_count * p->slot_stride);
  const std::uint64_t sq = std::min<std::uint64_t>(2 * o.slots_per_peer + 2, core->max_qp_wr);
  const std::uint64_t cqe = std::min<std::uint64_t>(2 * sq * o.qps_per_connection + 16,
                                                    core->max_cqe);
  p->cq = std::make_unique<CompletionQueue>(*core->ctx, static_cast<int>(cqe),
                                            core->channel.get(), p.get());
  {
    std::lock_guard lock(impl_->pairs_mu);
    impl_->pairs.push_back(p);
    ++impl_->pairs_version;
  }
  impl_->wake();
  try {
    p->establish(channel, deadline);
  } catch (const Error& e) {
    throw Error(e.code(), "connecting verbs to node " + peer_node + " from " + core->where() +
                              ": " + e.what());
  }
  return std::unique_ptr<Pair>(new Pair(std::move(p)));
}

std::string Device::describe() const {
  const Core& c = *impl_->core;
  std::ostringstream s;
  s << c.ctx->name() << " port " << c.port << " (" << (c.ethernet ? "Ethernet" : "InfiniBand");
  if (c.ethernet) {
    s << ", " << (c.gid_type.empty() ? "RoCE" : c.gid_type) << " gid " << c.gid_index << ' '
      << c.gid_text;
  } else {
    s << ", lid " << c.lid;
  }
  s << ", mtu " << c.mtu << ", pool " << size_text(c.pool->capacity()) << ")";
  return s.str();
}

const std::string& Device::name() const { return impl_->core->ctx->name(); }
std::uint32_t Device::port() const { return impl_->core->port; }

DeviceStats Device::stats() const {
  const Core& c = *impl_->core;
  DeviceStats s;
  s.pool_bytes = c.pool->capacity();
  s.pool_in_use = c.pool->in_use();
  s.mr_cache_entries = c.mr_cache->size();
  s.mr_cache_hits = c.mr_cache->hits();
  s.mr_cache_misses = c.mr_cache->misses();
  return s;
}

std::vector<std::unique_ptr<Device>> open_devices(std::shared_ptr<const IbverbsLibrary> lib,
                                                  const Options& options,
                                                  const std::string& local_node) {
  std::vector<config::VerbsHca> wanted = options.hcas;
  if (wanted.empty()) {
    for (const DeviceInfo& d : discover_devices(*lib)) {
      for (const PortInfo& p : d.ports) {
        if (p.active) wanted.push_back({d.name, p.number});
      }
    }
    if (wanted.empty()) throw Error(Code::unavailable, "no active RDMA port: " + no_devices_reason());
  }
  std::vector<std::unique_ptr<Device>> out;
  std::string reasons;
  for (const config::VerbsHca& h : wanted) {
    try {
      out.push_back(Device::open(lib, options, local_node, h));
    } catch (const Error& e) {
      reasons += (reasons.empty() ? "" : "; ") + std::string(e.what());
    }
  }
  if (out.empty()) throw Error(Code::unavailable, "no RDMA port could be opened: " + reasons);
  return out;
}

}  // namespace collectived::engine::transport::verbs

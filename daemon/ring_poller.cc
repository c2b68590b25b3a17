#include "daemon/ring_poller.h"

#include <pthread.h>

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "daemon/session.h"
#include "ipc/error.h"

namespace collectived::daemon {

RingPoller::RingPoller(std::chrono::microseconds spin) : spin_(spin) {
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw_errno("epoll_create1 for the ring poller");
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) throw_errno("eventfd for the ring poller");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_.get();
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev);
  thread_ = std::thread([this] {
    ::pthread_setname_np(::pthread_self(), "cd-ring-poller");
    run();
  });
}

RingPoller::~RingPoller() {
  stop_ = true;
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

void RingPoller::attach(std::shared_ptr<ClientSession> session, int doorbell) {
  {
    std::lock_guard lock(mutex_);
    sessions_.emplace_back(std::move(session), doorbell);
    // Edge-triggered, and never read: the descriptor belongs to the client,
    // which could make a read block; an edge per write is all we need.
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLET;
    ev.data.fd = doorbell;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, doorbell, &ev);
  }
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void RingPoller::detach(const ClientSession* session) {
  std::lock_guard lock(mutex_);
  auto it = std::find_if(sessions_.begin(), sessions_.end(),
                         [&](const auto& p) { return p.first.get() == session; });
  if (it == sessions_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second, nullptr);
  sessions_.erase(it);
}

std::size_t RingPoller::attached() const {
  std::lock_guard lock(mutex_);
  return sessions_.size();
}

bool RingPoller::poll_all() {
  std::lock_guard lock(mutex_);
  bool any = false;
  for (auto& [s, fd] : sessions_) any |= s->poll_ring();
  return any;
}

void RingPoller::run() {
  using Clock = std::chrono::steady_clock;
  auto idle_since = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    if (poll_all()) {
      idle_since = Clock::now();
      continue;
    }
    if (Clock::now() - idle_since < spin_) {
      // Yield rather than pause: with more runnable threads than cores (four
      // ranks and the daemon on two), the clients need the CPU to submit.
      sched_yield();
      continue;
    }
    // Going to sleep: announce it, then look once more (see ipc/ring.h).
    bool pending = false;
    {
      std::lock_guard lock(mutex_);
      for (auto& [s, fd] : sessions_) pending |= s->ring_sleep(true);
    }
    if (!pending) {
      epoll_event events[16];
      const int n = ::epoll_wait(epoll_.get(), events, 16, 1000);
      for (int i = 0; i < n; ++i) {
        if (events[i].data.fd == wake_.get()) {
          std::uint64_t v;
          (void)!::read(wake_.get(), &v, sizeof v);  // ours, non-blocking
        }
      }
    }
    {
      std::lock_guard lock(mutex_);
      for (auto& [s, fd] : sessions_) s->ring_sleep(false);
    }
    idle_since = Clock::now();
  }
}

}  // namespace collectived::daemon

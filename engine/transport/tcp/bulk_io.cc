#include "engine/transport/tcp/bulk_io.h"

#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace collectived::engine::transport::tcp {

BulkIo::BulkIo(unsigned threads) {
  threads = std::max(1u, threads);
  for (unsigned i = 0; i < threads; ++i) {
    readers_.emplace_back([this] {
      ::pthread_setname_np(::pthread_self(), "cd-tcp-read");
      serve(reads_, true);
    });
    writers_.emplace_back([this] {
      ::pthread_setname_np(::pthread_self(), "cd-tcp-write");
      serve(writes_, false);
    });
  }
}

BulkIo::~BulkIo() {
  stop_ = true;
  for (Queue* q : {&reads_, &writes_}) {
    std::lock_guard lock(q->mu);  // a waiter checks stop_ under it
    q->cv.notify_all();
  }
  for (auto& t : readers_) t.join();
  for (auto& t : writers_) t.join();
}

void BulkIo::read(int fd, std::byte* dest, std::size_t bytes, Done done) {
  Task t{fd, {iovec{dest, bytes}}, std::move(done)};
  std::lock_guard lock(reads_.mu);
  reads_.tasks.push_back(std::move(t));
  reads_.cv.notify_one();
}

void BulkIo::write(int fd, std::vector<iovec> iov, Done done) {
  Task t{fd, std::move(iov), std::move(done)};
  std::lock_guard lock(writes_.mu);
  writes_.tasks.push_back(std::move(t));
  if (held_ != 0) {
    ++deferred_;
  } else {
    writes_.cv.notify_one();
  }
}

BulkIo::Batch::Batch(BulkIo& io) : io_(io) {
  std::lock_guard lock(io_.writes_.mu);
  ++io_.held_;
}

BulkIo::Batch::~Batch() {
  std::lock_guard lock(io_.writes_.mu);
  if (--io_.held_ != 0) return;
  if (io_.deferred_ >= io_.writers_.size()) {
    io_.writes_.cv.notify_all();
  } else {
    for (unsigned i = 0; i < io_.deferred_; ++i) io_.writes_.cv.notify_one();
  }
  io_.deferred_ = 0;
}

void BulkIo::serve(Queue& q, bool reading) {
  for (;;) {
    Task t;
    {
      std::unique_lock lock(q.mu);
      q.cv.wait(lock, [&] { return stop_ || !q.tasks.empty(); });
      if (stop_) return;
      t = std::move(q.tasks.front());
      q.tasks.pop_front();
    }
    std::size_t moved = 0;
    const int err = transfer(t, reading, moved);
    t.done(err, moved);
  }
}

int BulkIo::transfer(Task& t, bool reading, std::size_t& moved) {
  std::size_t first = 0;  // the first iovec with bytes left
  while (first < t.iov.size()) {
    if (t.iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    ssize_t n;
    if (reading) {
      n = ::recv(t.fd, t.iov[first].iov_base, t.iov[first].iov_len, 0);
      if (n == 0) return -1;
    } else {
      msghdr m{};
      m.msg_iov = t.iov.data() + first;
      m.msg_iovlen = std::min<std::size_t>(t.iov.size() - first, IOV_MAX);
      n = ::sendmsg(t.fd, &m, MSG_NOSIGNAL);
    }
    if (n > 0) {
      moved += static_cast<std::size_t>(n);
      auto left = static_cast<std::size_t>(n);
      while (left > 0) {
        iovec& v = t.iov[first];
        const std::size_t take = std::min(left, v.iov_len);
        v.iov_base = static_cast<std::byte*>(v.iov_base) + take;
        v.iov_len -= take;
        left -= take;
        if (v.iov_len == 0) ++first;
      }
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    // The socket is non-blocking (the event loop shares it): wait for room or
    // bytes in slices, so that a stopping daemon is noticed. A closed
    // connection (shutdown by the owner, reset by the peer) wakes the poll.
    pollfd p{t.fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0};
    const int r = ::poll(&p, 1, 100);
    if (r < 0 && errno != EINTR) return errno;
    if (r == 0 && stop_) return ECANCELED;
  }
  return 0;
}

}  // namespace collectived::engine::transport::tcp

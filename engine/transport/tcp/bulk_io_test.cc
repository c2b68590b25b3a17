// BulkIo on socket pairs: whole transfers in both directions at once, the end
// of stream, a transfer ended by shutdown(2), and a stop with one stalled.
#include "engine/transport/tcp/bulk_io.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

using namespace collectived::engine::transport::tcp;
using namespace std::chrono_literals;

namespace {

struct Pair {
  int fd[2] = {-1, -1};
  Pair() {
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd) == 0);
    for (int f : fd) ::fcntl(f, F_SETFL, ::fcntl(f, F_GETFL) | O_NONBLOCK);  // as Asio leaves them
  }
  ~Pair() {
    for (int f : fd) ::close(f);
  }
};

std::vector<std::byte> pattern(std::size_t n, unsigned k) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((k * 13 + i * 7 + i / 4096) & 0xff);
  return v;
}

struct Result {
  int err;
  std::size_t n;
};

}  // namespace

TEST_CASE("bulk io: 8 MiB each way at once, in pieces, arrive whole") {
  BulkIo io(2);
  CHECK(io.threads() == 2);
  Pair p;
  const auto out0 = pattern(8 << 20, 1), out1 = pattern(8 << 20, 2);
  std::vector<std::byte> in0(out1.size()), in1(out0.size());
  std::promise<Result> w0, w1, r0, r1;
  // Gathered: three pieces, one empty.
  io.write(p.fd[0], {iovec{const_cast<std::byte*>(out0.data()), 1000}, iovec{nullptr, 0},
                     iovec{const_cast<std::byte*>(out0.data()) + 1000, out0.size() - 1000}},
           [&](int e, std::size_t n) { w0.set_value({e, n}); });
  io.write(p.fd[1], {iovec{const_cast<std::byte*>(out1.data()), out1.size()}},
           [&](int e, std::size_t n) { w1.set_value({e, n}); });
  io.read(p.fd[1], in1.data(), in1.size(), [&](int e, std::size_t n) { r1.set_value({e, n}); });
  io.read(p.fd[0], in0.data(), in0.size(), [&](int e, std::size_t n) { r0.set_value({e, n}); });
  for (auto* f : {&w0, &w1, &r0, &r1}) {
    auto fut = f->get_future();
    REQUIRE(fut.wait_for(20s) == std::future_status::ready);
    const Result r = fut.get();
    CHECK(r.err == 0);
    CHECK(r.n == (8u << 20));
  }
  CHECK(in1 == out0);
  CHECK(in0 == out1);
}

TEST_CASE("bulk io: the other side closing ends a read with end of stream and what it got") {
  BulkIo io(1);
  Pair p;
  std::vector<std::byte> in(1 << 20);
  std::promise<Result> r;
  io.read(p.fd[0], in.data(), in.size(), [&](int e, std::size_t n) { r.set_value({e, n}); });
  const auto some = pattern(1000, 3);
  REQUIRE(::write(p.fd[1], some.data(), some.size()) == 1000);
  ::shutdown(p.fd[1], SHUT_WR);
  auto fut = r.get_future();
  REQUIRE(fut.wait_for(10s) == std::future_status::ready);
  const Result got = fut.get();
  CHECK(got.err == -1);
  CHECK(got.n == 1000);
  CHECK(std::memcmp(in.data(), some.data(), 1000) == 0);
}

TEST_CASE("bulk io: shutdown(2) by the owner ends a stalled write; a stop ends a stalled read") {
  Pair p;
  {
    BulkIo io(1);
    // Nobody reads fd[1]: the write stalls once the socket buffer is full.
    const auto big = pattern(32 << 20, 4);
    std::promise<Result> w;
    io.write(p.fd[0], {iovec{const_cast<std::byte*>(big.data()), big.size()}},
             [&](int e, std::size_t n) { w.set_value({e, n}); });
    auto fut = w.get_future();
    CHECK(fut.wait_for(300ms) == std::future_status::timeout);
    ::shutdown(p.fd[0], SHUT_RDWR);
    REQUIRE(fut.wait_for(5s) == std::future_status::ready);
    const Result r = fut.get();
    CHECK(r.err != 0);
    CHECK(r.n < big.size());
  }
  Pair q;
  std::vector<std::byte> in(4096);
  bool called = false;
  std::chrono::steady_clock::time_point t0;
  {
    BulkIo io(1);
    io.read(q.fd[0], in.data(), in.size(), [&](int, std::size_t) { called = true; });
    // One byte of the 4096 arrives: once the reader took it, the read is in
    // progress (a queued one would be dropped by the destructor, as documented).
    const char one = 1;
    REQUIRE(::send(q.fd[1], &one, 1, 0) == 1);
    int pending = 1;
    for (int i = 0; i < 500 && pending > 0; ++i) {
      std::this_thread::sleep_for(10ms);
      REQUIRE(::ioctl(q.fd[0], FIONREAD, &pending) == 0);
    }
    REQUIRE(pending == 0);
    t0 = std::chrono::steady_clock::now();
  }  // nothing more arrives: the destructor ends the read (ECANCELED) and joins
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  CHECK(called);
}

TEST_CASE("bulk io: writes queued under a batch (nested) all go once it ends") {
  // Four writers, six writes: the batch's end wakes them all (notify_all),
  // and a batch of fewer writes than threads one thread per write.
  BulkIo io(4);
  for (int writes : {6, 2}) {
    CAPTURE(writes);
    std::vector<Pair> pairs(static_cast<std::size_t>(writes));
    std::vector<std::vector<std::byte>> out, in;
    std::vector<std::promise<Result>> done(pairs.size()), got(pairs.size());
    {
      BulkIo::Batch outer(io);
      BulkIo::Batch inner(io);
      for (std::size_t k = 0; k < pairs.size(); ++k) {
        out.push_back(pattern(256 << 10, static_cast<unsigned>(k)));
        io.write(pairs[k].fd[0], {iovec{out[k].data(), out[k].size()}},
                 [&done, k](int e, std::size_t n) { done[k].set_value({e, n}); });
      }
    }
    for (std::size_t k = 0; k < pairs.size(); ++k) {
      in.emplace_back(out[k].size());
      io.read(pairs[k].fd[1], in[k].data(), in[k].size(),
              [&got, k](int e, std::size_t n) { got[k].set_value({e, n}); });
    }
    for (std::size_t k = 0; k < pairs.size(); ++k) {
      auto f = done[k].get_future();
      REQUIRE(f.wait_for(5s) == std::future_status::ready);
      const Result r = f.get();
      CHECK(r.err == 0);
      CHECK(r.n == out[k].size());
      auto g = got[k].get_future();
      REQUIRE(g.wait_for(5s) == std::future_status::ready);
      CHECK(g.get().err == 0);
      CHECK(in[k] == out[k]);
    }
  }
}

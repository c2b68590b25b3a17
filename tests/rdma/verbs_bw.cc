// verbs-bw: write bandwidth of the verbs transport between two processes, the
// way ib_write_bw measures it (the writer times from its first post to its
// last local completion; the reader touches no data, it only gives slots
// back). Used by scripts/bench-rdma; not a test.
//
//   verbs-bw --role server --device rxe0 --address 10.99.0.1 --port P --sizes 4096,65536 --bytes N
//   verbs-bw --role client --device rxe1 --address 10.99.0.1 --port P --sizes ...  --bytes N
// The client prints "verbs-bw <size> <iterations> <MB/s>" per size (MB = 10^6 bytes, as perftest).
//
// --transport tcp: the same sizes as a plain TCP stream over the connection
// (send() of `size` bytes at a time, the server reads and counts; timed to the
// server's "done"), the anchor for what TCP gets on the same veth; prints
// "tcp-bw <size> <iterations> <MB/s>".
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <sstream>
#include <vector>

#include "engine/transport/verbs/ibverbs_library.h"
#include "engine/transport/verbs/device.h"
#include "ipc/error.h"
#include "tests/rdma/common.h"
#include "tests/rdma/socket_channel.h"

using namespace collectived;
namespace verbs = collectived::engine::transport::verbs;
using namespace collectived::rdma_test;
using namespace std::chrono_literals;
using verbs::Clock;

namespace {

// The TCP stream of --transport tcp; see the top of the file.
int tcp_bw(SocketChannel& channel, bool server, const std::vector<std::size_t>& sizes,
           std::uint64_t bytes) {
  std::size_t max_size = 1;
  for (std::size_t s : sizes) max_size = std::max(max_size, s);
  std::vector<std::byte> buf(max_size, std::byte{0x5a});
  for (std::size_t size : sizes) {
    const std::uint64_t iterations = std::max<std::uint64_t>(bytes / size, 16);
    const std::uint64_t total = iterations * size;
    if (server) {
      for (std::uint64_t got = 0; got < total;) {
        const ssize_t n = ::recv(channel.fd(), buf.data(), std::min<std::uint64_t>(buf.size(), total - got), 0);
        if (n <= 0) throw Error(Code::system, std::string("tcp-bw recv: ") + (n == 0 ? "closed" : std::strerror(errno)));
        got += static_cast<std::uint64_t>(n);
      }
      channel.send_text("done");
      continue;
    }
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < iterations; ++i) {
      for (std::size_t sent = 0; sent < size;) {
        const ssize_t n = ::send(channel.fd(), buf.data() + sent, size - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw Error(Code::system, std::string("tcp-bw send: ") + std::strerror(errno));
        sent += static_cast<std::size_t>(n);
      }
    }
    if (channel.receive_text(Clock::now() + 120s) != "done") throw Error(Code::protocol, "expected done");
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("tcp-bw %zu %llu %.2f\n", size, static_cast<unsigned long long>(iterations),
                static_cast<double>(total) / seconds / 1e6);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  const bool server = arg(a, "role", "client") == "server";
  try {
    Args defaults = a;
    // The shipped profile's defaults unless told otherwise; verbs retries as shipped.
    if (!defaults.count("slots")) defaults["slots"] = "16";
    if (!defaults.count("slot-bytes")) defaults["slot-bytes"] = std::to_string(512 * 1024);
    if (!defaults.count("retry")) defaults["retry"] = "7";
    if (!defaults.count("pool-bytes")) defaults["pool-bytes"] = std::to_string(64ull << 20);
    const verbs::Options options = options_from(defaults);
    std::vector<std::size_t> sizes;
    {
      std::stringstream ss(arg(a, "sizes", "4096,65536,1048576"));
      for (std::string item; std::getline(ss, item, ',');) sizes.push_back(std::stoull(item));
    }
    const std::uint64_t bytes = std::stoull(arg(a, "bytes", std::to_string(32ull << 20)));
    const std::size_t window = std::stoul(arg(a, "window", "64"));
    const std::string address = arg(a, "address", "10.99.0.1");
    int port = std::stoi(arg(a, "port", "0"));
    const auto deadline = Clock::now() + 60s;

    auto lib = verbs::IbverbsLibrary::load();
    UniqueFd fd;
    if (server) {
      UniqueFd listener = listen_tcp(address, port);
      std::printf("listening %d\n", port);
      std::fflush(stdout);
      fd = accept_tcp(listener.get(), deadline);
    } else {
      fd = connect_tcp(address, port, deadline);
    }
    SocketChannel channel(std::move(fd), server ? "client" : "server");
    if (arg(a, "transport", "verbs") == "tcp") return tcp_bw(channel, server, sizes, bytes);
    auto device = verbs::Device::open(lib, options, server ? "server" : "client",
                                      config::VerbsHca{arg(a, "device", server ? "rxe0" : "rxe1"), 1});
    auto pair = device->connect(channel, server ? "client" : "server", deadline);
    std::fprintf(stderr, "verbs-bw %s: %s\n", server ? "server" : "client", pair->describe().c_str());

    std::size_t max_size = 0;
    for (std::size_t s : sizes) max_size = std::max(max_size, s);
    verbs::Buffer src = device->allocate(std::max<std::size_t>(max_size, 1));
    std::memset(src.data(), 0x5a, src.size());

    for (std::size_t size : sizes) {
      const std::uint64_t iterations = std::max<std::uint64_t>(bytes / size, 16);
      if (server) {
        std::uint64_t got = 0;
        while (got < iterations * size) {
          const verbs::Chunk c = pair->next_chunk(std::nullopt, Clock::now() + 120s);
          got += c.data.size();
          pair->release(c);
        }
        channel.send_text("done");
        continue;
      }
      std::deque<std::uint64_t> inflight;
      const auto start = Clock::now();
      for (std::uint64_t i = 0; i < iterations; ++i) {
        if (inflight.size() >= window) {
          pair->wait_written(inflight.front(), Clock::now() + 120s);
          inflight.pop_front();
        }
        inflight.push_back(pair->post_write(i, src, 0, size));
      }
      while (!inflight.empty()) {
        pair->wait_written(inflight.front(), Clock::now() + 120s);
        inflight.pop_front();
      }
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (channel.receive_text(Clock::now() + 120s) != "done") throw Error(Code::protocol, "expected done");
      std::printf("verbs-bw %zu %llu %.2f\n", size, static_cast<unsigned long long>(iterations),
                  static_cast<double>(iterations * size) / seconds / 1e6);
      std::fflush(stdout);
    }
    const verbs::PairStats st = pair->stats();
    std::fprintf(stderr, "verbs-bw %s: %llu writes, %llu credit stalls, %llu credit messages\n",
                 server ? "server" : "client", static_cast<unsigned long long>(st.writes_posted),
                 static_cast<unsigned long long>(st.credit_stalls),
                 static_cast<unsigned long long>(st.credit_messages));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "verbs-bw %s: %s\n", server ? "server" : "client", e.what());
    return 1;
  }
}

#include "tests/rdma/socket_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "ipc/error.h"

namespace collectived::rdma_test {
namespace {

int remaining_ms(verbs::Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - verbs::Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 60000));
}

sockaddr_in make_addr(const std::string& address, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) {
    throw Error(Code::invalid_argument, "not an IPv4 address: " + address);
  }
  return sa;
}

}  // namespace

void SocketChannel::send(std::span<const std::byte> message) {
  std::vector<std::byte> frame(4 + message.size());
  const auto n = static_cast<std::uint32_t>(message.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<std::byte>(n >> (8 * i));
  std::copy(message.begin(), message.end(), frame.begin() + 4);
  std::size_t done = 0;
  while (done < frame.size()) {
    const ssize_t w = ::send(fd_.get(), frame.data() + done, frame.size() - done, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw_errno("send to " + peer_);
    done += static_cast<std::size_t>(w);
  }
}

void SocketChannel::read_exact(std::byte* p, std::size_t n, verbs::Clock::time_point deadline) {
  std::size_t done = 0;
  while (done < n) {
    pollfd pfd{fd_.get(), POLLIN, 0};
    const int ms = remaining_ms(deadline);
    const int rc = ::poll(&pfd, 1, ms);
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) throw_errno("poll on the channel to " + peer_);
    if (rc == 0) {
      if (verbs::Clock::now() >= deadline) {
        throw Error(Code::timeout, "no message from " + peer_ + " on the exchange channel before the deadline");
      }
      continue;
    }
    const ssize_t r = ::recv(fd_.get(), p + done, n - done, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno("recv from " + peer_);
    if (r == 0) throw Error(Code::remote, "the exchange channel to " + peer_ + " was closed by the peer");
    done += static_cast<std::size_t>(r);
  }
}

std::vector<std::byte> SocketChannel::receive(verbs::Clock::time_point deadline) {
  std::byte len[4];
  read_exact(len, 4, deadline);
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(len[i]) << (8 * i);
  if (n > (1u << 20)) throw Error(Code::protocol, "oversized message from " + peer_);
  std::vector<std::byte> out(n);
  read_exact(out.data(), n, deadline);
  return out;
}

void SocketChannel::send_text(const std::string& text) {
  send(std::as_bytes(std::span(text.data(), text.size())));
}

std::string SocketChannel::receive_text(verbs::Clock::time_point deadline) {
  const std::vector<std::byte> m = receive(deadline);
  return std::string(reinterpret_cast<const char*>(m.data()), m.size());
}

UniqueFd listen_tcp(const std::string& address, int& port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno("socket");
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa = make_addr(address, port);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    throw_errno("bind " + address + ":" + std::to_string(port));
  }
  if (::listen(fd.get(), 4) != 0) throw_errno("listen");
  socklen_t len = sizeof sa;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len);
  port = ntohs(sa.sin_port);
  return fd;
}

UniqueFd accept_tcp(int listener, verbs::Clock::time_point deadline) {
  pollfd pfd{listener, POLLIN, 0};
  while (true) {
    const int rc = ::poll(&pfd, 1, remaining_ms(deadline));
    if (rc > 0) break;
    if (rc < 0 && errno != EINTR) throw_errno("poll on the listener");
    if (verbs::Clock::now() >= deadline) throw Error(Code::timeout, "no peer connected before the deadline");
  }
  UniqueFd fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd) throw_errno("accept");
  const int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

UniqueFd connect_tcp(const std::string& address, int port, verbs::Clock::time_point deadline) {
  const sockaddr_in sa = make_addr(address, port);
  while (true) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw_errno("socket");
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0) {
      const int one = 1;
      ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    if (verbs::Clock::now() >= deadline) throw_errno("connect to " + address + ":" + std::to_string(port));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace collectived::rdma_test

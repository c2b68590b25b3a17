// A TCP ExchangeChannel for the RDMA tests and tools: 4-byte little-endian
// length, then the message. The daemon hands the verbs transport its
// authenticated peer connection instead.
#pragma once

#include <string>

#include "engine/transport/verbs/device.h"
#include "ipc/fd.h"

namespace collectived::rdma_test {

namespace verbs = engine::transport::verbs;

class SocketChannel : public verbs::ExchangeChannel {
 public:
  SocketChannel(UniqueFd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}
  void send(std::span<const std::byte> message) override;
  std::vector<std::byte> receive(verbs::Clock::time_point deadline) override;
  int fd() const { return fd_.get(); }

  void send_text(const std::string& text);
  std::string receive_text(verbs::Clock::time_point deadline);

 private:
  void read_exact(std::byte* p, std::size_t n, verbs::Clock::time_point deadline);
  UniqueFd fd_;
  std::string peer_;
};

/// A listening TCP socket on `address` (port 0: any); returns it and the port.
UniqueFd listen_tcp(const std::string& address, int& port);
/// Accepts one connection before the deadline.
UniqueFd accept_tcp(int listener, verbs::Clock::time_point deadline);
/// Connects to address:port, retrying until the deadline.
UniqueFd connect_tcp(const std::string& address, int port, verbs::Clock::time_point deadline);

}  // namespace collectived::rdma_test

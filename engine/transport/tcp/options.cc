#include "engine/transport/tcp/options.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>

namespace collectived::engine::transport::tcp {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

std::string_view to_string(PeerState state) {
  switch (state) {
    case PeerState::connecting: return "connecting";
    case PeerState::ready: return "ready";
    case PeerState::dead: return "dead";
  }
  return "unknown";
}

std::string endpoint_text(const tcp::endpoint& endpoint) {
  asio::ip::address a = endpoint.address();
  if (a.is_v6() && a.to_v6().is_v4_mapped()) {
    a = asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
  }
  const std::string port = std::to_string(endpoint.port());
  return a.is_v6() ? "[" + a.to_string() + "]:" + port : a.to_string() + ":" + port;
}

PeerAddress parse_peer_address(const std::string& text) {
  auto bad = [&](const std::string& why) -> Error {
    return Error(Code::invalid_argument, "bad peer address \"" + text + "\": " + why +
                                             " (expected host:port, or [IPv6]:port)");
  };
  PeerAddress out;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      throw bad("no ]:port after the IPv6 address");
    }
    out.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (out.host.find(':') != std::string::npos) throw bad("an IPv6 address needs brackets");
  }
  if (out.host.empty()) throw bad("no host");
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); })) {
    throw bad("the port is not a number");
  }
  const unsigned long p = std::stoul(port);
  if (p == 0 || p > 65535) throw bad("the port is not in 1..65535");
  out.port = static_cast<std::uint16_t>(p);
  boost::system::error_code ec;
  const auto ip = asio::ip::make_address(out.host, ec);
  if (!ec) {
    out.key = endpoint_text(tcp::endpoint(ip, out.port));
    out.host = ip.to_string();
  } else {
    for (char& c : out.host) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (out.host.size() > 253) throw bad("the host name is too long");
    out.key = out.host + ":" + port;
  }
  return out;
}

// --- Socket options -------------------------------------------------------------

std::string set_congestion_control(int fd, const std::string& congestion) {
  if (congestion.empty()) return {};
  // Per socket, so that the system's default (which may pace: bbr) does not
  // apply to the peer links; see tcp.congestion_control in the profile.
  if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion.data(),
                   static_cast<socklen_t>(congestion.size())) != 0) {
    return std::strerror(errno);
  }
  return {};
}

std::string congestion_control_of(int fd) {
  char name[16] = {};
  socklen_t len = sizeof name;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return {};
  return std::string(name, strnlen(name, std::min<std::size_t>(len, sizeof name)));
}

}  // namespace collectived::engine::transport::tcp

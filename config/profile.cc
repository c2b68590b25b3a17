#include "config/profile.h"

#include <arpa/inet.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <sstream>

namespace collectived::config {

namespace {

std::string format_error(const std::string& source, int line, int column,
                         const std::string& key_path, const std::string& reason) {
  std::string out = source;
  if (line > 0) {
    out += ':' + std::to_string(line) + ':' + std::to_string(column);
  }
  return out + ": " + key_path + ": " + reason;
}

}  // namespace

ProfileError::ProfileError(std::string source, int line, int column, std::string key_path,
                           std::string reason)
    : std::runtime_error(format_error(source, line, column, key_path, reason)),
      source_(std::move(source)),
      line_(line),
      column_(column),
      key_path_(std::move(key_path)),
      reason_(std::move(reason)) {}

std::string_view to_string(LogLevel level) {
  switch (level) {
    case LogLevel::trace:
      return "trace";
    case LogLevel::debug:
      return "debug";
    case LogLevel::info:
      return "info";
    case LogLevel::warn:
      return "warn";
    case LogLevel::error:
      return "error";
  }
  return "?";
}

std::string_view to_string(TransportKind kind) {
  switch (kind) {
    case TransportKind::local:
      return "local";
    case TransportKind::tcp:
      return "tcp";
    case TransportKind::verbs:
      return "verbs";
  }
  return "?";
}

namespace {

constexpr std::string_view kEmbeddedSource = "<embedded default>";

// Where a value came from, for error messages.
struct Context {
  std::string source;  // layer: file path, "<embedded default>" or "--set k=v"
  std::string path;    // dotted key path of the value being read
  YAML::Mark key_mark = YAML::Mark::null_mark();  // for empty values, whose mark is past the key
  bool use_marks = true;  // --set values: their marks would point into the value only

  [[noreturn]] void fail(const YAML::Node& at, const std::string& reason) const {
    YAML::Mark mark = at.IsDefined() ? at.Mark() : YAML::Mark::null_mark();
    if ((mark.line < 0 || at.IsNull()) && key_mark.line >= 0) mark = key_mark;
    fail_at(mark, reason);
  }

  [[noreturn]] void fail_at(const YAML::Mark& mark, const std::string& reason) const {
    if (!use_marks || mark.line < 0) throw ProfileError(source, 0, 0, path, reason);
    throw ProfileError(source, mark.line + 1, mark.column + 1, path, reason);
  }

  Context element(std::size_t index) const {
    Context c = *this;
    c.path += '[' + std::to_string(index) + ']';
    return c;
  }
};

// ---- Typed reads -----------------------------------------------------------

std::string_view node_kind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "nothing";
    default:
      return "a scalar";
  }
}

const std::string& scalar(const YAML::Node& node, const Context& ctx, std::string_view expected) {
  if (!node.IsScalar()) {
    ctx.fail(node, "expected " + std::string(expected) + ", got " + std::string(node_kind(node)));
  }
  return node.Scalar();
}

std::string quoted(std::string_view text) { return '\'' + std::string(text) + '\''; }

// Strict decimal: optional sign and digits, nothing else (no "0x10", "1e3", "12abc").
std::optional<std::int64_t> parse_int(std::string_view text, bool& overflow) {
  overflow = false;
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  std::int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) {
    overflow = true;
    return std::nullopt;
  }
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::int64_t as_int(const YAML::Node& node, const Context& ctx, std::int64_t min,
                    std::int64_t max) {
  const std::string& text = scalar(node, ctx, "an integer");
  bool overflow = false;
  std::optional<std::int64_t> value = parse_int(text, overflow);
  if (!value && !overflow) ctx.fail(node, "expected an integer, got " + quoted(text));
  if (overflow || *value < min || *value > max) {
    ctx.fail(node,
             "out of range " + std::to_string(min) + ".." + std::to_string(max) + ", got " + text);
  }
  return *value;
}

std::uint32_t as_uint(const YAML::Node& node, const Context& ctx, std::uint32_t min,
                      std::uint32_t max) {
  return static_cast<std::uint32_t>(as_int(node, ctx, min, max));
}

Millis as_millis(const YAML::Node& node, const Context& ctx, std::int64_t min, std::int64_t max) {
  return Millis(as_int(node, ctx, min, max));
}

struct SizeUnit {
  std::string_view suffix;
  std::uint64_t factor;
};

constexpr std::uint64_t KiB = 1024;
constexpr std::uint64_t MiB = KiB * 1024;
constexpr std::uint64_t GiB = MiB * 1024;
constexpr std::uint64_t TiB = GiB * 1024;

constexpr std::array<SizeUnit, 14> kSizeUnits{{
    {"", 1},
    {"B", 1},
    {"KiB", KiB},
    {"MiB", MiB},
    {"GiB", GiB},
    {"TiB", TiB},
    {"K", KiB},
    {"M", MiB},
    {"G", GiB},
    {"T", TiB},
    {"KB", 1000},
    {"MB", 1000 * 1000},
    {"GB", 1000 * 1000 * 1000},
    {"TB", 1000ULL * 1000 * 1000 * 1000},
}};

// The largest binary unit that divides the size exactly: "64MiB", "1000B".
std::string format_size(std::uint64_t bytes) {
  constexpr std::array<SizeUnit, 4> units{{{"TiB", TiB}, {"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB}}};
  for (const SizeUnit& unit : units) {
    if (bytes != 0 && bytes % unit.factor == 0) {
      return std::to_string(bytes / unit.factor) + std::string(unit.suffix);
    }
  }
  return std::to_string(bytes) + "B";
}

[[noreturn]] void bad_size(const YAML::Node& node, const Context& ctx, const std::string& text) {
  ctx.fail(node,
           "expected a size: a byte count or a number with B, KiB, MiB, GiB, TiB, "
           "K, M, G, T, KB, MB, GB or TB, got " +
               quoted(text));
}

std::uint64_t as_size(const YAML::Node& node, const Context& ctx, std::uint64_t min,
                      std::uint64_t max) {
  const std::string& text = scalar(node, ctx, "a size");
  std::string_view rest = text;
  std::uint64_t number = 0;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), number);
  if (ec == std::errc::invalid_argument) bad_size(node, ctx, text);
  bool overflow = ec == std::errc::result_out_of_range;
  rest.remove_prefix(static_cast<std::size_t>(end - rest.data()));
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  const auto unit = std::find_if(kSizeUnits.begin(), kSizeUnits.end(),
                                 [&](const SizeUnit& u) { return u.suffix == rest; });
  if (unit == kSizeUnits.end()) bad_size(node, ctx, text);
  overflow = overflow || number > std::numeric_limits<std::uint64_t>::max() / unit->factor;
  const std::uint64_t bytes = overflow ? 0 : number * unit->factor;
  if (overflow || bytes < min || bytes > max) {
    ctx.fail(node, "out of range " + format_size(min) + ".." + format_size(max) + ", got " +
                       quoted(text));
  }
  return bytes;
}

template <class T>
struct EnumName {
  std::string_view name;
  T value;
};

template <class T>
T as_enum(const YAML::Node& node, const Context& ctx, std::span<const EnumName<T>> names) {
  const std::string& text = scalar(node, ctx, "a name");
  std::string choices;
  for (const EnumName<T>& n : names) {
    if (n.name == text) return n.value;
    choices += (choices.empty() ? "" : ", ") + std::string(n.name);
  }
  ctx.fail(node, "expected one of " + choices + ", got " + quoted(text));
}

// Empty (null) means the empty string, so `name:` and `name: ""` agree.
// Well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

std::string as_string(const YAML::Node& node, const Context& ctx) {
  if (node.IsNull()) return {};
  const std::string& s = scalar(node, ctx, "a string");
  // The YAML emitter writes invalid UTF-8 as U+FFFD, so such a value would
  // not survive --print-profile and loading again (found by profile_fuzz: a
  // socket path of 68 bytes came back as 210).
  if (!valid_utf8(s)) ctx.fail(node, "is not valid UTF-8");
  return s;
}

// Empty (null) means the empty list.
template <class Item>
void for_each_item(const YAML::Node& node, const Context& ctx, Item&& item) {
  if (node.IsNull()) return;
  if (!node.IsSequence()) ctx.fail(node, "expected a list, got " + std::string(node_kind(node)));
  for (std::size_t i = 0; i < node.size(); ++i) item(node[i], ctx.element(i));
}

std::vector<std::uint32_t> as_uint_list(const YAML::Node& node, const Context& ctx) {
  std::vector<std::uint32_t> out;
  for_each_item(node, ctx, [&](const YAML::Node& item, const Context& c) {
    out.push_back(as_uint(item, c, 0, std::numeric_limits<std::uint32_t>::max()));
  });
  return out;
}

// ---- Value-specific checks ---------------------------------------------------

std::string as_socket_path(const YAML::Node& node, const Context& ctx) {
  std::string path = as_string(node, ctx);
  if (path.empty() || path.front() != '/') {
    ctx.fail(node, "must be an absolute path, got " + quoted(path));
  }
  // sun_path holds the terminating NUL as well.
  constexpr std::size_t kMax = sizeof(sockaddr_un{}.sun_path);
  if (path.size() >= kMax) {
    ctx.fail(node, "is " + std::to_string(path.size()) + " bytes; a Unix socket path must be " +
                       "under " + std::to_string(kMax));
  }
  return path;
}

// A group name as /etc/group holds it: what useradd accepts, without the
// characters that would break the file's format.
std::string as_group_name(const YAML::Node& node, const Context& ctx) {
  std::string name = as_string(node, ctx);
  const bool bad_char = name.find_first_of(":,/ \t\n") != std::string::npos;
  if (name.empty() || name.size() > 32 || bad_char || name.front() == '-') {
    ctx.fail(node, "must be a group name (1-32 characters, no ':', ',', '/' or spaces, not "
                   "starting with '-'), got " + quoted(name));
  }
  return name;
}

std::vector<std::string> as_group_list(const YAML::Node& node, const Context& ctx) {
  std::vector<std::string> out;
  for_each_item(node, ctx,
                [&](const YAML::Node& item, const Context& c) { out.push_back(as_group_name(item, c)); });
  return out;
}

std::uint32_t as_octal_mode(const YAML::Node& node, const Context& ctx) {
  // Always octal, quoted or not: `socket_mode: 660` means chmod 660, never decimal 660.
  const std::string& text = scalar(node, ctx, "an octal mode");
  std::string_view digits = text;
  if (digits.starts_with("0o")) digits.remove_prefix(2);
  std::uint32_t mode = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), mode, 8);
  if (ec == std::errc::invalid_argument || end != digits.data() + digits.size()) {
    ctx.fail(node, "expected an octal mode such as \"0660\", got " + quoted(text));
  }
  if (ec == std::errc::result_out_of_range || mode > 0777) {
    ctx.fail(node, "out of range 0..0777, got " + quoted(text));
  }
  return mode;
}

// A kernel congestion control name (TCP_CA_NAME_MAX: 15 characters), or "".
std::string as_congestion_control(const YAML::Node& node, const Context& ctx) {
  std::string text = as_string(node, ctx);
  const bool ok = text.size() <= 15 && std::all_of(text.begin(), text.end(), [](char ch) {
                    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
                  });
  if (!ok) {
    ctx.fail(node,
             "expected a congestion control name such as cubic (lower case, at most 15 "
             "characters) or empty for the system default, got " +
                 quoted(text));
  }
  return text;
}

std::string as_ip_address(const YAML::Node& node, const Context& ctx) {
  std::string text = as_string(node, ctx);
  unsigned char buffer[sizeof(in6_addr)];
  if (inet_pton(AF_INET, text.c_str(), buffer) != 1 &&
      inet_pton(AF_INET6, text.c_str(), buffer) != 1) {
    ctx.fail(node, "expected an IPv4 or IPv6 address, got " + quoted(text));
  }
  return text;
}

// Parses the digits after the last ':' of `text` as a port in [min, max].
std::optional<std::uint32_t> port_after_colon(std::string_view text, std::size_t colon,
                                              std::uint32_t min, std::uint32_t max) {
  std::string_view digits = text.substr(colon + 1);
  std::uint32_t port = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
  if (ec != std::errc() || end != digits.data() + digits.size() || port < min || port > max) {
    return std::nullopt;
  }
  return port;
}

// "" (off), "host:port" with an IP literal ("[v6]:port"), or an absolute socket path.
std::string as_listen_address(const YAML::Node& node, const Context& ctx) {
  std::string text = as_string(node, ctx);
  if (text.empty()) return text;
  if (text.front() == '/') {
    constexpr std::size_t kMax = sizeof(sockaddr_un{}.sun_path);
    if (text.size() >= kMax) {
      ctx.fail(node, "is " + std::to_string(text.size()) + " bytes; a Unix socket path must be " +
                         "under " + std::to_string(kMax));
    }
    return text;
  }
  const std::size_t colon = text.rfind(':');
  std::string host = colon == std::string::npos ? std::string() : text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  unsigned char buffer[sizeof(in6_addr)];
  if (colon == std::string::npos || !port_after_colon(text, colon, 0, 65535) ||
      (inet_pton(AF_INET, host.c_str(), buffer) != 1 &&
       inet_pton(AF_INET6, host.c_str(), buffer) != 1)) {
    ctx.fail(node, "expected \"\" (off), \"ADDRESS:PORT\" with an IP address (\"[v6]:port\") "
                   "or an absolute Unix socket path, got " + quoted(text));
  }
  return text;
}

std::vector<std::string> as_peer_list(const YAML::Node& node, const Context& ctx) {
  std::vector<std::string> out;
  for_each_item(node, ctx, [&](const YAML::Node& item, const Context& c) {
    std::string text = as_string(item, c);
    const std::size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0 || !port_after_colon(text, colon, 1, 65535)) {
      c.fail(item, "expected \"host:port\" with a port in 1..65535, got " + quoted(text));
    }
    out.push_back(std::move(text));
  });
  return out;
}

std::vector<VerbsHca> as_hca_list(const YAML::Node& node, const Context& ctx) {
  std::vector<VerbsHca> out;
  for_each_item(node, ctx, [&](const YAML::Node& item, const Context& c) {
    const std::string text = as_string(item, c);
    const std::size_t colon = text.find(':');
    VerbsHca hca{text.substr(0, colon), 1};
    if (colon != std::string::npos) {
      std::optional<std::uint32_t> port = port_after_colon(text, colon, 1, 255);
      if (!port) c.fail(item, "expected a port in 1..255 after ':', got " + quoted(text));
      hca.port = *port;
    }
    if (hca.name.empty()) c.fail(item, "expected \"name\" or \"name:port\", got " + quoted(text));
    out.push_back(std::move(hca));
  });
  return out;
}

constexpr std::array<EnumName<TransportKind>, 3> kTransports{{
    {"local", TransportKind::local},
    {"tcp", TransportKind::tcp},
    {"verbs", TransportKind::verbs},
}};

constexpr std::array<EnumName<int>, 5> kAlgorithms{
    {{"auto", 0}, {"ring", 1}, {"direct", 2}, {"pairwise", 3}, {"tree", 4}}};

constexpr std::array<EnumName<LogLevel>, 5> kLogLevels{{
    {"trace", LogLevel::trace},
    {"debug", LogLevel::debug},
    {"info", LogLevel::info},
    {"warn", LogLevel::warn},
    {"error", LogLevel::error},
}};

constexpr std::array<EnumName<std::string_view>, 3> kMpsModes{{
    {"managed", "managed"},
    {"external", "external"},
    {"off", "off"},
}};
constexpr std::array<EnumName<std::string_view>, 3> kClientKernelModes{{
    {"auto", "auto"},
    {"on", "on"},
    {"off", "off"},
}};

std::vector<TransportKind> as_transports(const YAML::Node& node, const Context& ctx) {
  std::vector<TransportKind> out;
  for_each_item(node, ctx, [&](const YAML::Node& item, const Context& c) {
    const TransportKind kind = as_enum<TransportKind>(item, c, kTransports);
    if (std::find(out.begin(), out.end(), kind) != out.end()) {
      c.fail(item, "duplicate transport " + quoted(to_string(kind)));
    }
    out.push_back(kind);
  });
  if (out.empty()) ctx.fail(node, "needs at least one transport");
  return out;
}

std::uint32_t as_mtu(const YAML::Node& node, const Context& ctx) {
  const auto mtu = static_cast<std::uint32_t>(as_int(node, ctx, 0, 4096));
  constexpr std::array<std::uint32_t, 6> kMtus{0, 256, 512, 1024, 2048, 4096};
  if (std::find(kMtus.begin(), kMtus.end(), mtu) == kMtus.end()) {
    ctx.fail(node, "expected one of 0, 256, 512, 1024, 2048, 4096, got " + std::to_string(mtu));
  }
  return mtu;
}

// ---- Rendering -----------------------------------------------------------------

template <class List, class Fn>
void emit_flow_list(YAML::Emitter& out, const List& list, Fn&& item) {
  out << YAML::Flow << YAML::BeginSeq;
  for (const auto& value : list) item(value);
  out << YAML::EndSeq;
}

std::string octal_mode(std::uint32_t mode) {
  char buffer[16];
  std::snprintf(buffer, sizeof buffer, "%04o", mode);
  return buffer;
}

// ---- The schema ----------------------------------------------------------------

using Setter = void (*)(const YAML::Node&, Profile&, const Context&);
using Renderer = void (*)(YAML::Emitter&, const Profile&);

struct Key {
  std::string_view path;
  Setter set;
  Renderer render;  // emits the value only; the walk emits keys and sections
  std::string_view doc;
};

using N = const YAML::Node&;
using C = const Context&;
using E = YAML::Emitter&;
using P = const Profile&;

// In YAML order: to_yaml walks this table and opens a section when the prefix changes.
constexpr std::array kSchema{
    Key{"node.name", [](N n, Profile& p, C c) { p.node.name = as_string(n, c); },
        [](E e, P p) { e << p.node.name; }, "node name in logs; empty = host name"},

    Key{"client.socket", [](N n, Profile& p, C c) { p.client.socket = as_socket_path(n, c); },
        [](E e, P p) { e << p.client.socket; }, "Unix socket path for clients"},
    Key{"client.socket_mode",
        [](N n, Profile& p, C c) { p.client.socket_mode = as_octal_mode(n, c); },
        [](E e, P p) { e << YAML::DoubleQuoted << octal_mode(p.client.socket_mode); },
        "socket file permission bits, octal"},
    Key{"client.socket_group",
        [](N n, Profile& p, C c) {
          p.client.socket_group = n.IsNull() || as_string(n, c).empty() ? "" : as_group_name(n, c);
        },
        [](E e, P p) { e << YAML::DoubleQuoted << p.client.socket_group; },
        "group of the socket file"},
    Key{"client.allowed_uids",
        [](N n, Profile& p, C c) { p.client.allowed_uids = as_uint_list(n, c); },
        [](E e, P p) { emit_flow_list(e, p.client.allowed_uids, [&](auto v) { e << v; }); },
        "uids allowed to connect"},
    Key{"client.allowed_gids",
        [](N n, Profile& p, C c) { p.client.allowed_gids = as_uint_list(n, c); },
        [](E e, P p) { emit_flow_list(e, p.client.allowed_gids, [&](auto v) { e << v; }); },
        "gids allowed to connect"},
    Key{"client.allowed_groups",
        [](N n, Profile& p, C c) { p.client.allowed_groups = as_group_list(n, c); },
        [](E e, P p) { emit_flow_list(e, p.client.allowed_groups, [&](const auto& v) { e << v; }); },
        "group names allowed to connect"},
    Key{"client.max_frame_bytes",
        [](N n, Profile& p, C c) { p.client.max_frame_bytes = as_size(n, c, 4 * KiB, GiB); },
        [](E e, P p) { e << p.client.max_frame_bytes; }, "largest control frame"},
    Key{"client.max_clients",
        [](N n, Profile& p, C c) { p.client.max_clients = as_uint(n, c, 1, 100000); },
        [](E e, P p) { e << p.client.max_clients; }, "concurrent client connections"},
    Key{"client.max_registrations_per_client",
        [](N n, Profile& p, C c) {
          p.client.max_registrations_per_client = as_uint(n, c, 1, 1000000);
        },
        [](E e, P p) { e << p.client.max_registrations_per_client; },
        "registered buffers per client"},

    Key{"peer.listen_address",
        [](N n, Profile& p, C c) { p.peer.listen_address = as_ip_address(n, c); },
        [](E e, P p) { e << p.peer.listen_address; }, "peer listener bind address"},
    Key{"peer.port",
        [](N n, Profile& p, C c) {
          p.peer.port = static_cast<std::uint16_t>(as_uint(n, c, 0, 65535));  // 0: no listener
        },
        [](E e, P p) { e << p.peer.port; }, "peer listener TCP port"},
    Key{"peer.secret_file", [](N n, Profile& p, C c) { p.peer.secret_file = as_string(n, c); },
        [](E e, P p) { e << p.peer.secret_file; }, "cluster secret file"},
    Key{"peer.peers", [](N n, Profile& p, C c) { p.peer.peers = as_peer_list(n, c); },
        [](E e, P p) { emit_flow_list(e, p.peer.peers, [&](const auto& v) { e << v; }); },
        "peer daemons as host:port"},

    Key{"deadlines.operation_ms",
        [](N n, Profile& p, C c) { p.deadlines.operation = as_millis(n, c, 1, 86400000); },
        [](E e, P p) { e << p.deadlines.operation.count(); }, "one collective"},
    Key{"deadlines.connect_ms",
        [](N n, Profile& p, C c) { p.deadlines.connect = as_millis(n, c, 1, 3600000); },
        [](E e, P p) { e << p.deadlines.connect.count(); }, "opening a peer connection"},
    Key{"deadlines.rendezvous_ms",
        [](N n, Profile& p, C c) { p.deadlines.rendezvous = as_millis(n, c, 1, 86400000); },
        [](E e, P p) { e << p.deadlines.rendezvous.count(); }, "communicator init"},
    Key{"deadlines.heartbeat_ms",
        [](N n, Profile& p, C c) { p.deadlines.heartbeat = as_millis(n, c, 10, 600000); },
        [](E e, P p) { e << p.deadlines.heartbeat.count(); }, "peer heartbeat interval"},
    Key{"deadlines.shutdown_ms",
        [](N n, Profile& p, C c) { p.deadlines.shutdown = as_millis(n, c, 1, 600000); },
        [](E e, P p) { e << p.deadlines.shutdown.count(); }, "SIGTERM to exit"},
    Key{"deadlines.client_request_ms",
        [](N n, Profile& p, C c) { p.deadlines.client_request = as_millis(n, c, 1, 600000); },
        [](E e, P p) { e << p.deadlines.client_request.count(); }, "completing a client frame"},

    Key{"workers.threads", [](N n, Profile& p, C c) { p.workers.threads = as_uint(n, c, 0, 1024); },
        [](E e, P p) { e << p.workers.threads; }, "worker threads; 0 = one per CPU"},
    Key{"workers.event_loop_spin_us",
        [](N n, Profile& p, C c) {
          p.workers.event_loop_spin = std::chrono::microseconds(as_uint(n, c, 0, 1000000));
        },
        [](E e, P p) { e << p.workers.event_loop_spin.count(); },
        "event loop polling before it sleeps; 0 = never"},

    Key{"memory.host_pool_bytes",
        [](N n, Profile& p, C c) { p.memory.host_pool_bytes = as_size(n, c, 0, TiB); },
        [](E e, P p) { e << p.memory.host_pool_bytes; }, "pinned staging pool"},
    Key{"memory.max_registered_bytes",
        [](N n, Profile& p, C c) { p.memory.max_registered_bytes = as_size(n, c, 0, 64 * TiB); },
        [](E e, P p) { e << p.memory.max_registered_bytes; },
        "all registrations together; 0 = unlimited"},
    Key{"memory.max_unreceived_bytes",
        [](N n, Profile& p, C c) { p.memory.max_unreceived_bytes = as_size(n, c, 0, 64 * TiB); },
        [](E e, P p) { e << p.memory.max_unreceived_bytes; },
        "data from other nodes not yet received here; 0 = unlimited"},

    Key{"transports", [](N n, Profile& p, C c) { p.transports = as_transports(n, c); },
        [](E e, P p) {
          emit_flow_list(e, p.transports, [&](auto v) { e << std::string(to_string(v)); });
        },
        "transports in order of preference"},

    Key{"tcp.streams_per_peer",
        [](N n, Profile& p, C c) { p.tcp.streams_per_peer = as_uint(n, c, 0, 64); },
        [](E e, P p) { e << p.tcp.streams_per_peer; }, "TCP connections per peer; 0 = auto"},
    Key{"tcp.chunk_bytes",
        [](N n, Profile& p, C c) { p.tcp.chunk_bytes = as_size(n, c, 4 * KiB, 64 * MiB); },
        [](E e, P p) { e << p.tcp.chunk_bytes; }, "pipelining unit"},
    Key{"tcp.io_threads", [](N n, Profile& p, C c) { p.tcp.io_threads = as_uint(n, c, 0, 64); },
        [](E e, P p) { e << p.tcp.io_threads; }, "socket copy threads per direction"},
    Key{"tcp.congestion_control",
        [](N n, Profile& p, C c) { p.tcp.congestion_control = as_congestion_control(n, c); },
        [](E e, P p) { e << p.tcp.congestion_control; }, "congestion control of the peer streams"},
    Key{"collectives.algorithm",
        [](N n, Profile& p, C c) {
          p.collectives.algorithm =
              std::string(kAlgorithms[as_enum<int>(n, c, kAlgorithms)].name);
        },
        [](E e, P p) { e << p.collectives.algorithm; }, "algorithm between nodes"},
    Key{"collectives.direct_max_bytes",
        [](N n, Profile& p, C c) { p.collectives.direct_max_bytes = as_size(n, c, 0, 64 * MiB); },
        [](E e, P p) { e << p.collectives.direct_max_bytes; }, "direct exchange up to this size"},
    Key{"collectives.pairwise_max_nodes",
        [](N n, Profile& p, C c) { p.collectives.pairwise_max_nodes = as_uint(n, c, 1, 1024); },
        [](E e, P p) { e << p.collectives.pairwise_max_nodes; }, "pairwise up to this many nodes"},

    Key{"verbs.hcas", [](N n, Profile& p, C c) { p.verbs.hcas = as_hca_list(n, c); },
        [](E e, P p) {
          emit_flow_list(e, p.verbs.hcas,
                         [&](const VerbsHca& h) { e << h.name + ':' + std::to_string(h.port); });
        },
        "HCAs as name or name:port; empty = discover"},
    Key{"verbs.gid_index",
        [](N n, Profile& p, C c) { p.verbs.gid_index = static_cast<int>(as_int(n, c, -1, 255)); },
        [](E e, P p) { e << p.verbs.gid_index; }, "GID index; -1 = discover"},
    Key{"verbs.mtu", [](N n, Profile& p, C c) { p.verbs.mtu = as_mtu(n, c); },
        [](E e, P p) { e << p.verbs.mtu; }, "path MTU; 0 = port's active MTU"},
    Key{"verbs.qps_per_connection",
        [](N n, Profile& p, C c) { p.verbs.qps_per_connection = as_uint(n, c, 1, 128); },
        [](E e, P p) { e << p.verbs.qps_per_connection; }, "QPs per peer connection"},
    Key{"verbs.retry_count",
        [](N n, Profile& p, C c) { p.verbs.retry_count = as_uint(n, c, 0, 7); },
        [](E e, P p) { e << p.verbs.retry_count; }, "transport retries"},
    Key{"verbs.timeout", [](N n, Profile& p, C c) { p.verbs.timeout = as_uint(n, c, 0, 31); },
        [](E e, P p) { e << p.verbs.timeout; }, "local ACK timeout exponent"},
    Key{"verbs.slot_bytes",
        [](N n, Profile& p, C c) { p.verbs.slot_bytes = as_size(n, c, 4 * KiB, 64 * MiB); },
        [](E e, P p) { e << p.verbs.slot_bytes; }, "receive slot size"},
    Key{"verbs.slots_per_peer",
        [](N n, Profile& p, C c) { p.verbs.slots_per_peer = as_uint(n, c, 1, 4096); },
        [](E e, P p) { e << p.verbs.slots_per_peer; }, "receive slots (credits) per peer"},
    Key{"verbs.mr_cache_entries",
        [](N n, Profile& p, C c) { p.verbs.mr_cache_entries = as_uint(n, c, 0, 1048576); },
        [](E e, P p) { e << p.verbs.mr_cache_entries; }, "cached user-buffer registrations"},
    Key{"verbs.in_place_min_bytes",
        [](N n, Profile& p, C c) { p.verbs.in_place_min_bytes = as_size(n, c, 0, 16 * GiB); },
        [](E e, P p) { e << p.verbs.in_place_min_bytes; },
        "write client-memory pieces this large in place; 0 = always copy"},

    Key{"gpu.mps",
        [](N n, Profile& p, C c) { p.gpu.mps = as_enum<std::string_view>(n, c, kMpsModes); },
        [](E e, P p) { e << p.gpu.mps; }, "CUDA MPS: managed, external or off"},
    Key{"gpu.stage_chunk_bytes",
        [](N n, Profile& p, C c) { p.gpu.stage_chunk_bytes = as_size(n, c, 0, 16 * GiB); },
        [](E e, P p) { e << p.gpu.stage_chunk_bytes; },
        "cut collectives across nodes into chunks of this size; 0 = never"},
    Key{"gpu.copy_engine_min_bytes",
        [](N n, Profile& p, C c) { p.gpu.copy_engine_min_bytes = as_size(n, c, 0, 16 * GiB); },
        [](E e, P p) { e << p.gpu.copy_engine_min_bytes; },
        "copies between GPUs this large use the copy engines; 0 = always a kernel"},
    Key{"gpu.client_kernels",
        [](N n, Profile& p, C c) {
          p.gpu.client_kernels = as_enum<std::string_view>(n, c, kClientKernelModes);
        },
        [](E e, P p) { e << p.gpu.client_kernels; },
        "client libraries run one-GPU-per-rank collectives themselves: on, auto (without MPS), "
        "off"},
    Key{"gpu.client_kernel_max_bytes",
        [](N n, Profile& p, C c) { p.gpu.client_kernel_max_bytes = as_size(n, c, 256, 1 * GiB); },
        [](E e, P p) { e << p.gpu.client_kernel_max_bytes; },
        "largest rank buffer the client's kernels take (scratch: 2 x ranks x this per GPU)"},
    Key{"gpu.two_step_min_gpus",
        [](N n, Profile& p, C c) {
          p.gpu.two_step_min_gpus = static_cast<int>(as_uint(n, c, 2, 64));
        },
        [](E e, P p) { e << p.gpu.two_step_min_gpus; },
        "all-reduce and broadcast over this many GPUs or more take two steps"},
    Key{"gpu.two_step_bytes",
        [](N n, Profile& p, C c) { p.gpu.two_step_bytes = as_size(n, c, 0, 1 * GiB); },
        [](E e, P p) { e << p.gpu.two_step_bytes; },
        "rank buffers from which the client's kernels take two steps; 0 = never"},
    Key{"gpu.client_stage_max_bytes",
        [](N n, Profile& p, C c) { p.gpu.client_stage_max_bytes = as_size(n, c, 0, 1 * GiB); },
        [](E e, P p) { e << p.gpu.client_stage_max_bytes; },
        "across nodes, rank buffers up to this size are staged by the client; 0 = by the daemon"},

    Key{"log.level",
        [](N n, Profile& p, C c) { p.log.level = as_enum<LogLevel>(n, c, kLogLevels); },
        [](E e, P p) { e << std::string(to_string(p.log.level)); }, "least severe level logged"},

    Key{"metrics.listen", [](N n, Profile& p, C c) { p.metrics.listen = as_listen_address(n, c); },
        [](E e, P p) { e << p.metrics.listen; }, "Prometheus endpoint; empty = off"},
};

const Key* find_key(std::string_view path) {
  const auto it =
      std::find_if(kSchema.begin(), kSchema.end(), [&](const Key& k) { return k.path == path; });
  return it == kSchema.end() ? nullptr : &*it;
}

// "client" for "client.socket"; empty for a top-level leaf such as "transports".
std::string_view section_of(std::string_view path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

// The first key of a section, or empty when `path` is not a section.
std::string_view first_key_of(std::string_view path) {
  const auto it = std::find_if(kSchema.begin(), kSchema.end(),
                               [&](const Key& k) { return section_of(k.path) == path; });
  return it == kSchema.end() ? std::string_view() : it->path;
}

bool is_section(std::string_view path) { return !first_key_of(path).empty(); }

// Optimal string alignment distance: Levenshtein plus adjacent transpositions.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string unknown_key_reason(std::string_view path) {
  std::string best;
  std::size_t best_distance = 4;  // suggest only within distance 3
  const auto consider = [&](std::string_view candidate) {
    const std::size_t distance = edit_distance(path, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  };
  for (const Key& key : kSchema) {
    consider(key.path);
    if (!section_of(key.path).empty()) consider(section_of(key.path));
  }
  if (best.empty()) return "unknown key";
  return "unknown key (did you mean " + quoted(best) + "?)";
}

// ---- Layers ------------------------------------------------------------------------

// Applies one map of a layer, adding to `applied` the paths (keys and sections) it set.
void apply_map(const YAML::Node& map, const std::string& prefix, Profile& profile,
               const Context& layer, std::set<std::string>& applied) {
  for (const auto& entry : map) {  // yaml-cpp yields entries by value
    const YAML::Node& key = entry.first;
    const YAML::Node& value = entry.second;
    Context ctx = layer;
    ctx.key_mark = key.Mark();
    ctx.path = prefix;
    if (!key.IsScalar()) ctx.fail(key, "expected a key name, got " + std::string(node_kind(key)));
    ctx.path = prefix.empty() ? key.Scalar() : prefix + '.' + key.Scalar();

    const bool seen = applied.count(ctx.path) != 0;
    if (const Key* leaf = find_key(ctx.path)) {
      if (seen) ctx.fail(key, "duplicate key");
      leaf->set(value, profile, ctx);
      applied.insert(ctx.path);
    } else if (is_section(ctx.path)) {
      if (seen) ctx.fail(key, "duplicate key");
      applied.insert(ctx.path);
      if (value.IsNull()) continue;  // a section with every key commented out
      if (!value.IsMap()) ctx.fail(value, "expected a map, got " + std::string(node_kind(value)));
      apply_map(value, ctx.path, profile, layer, applied);
    } else {
      ctx.fail(key, unknown_key_reason(ctx.path));
    }
  }
}

// Where each document of a YAML stream starts, from the parser's events.
class DocumentStarts final : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& mark) override { starts.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// YAML::LoadAll, without its endless loop: yaml-cpp 0.7 (Debian 12) starts a
// new empty document at the same place forever on a stray flow indicator at
// the top (",a"), growing memory until the process dies (found by
// tests/fuzz/profile_fuzz). The stream is walked once for document starts,
// at most two (one is all a profile may have); a document that starts where
// the previous one did is a syntax error there.
std::vector<YAML::Node> load_documents(const Context& layer, std::string_view text) {
  std::stringstream in{std::string(text)};
  YAML::Parser parser(in);
  DocumentStarts events;
  while (events.starts.size() < 2 && parser.HandleNextDocument(events)) {
  }
  if (events.starts.empty()) return {};
  if (events.starts.size() == 2 && events.starts[1].pos == events.starts[0].pos) {
    const auto& mark = events.starts[1];
    const char c = static_cast<std::size_t>(mark.pos) < text.size() ? text[mark.pos] : ' ';
    layer.fail_at(mark, std::string("unexpected '") + c + "': not the start of a key, a value or a document");
  }
  if (events.starts.size() == 2) {
    Context at = layer;
    at.path = "(document)";
    at.fail_at(events.starts[1], "expected one YAML document, got more");
  }
  return {YAML::Load(std::string(text))};
}

// Parses and applies one YAML document; returns the paths (keys and sections) it set.
std::set<std::string> apply_text(Profile& profile, std::string_view source, std::string_view text) {
  Context layer{std::string(source), "(syntax)"};
  std::vector<YAML::Node> documents;
  try {
    documents = load_documents(layer, text);
  } catch (const YAML::Exception& e) {
    layer.fail_at(e.mark, e.msg);
  }
  std::set<std::string> applied;
  if (documents.empty()) return applied;
  layer.path = "(document)";
  const YAML::Node& root = documents.front();
  if (root.IsNull()) return applied;
  if (!root.IsMap())
    layer.fail(root, "expected a map at the top, got " + std::string(node_kind(root)));
  apply_map(root, "", profile, layer, applied);
  return applied;
}

void apply_override(Profile& profile, const std::string& override_text) {
  Context ctx{"--set " + override_text, "(override)"};
  ctx.use_marks = false;
  const std::size_t eq = override_text.find('=');
  if (eq == std::string::npos) ctx.fail_at(YAML::Mark::null_mark(), "expected KEY.PATH=VALUE");
  ctx.path = override_text.substr(0, eq);
  const Key* key = find_key(ctx.path);
  if (!key && is_section(ctx.path)) {
    ctx.fail_at(YAML::Mark::null_mark(), "is a section; --set takes one key of it, such as " +
                                             quoted(first_key_of(ctx.path)));
  }
  if (!key) ctx.fail_at(YAML::Mark::null_mark(), unknown_key_reason(ctx.path));
  YAML::Node value;
  try {
    value = YAML::Load(override_text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    ctx.fail_at(e.mark, "value is not valid YAML: " + e.msg);
  }
  key->set(value, profile, ctx);
}

Profile embedded_profile() {
  Profile profile;
  const std::set<std::string> applied =
      apply_text(profile, kEmbeddedSource, default_profile_text());
  // Every key needs a default; a key missing here would silently be zero.
  for (const Key& key : kSchema) {
    if (applied.count(std::string(key.path)) == 0) {
      throw ProfileError(std::string(kEmbeddedSource), 0, 0, std::string(key.path),
                         "missing from the embedded default");
    }
  }
  return profile;
}

void resolve_node_name(Profile& profile) {
  if (!profile.node.name.empty()) return;
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof host - 1) != 0) {
    throw ProfileError("gethostname", 0, 0, "node.name", std::strerror(errno));
  }
  profile.node.name = host;
}

Profile finish(Profile profile, const std::vector<std::string>& overrides) {
  for (const std::string& override_text : overrides) apply_override(profile, override_text);
  resolve_node_name(profile);
  return profile;
}

std::string read_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) throw ProfileError(path, 0, 0, "(file)", std::strerror(errno));
  std::string text;
  char buffer[65536];
  std::size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, file)) > 0) text.append(buffer, n);
  const int error = std::ferror(file) ? errno : 0;
  std::fclose(file);
  if (error != 0) throw ProfileError(path, 0, 0, "(file)", std::strerror(error));
  return text;
}

}  // namespace

Profile default_profile() { return finish(embedded_profile(), {}); }

Profile load_profile(const std::string& file, const std::vector<std::string>& overrides) {
  Profile profile = embedded_profile();
  if (!file.empty()) apply_text(profile, file, read_file(file));
  return finish(std::move(profile), overrides);
}

Profile load_profile_text(std::string_view source_name, std::string_view text,
                          const std::vector<std::string>& overrides) {
  Profile profile = embedded_profile();
  apply_text(profile, source_name, text);
  return finish(std::move(profile), overrides);
}

std::vector<std::string> known_keys() {
  std::vector<std::string> keys;
  for (const Key& key : kSchema) keys.emplace_back(key.path);
  return keys;
}

std::string to_yaml(const Profile& profile) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string_view open_section;
  for (const Key& key : kSchema) {
    const std::string_view section = section_of(key.path);
    if (section != open_section) {
      if (!open_section.empty()) out << YAML::EndMap;
      if (!section.empty())
        out << YAML::Key << std::string(section) << YAML::Value << YAML::BeginMap;
      open_section = section;
    }
    const std::string_view leaf = section.empty() ? key.path : key.path.substr(section.size() + 1);
    out << YAML::Key << std::string(leaf) << YAML::Value;
    key.render(out, profile);
  }
  if (!open_section.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + '\n';
}

}  // namespace collectived::config

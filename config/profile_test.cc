#include <doctest/doctest.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "config/profile.h"

namespace cfg = collectived::config;
using namespace std::chrono_literals;

namespace {

// Runs f, which must throw ProfileError, and returns the error.
template <class F>
cfg::ProfileError error_of(F&& f) {
  try {
    f();
  } catch (const cfg::ProfileError& e) {
    return e;
  }
  FAIL("expected a ProfileError");
  throw std::logic_error("unreachable");
}

cfg::ProfileError text_error(const std::string& text, const std::vector<std::string>& sets = {}) {
  return error_of([&] { cfg::load_profile_text("test.yaml", text, sets); });
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A directory under the system temp dir, removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "profile_test.XXXXXX").string();
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    const std::filesystem::path file = path / name;
    std::ofstream(file) << text;
    return file.string();
  }
};

std::string host_name() {
  char host[HOST_NAME_MAX + 1] = {};
  REQUIRE(gethostname(host, sizeof host - 1) == 0);
  return host;
}

void check_equal(const cfg::Profile& a, const cfg::Profile& b) {
  CHECK(a.node.name == b.node.name);
  CHECK(a.client.socket == b.client.socket);
  CHECK(a.client.socket_mode == b.client.socket_mode);
  CHECK(a.client.allowed_uids == b.client.allowed_uids);
  CHECK(a.client.allowed_gids == b.client.allowed_gids);
  CHECK(a.client.socket_group == b.client.socket_group);
  CHECK(a.client.allowed_groups == b.client.allowed_groups);
  CHECK(a.client.max_frame_bytes == b.client.max_frame_bytes);
  CHECK(a.client.max_clients == b.client.max_clients);
  CHECK(a.client.max_registrations_per_client == b.client.max_registrations_per_client);
  CHECK(a.peer.listen_address == b.peer.listen_address);
  CHECK(a.peer.port == b.peer.port);
  CHECK(a.peer.secret_file == b.peer.secret_file);
  CHECK(a.peer.peers == b.peer.peers);
  CHECK(a.deadlines.operation == b.deadlines.operation);
  CHECK(a.deadlines.connect == b.deadlines.connect);
  CHECK(a.deadlines.rendezvous == b.deadlines.rendezvous);
  CHECK(a.deadlines.heartbeat == b.deadlines.heartbeat);
  CHECK(a.deadlines.shutdown == b.deadlines.shutdown);
  CHECK(a.deadlines.client_request == b.deadlines.client_request);
  CHECK(a.workers.threads == b.workers.threads);
  CHECK(a.workers.event_loop_spin == b.workers.event_loop_spin);
  CHECK(a.memory.host_pool_bytes == b.memory.host_pool_bytes);
  CHECK(a.memory.max_registered_bytes == b.memory.max_registered_bytes);
  CHECK(a.memory.max_unreceived_bytes == b.memory.max_unreceived_bytes);
  CHECK(a.transports == b.transports);
  CHECK(a.tcp.streams_per_peer == b.tcp.streams_per_peer);
  CHECK(a.tcp.chunk_bytes == b.tcp.chunk_bytes);
  CHECK(a.tcp.io_threads == b.tcp.io_threads);
  CHECK(a.tcp.congestion_control == b.tcp.congestion_control);
  REQUIRE(a.verbs.hcas.size() == b.verbs.hcas.size());
  for (std::size_t i = 0; i < a.verbs.hcas.size(); ++i) {
    CHECK(a.verbs.hcas[i].name == b.verbs.hcas[i].name);
    CHECK(a.verbs.hcas[i].port == b.verbs.hcas[i].port);
  }
  CHECK(a.verbs.gid_index == b.verbs.gid_index);
  CHECK(a.verbs.mtu == b.verbs.mtu);
  CHECK(a.verbs.qps_per_connection == b.verbs.qps_per_connection);
  CHECK(a.verbs.retry_count == b.verbs.retry_count);
  CHECK(a.verbs.timeout == b.verbs.timeout);
  CHECK(a.verbs.slot_bytes == b.verbs.slot_bytes);
  CHECK(a.verbs.slots_per_peer == b.verbs.slots_per_peer);
  CHECK(a.verbs.mr_cache_entries == b.verbs.mr_cache_entries);
  CHECK(a.verbs.in_place_min_bytes == b.verbs.in_place_min_bytes);
  CHECK(a.log.level == b.log.level);
}

using cfg::TransportKind;

}  // namespace

TEST_CASE("the embedded default documents every key and sets the documented defaults") {
  const std::string text(cfg::default_profile_text());
  REQUIRE(!text.empty());
  const std::vector<std::string> keys = cfg::known_keys();
  // A new key changes this count: it is also to be documented in the annotated profile.
  CHECK(keys.size() == 53);
  CHECK(keys.front() == "node.name");
  CHECK(keys.back() == "metrics.listen");
  for (const std::string& key : keys) {
    const std::string leaf = key.substr(key.rfind('.') + 1);
    CHECK_MESSAGE((contains(text, "\n" + leaf + ":") || contains(text, " " + leaf + ":")), key);
  }

  const cfg::Profile p = cfg::default_profile();
  CHECK(p.node.name == host_name());
  CHECK(p.gpu.mps == "off");
  CHECK(p.gpu.stage_chunk_bytes == 0);
  CHECK(p.gpu.copy_engine_min_bytes == 16 * 1024 * 1024);
  CHECK(p.gpu.client_kernels == "on");
  CHECK(p.gpu.client_kernel_max_bytes == 16 * 1024 * 1024);
  CHECK(p.gpu.two_step_min_gpus == 3);
  CHECK(p.gpu.two_step_bytes == 512 * 1024);
  CHECK(p.gpu.client_stage_max_bytes == 4 * 1024 * 1024);
  CHECK(p.client.socket == "/run/collectived/collectived.sock");
  CHECK(p.client.socket_mode == 0660);
  CHECK(p.client.allowed_uids == std::vector<std::uint32_t>{0});
  CHECK(p.client.allowed_gids.empty());
  CHECK(p.client.socket_group == "collectived");
  CHECK(p.client.allowed_groups == std::vector<std::string>{"collectived"});
  CHECK(p.client.max_frame_bytes == 1024 * 1024);
  CHECK(p.client.max_clients == 4096);
  CHECK(p.client.max_registrations_per_client == 65536);
  CHECK(p.peer.listen_address == "127.0.0.1");
  CHECK(p.peer.port == 0);  // no peer listener unless a node's profile asks for one
  CHECK(p.peer.secret_file == "/etc/collectived/secret");
  CHECK(p.peer.peers.empty());
  CHECK(p.deadlines.operation == 30000ms);
  CHECK(p.deadlines.connect == 5000ms);
  CHECK(p.deadlines.rendezvous == 60000ms);
  CHECK(p.deadlines.heartbeat == 1000ms);
  CHECK(p.deadlines.shutdown == 5000ms);
  CHECK(p.deadlines.client_request == 10000ms);
  CHECK(p.workers.threads == 0);
  CHECK(p.workers.event_loop_spin == std::chrono::microseconds(100));
  CHECK(p.memory.host_pool_bytes == 64ull << 20);
  CHECK(p.memory.max_registered_bytes == 0);
  CHECK(p.memory.max_unreceived_bytes == 4ull << 30);
  CHECK(p.transports ==
        std::vector<TransportKind>{TransportKind::local, TransportKind::tcp, TransportKind::verbs});
  CHECK(p.tcp.streams_per_peer == 0);  // auto
  CHECK(p.tcp.chunk_bytes == 1024 * 1024);
  CHECK(p.tcp.io_threads == 4);
  CHECK(p.tcp.congestion_control == "cubic");
  CHECK(p.collectives.algorithm == "auto");
  CHECK(p.collectives.direct_max_bytes == 256 * 1024);
  CHECK(p.collectives.pairwise_max_nodes == 4);
  CHECK(p.verbs.hcas.empty());
  CHECK(p.verbs.gid_index == -1);
  CHECK(p.verbs.mtu == 0);
  CHECK(p.verbs.qps_per_connection == 1);
  CHECK(p.verbs.retry_count == 7);
  CHECK(p.verbs.timeout == 20);
  CHECK(p.verbs.slot_bytes == 512 * 1024);
  CHECK(p.verbs.slots_per_peer == 16);
  CHECK(p.verbs.mr_cache_entries == 1024);
  CHECK(p.verbs.in_place_min_bytes == 16 * 1024);
  CHECK(p.log.level == cfg::LogLevel::info);

  // No file and no overrides is exactly the default.
  check_equal(cfg::load_profile("", {}), p);
}

TEST_CASE("enum spellings match the YAML") {
  CHECK(cfg::to_string(cfg::LogLevel::trace) == "trace");
  CHECK(cfg::to_string(cfg::LogLevel::warn) == "warn");
  CHECK(cfg::to_string(TransportKind::verbs) == "verbs");
  CHECK(cfg::to_string(TransportKind::local) == "local");
}

TEST_CASE("ProfileError formats source, line, column, key and reason") {
  const cfg::ProfileError with_mark("f.yaml", 3, 7, "client.socket", "bad");
  CHECK(std::string(with_mark.what()) == "f.yaml:3:7: client.socket: bad");
  CHECK(with_mark.line() == 3);
  CHECK(with_mark.column() == 7);
  CHECK(with_mark.key_path() == "client.socket");
  CHECK(with_mark.reason() == "bad");
  const cfg::ProfileError without("f.yaml", 0, 0, "(file)", "gone");
  CHECK(std::string(without.what()) == "f.yaml: (file): gone");
}

TEST_CASE("a misspelled key in a file names file, line, column and a suggestion") {
  TempDir dir;
  const std::string path = dir.write("node.yaml",
                                     "# node 17\n"
                                     "client:\n"
                                     "  socket_mode: \"0600\"\n"
                                     "  sockt: /run/x.sock\n");
  const cfg::ProfileError e = error_of([&] { cfg::load_profile(path, {}); });
  const std::string what = e.what();
  CHECK_MESSAGE(starts_with(what, path + ":4:3: client.sockt: unknown key"), what);
  CHECK_MESSAGE(contains(what, "(did you mean 'client.socket'?)"), what);
  CHECK(e.source() == path);
  CHECK(e.line() == 4);
  CHECK(e.column() == 3);
  CHECK(e.key_path() == "client.sockt");
}

TEST_CASE("unknown keys and sections") {
  SUBCASE("misspelled section, with a transposition") {
    const std::string what = text_error("clinet:\n  socket: /x\n").what();
    CHECK_MESSAGE(starts_with(what, "test.yaml:1:1: clinet: unknown key (did you mean 'client'?)"),
                  what);
  }
  SUBCASE("nothing close enough: no suggestion") {
    const std::string what = text_error("peer:\n  completely_unrelated: 1\n").what();
    CHECK(what == "test.yaml:2:3: peer.completely_unrelated: unknown key");
  }
  SUBCASE("a section given as a scalar") {
    const std::string what = text_error("verbs: 5\n").what();
    CHECK(what == "test.yaml:1:8: verbs: expected a map, got a scalar");
  }
  SUBCASE("an empty value is reported at its key") {
    const std::string what = text_error("peer:\n  port:\nlog: {}\n").what();
    CHECK(what == "test.yaml:2:3: peer.port: expected an integer, got nothing");
  }
  SUBCASE("a key given twice") {
    const std::string what = text_error("log:\n  level: info\n  level: warn\n").what();
    CHECK(what == "test.yaml:3:3: log.level: duplicate key");
  }
  SUBCASE("a leaf given a map") {
    const std::string what = text_error("log:\n  level: {a: b}\n").what();
    CHECK(what == "test.yaml:2:10: log.level: expected a name, got a map");
  }
}

TEST_CASE("values are type- and range-checked") {
  SUBCASE("string where an integer is expected") {
    const std::string what = text_error("deadlines:\n  operation_ms: fast\n").what();
    CHECK(what == "test.yaml:2:17: deadlines.operation_ms: expected an integer, got 'fast'");
  }
  SUBCASE("integer out of range") {
    const std::string what = text_error("verbs:\n  retry_count: 8\n").what();
    CHECK(what == "test.yaml:2:16: verbs.retry_count: out of range 0..7, got 8");
  }
  SUBCASE("negative where unsigned") {
    CHECK(text_error("workers: {threads: -1}").key_path() == "workers.threads");
  }
  SUBCASE("huge integer") {
    CHECK(contains(text_error("deadlines: {connect_ms: 99999999999999999999999}").reason(),
                   "out of range"));
  }
  SUBCASE("bad enum value") {
    const std::string what = text_error("log:\n  level: loud\n").what();
    CHECK(what ==
          "test.yaml:2:10: log.level: expected one of trace, debug, info, warn, error, got 'loud'");
  }
  SUBCASE("duplicate transport") {
    const std::string what = text_error("transports: [tcp, local, tcp]\n").what();
    CHECK(what == "test.yaml:1:26: transports[2]: duplicate transport 'tcp'");
  }
  SUBCASE("unknown transport") {
    CHECK(text_error("transports: [tcp, ib]").key_path() == "transports[1]");
  }
  SUBCASE("congestion control: a kernel name or empty") {
    const std::string what = text_error("tcp:\n  congestion_control: BBR v2\n").what();
    CHECK(contains(what,
                   "test.yaml:2:23: tcp.congestion_control: expected a congestion control "
                   "name such as cubic"));
    CHECK(contains(text_error("tcp: {congestion_control: abcdefghijklmnopq}").reason(),
                   "at most 15 characters"));
  }
  SUBCASE("empty transports") {
    CHECK(text_error("transports: []").reason() == "needs at least one transport");
  }
  SUBCASE("bad size suffix") {
    const cfg::ProfileError e = text_error("memory:\n  host_pool_bytes: 64XB\n");
    CHECK(e.line() == 2);
    CHECK(e.key_path() == "memory.host_pool_bytes");
    CHECK(contains(e.reason(), "expected a size"));
    CHECK(contains(e.reason(), "'64XB'"));
  }
  SUBCASE("size out of range") {
    CHECK(text_error("client: {max_frame_bytes: 1KiB}").reason() ==
          "out of range 4KiB..1GiB, got '1KiB'");
    CHECK(contains(text_error("tcp: {chunk_bytes: 99999999999 TiB}").reason(), "out of range"));
  }
  SUBCASE("listen address must be an IP literal") {
    CHECK(text_error("peer: {listen_address: node17}").key_path() == "peer.listen_address");
    CHECK(cfg::load_profile_text("t", "peer: {listen_address: '::'}", {}).peer.listen_address ==
          "::");
  }
  SUBCASE("peers need host:port") {
    CHECK(text_error("peer: {peers: [node1]}").key_path() == "peer.peers[0]");
    CHECK(text_error("peer: {peers: ['node1:0']}").key_path() == "peer.peers[0]");
    CHECK(text_error("peer: {peers: ['node1:65536']}").key_path() == "peer.peers[0]");
    CHECK(text_error("peer: {peers: [':80']}").key_path() == "peer.peers[0]");
    const cfg::Profile p =
        cfg::load_profile_text("t", "peer: {peers: ['node1:47600', '[fe80::1]:9']}", {});
    CHECK(p.peer.peers == std::vector<std::string>{"node1:47600", "[fe80::1]:9"});
  }
  SUBCASE("hcas are name or name:port") {
    const cfg::Profile p = cfg::load_profile_text("t", "verbs: {hcas: [mlx5_0, 'mlx5_1:2']}", {});
    REQUIRE(p.verbs.hcas.size() == 2);
    CHECK(p.verbs.hcas[0].name == "mlx5_0");
    CHECK(p.verbs.hcas[0].port == 1);
    CHECK(p.verbs.hcas[1].name == "mlx5_1");
    CHECK(p.verbs.hcas[1].port == 2);
    CHECK(text_error("verbs: {hcas: ['mlx5_0:256']}").key_path() == "verbs.hcas[0]");
    CHECK(text_error("verbs: {hcas: ['mlx5_0:0']}").key_path() == "verbs.hcas[0]");
    CHECK(text_error("verbs: {hcas: [':1']}").key_path() == "verbs.hcas[0]");
  }
  SUBCASE("mtu is one of the IB MTUs") {
    CHECK(cfg::load_profile_text("t", "verbs: {mtu: 4096}", {}).verbs.mtu == 4096);
    CHECK(text_error("verbs: {mtu: 1500}").key_path() == "verbs.mtu");
  }
  SUBCASE("gid_index allows -1") {
    CHECK(cfg::load_profile_text("t", "verbs: {gid_index: 3}", {}).verbs.gid_index == 3);
    CHECK(text_error("verbs: {gid_index: -2}").key_path() == "verbs.gid_index");
  }
  SUBCASE("uid lists hold uint32") {
    CHECK(text_error("client: {allowed_uids: [0, -5]}").key_path() == "client.allowed_uids[1]");
    CHECK(text_error("client: {allowed_uids: 1000}").reason() == "expected a list, got a scalar");
  }
}

TEST_CASE("document-level errors") {
  SUBCASE("top-level list") {
    const cfg::ProfileError e = text_error("- a\n- b\n");
    CHECK(std::string(e.what()) ==
          "test.yaml:1:1: (document): expected a map at the top, got a list");
  }
  SUBCASE("syntax error has a line and column") {
    const cfg::ProfileError e = text_error("client:\n  socket: [unclosed\nlog: {level: info}\n");
    CHECK(e.key_path() == "(syntax)");
    CHECK(e.line() > 0);
    CHECK(e.column() > 0);
    CHECK(starts_with(e.what(), "test.yaml:" + std::to_string(e.line()) + ":" +
                                    std::to_string(e.column()) + ": (syntax): "));
  }
  SUBCASE("missing file") {
    const cfg::ProfileError e = error_of([] { cfg::load_profile("/nonexistent/x.yaml", {}); });
    CHECK(std::string(e.what()) == "/nonexistent/x.yaml: (file): No such file or directory");
  }
  SUBCASE("empty and null documents change nothing") {
    check_equal(cfg::load_profile_text("t", "", {}), cfg::default_profile());
    check_equal(cfg::load_profile_text("t", "# only a comment\n", {}), cfg::default_profile());
    check_equal(cfg::load_profile_text("t", "~\n", {}), cfg::default_profile());
    check_equal(cfg::load_profile_text("t", "verbs:\n", {}), cfg::default_profile());
  }
}

TEST_CASE("layers: default, then file, then --set") {
  TempDir dir;
  const std::string path = dir.write("node.yaml",
                                     "node: {name: n17}\n"
                                     "deadlines:\n"
                                     "  operation_ms: 120000\n"
                                     "  connect_ms: 7000\n");

  SUBCASE("the file overrides the default, only for the keys it names") {
    const cfg::Profile p = cfg::load_profile(path, {});
    CHECK(p.node.name == "n17");
    CHECK(p.deadlines.operation == 120000ms);
    CHECK(p.deadlines.connect == 7000ms);
    CHECK(p.deadlines.rendezvous == 60000ms);
    CHECK(p.peer.port == 0);
  }
  SUBCASE("--set overrides the file; later --set wins") {
    const cfg::Profile p = cfg::load_profile(
        path, {"deadlines.operation_ms=5", "client.socket=/tmp/x.sock", "deadlines.operation_ms=6",
               "transports=[tcp,local]", "peer.peers=[a:1, b:2]"});
    CHECK(p.deadlines.operation == 6ms);
    CHECK(p.deadlines.connect == 7000ms);
    CHECK(p.client.socket == "/tmp/x.sock");
    CHECK(p.transports == std::vector<TransportKind>{TransportKind::tcp, TransportKind::local});
    CHECK(p.peer.peers == std::vector<std::string>{"a:1", "b:2"});
  }
  SUBCASE("an empty --set value is the empty string") {
    CHECK(cfg::load_profile(path, {"peer.secret_file="}).peer.secret_file.empty());
    CHECK(cfg::load_profile(path, {"node.name="}).node.name == host_name());
  }
  SUBCASE("--set errors name the override") {
    const cfg::ProfileError e = error_of([&] { cfg::load_profile(path, {"verbs.retry_count=9"}); });
    CHECK(std::string(e.what()) ==
          "--set verbs.retry_count=9: verbs.retry_count: out of range 0..7, got 9");
    const std::string dup =
        error_of([&] { cfg::load_profile(path, {"transports=[tcp,tcp]"}); }).what();
    CHECK(dup == "--set transports=[tcp,tcp]: transports[1]: duplicate transport 'tcp'");
  }
  SUBCASE("--set of an unknown key suggests one") {
    const std::string what = error_of([&] { cfg::load_profile(path, {"client.sockt=/x"}); }).what();
    CHECK(what ==
          "--set client.sockt=/x: client.sockt: unknown key (did you mean 'client.socket'?)");
  }
  SUBCASE("--set of a section is refused") {
    const cfg::ProfileError e = error_of([&] { cfg::load_profile(path, {"client={socket: /x}"}); });
    CHECK(e.key_path() == "client");
    CHECK(contains(e.reason(), "is a section"));
  }
  SUBCASE("--set without '='") {
    const std::string what = error_of([&] { cfg::load_profile(path, {"log.level"}); }).what();
    CHECK(what == "--set log.level: (override): expected KEY.PATH=VALUE");
  }
  SUBCASE("--set with invalid YAML") {
    const cfg::ProfileError e = error_of([&] { cfg::load_profile(path, {"transports=[tcp"}); });
    CHECK(e.source() == "--set transports=[tcp");
    CHECK(e.key_path() == "transports");
  }
  SUBCASE("a file error wins over later overrides and names the file") {
    const std::string bad = dir.write("bad.yaml", "log: {level: loud}\n");
    const cfg::ProfileError e = error_of([&] { cfg::load_profile(bad, {"log.level=info"}); });
    CHECK(e.source() == bad);
  }
}

TEST_CASE("sizes") {
  const auto pool = [](const std::string& value) {
    return cfg::load_profile_text("t", "memory: {host_pool_bytes: " + value + "}", {})
        .memory.host_pool_bytes;
  };
  CHECK(pool("\"64MiB\"") == 64ull << 20);
  CHECK(pool("64MiB") == 64ull << 20);
  CHECK(pool("1048576") == 1048576);
  CHECK(pool("\"1 GiB\"") == 1ull << 30);
  CHECK(pool("10KB") == 10000);
  CHECK(pool("3M") == 3ull << 20);
  CHECK(pool("2GB") == 2000000000ull);
  CHECK(pool("512B") == 512);
  CHECK(pool("1TiB") == 1ull << 40);
  CHECK(pool("0") == 0);
  CHECK(text_error("memory: {host_pool_bytes: 2TiB}").reason() ==
        "out of range 0B..1TiB, got '2TiB'");
  CHECK(text_error("memory: {host_pool_bytes: -1}").key_path() == "memory.host_pool_bytes");
  CHECK(text_error("memory: {host_pool_bytes: 1.5GiB}").key_path() == "memory.host_pool_bytes");
  CHECK(text_error("memory: {host_pool_bytes: MiB}").key_path() == "memory.host_pool_bytes");
  CHECK(cfg::load_profile_text("t", "memory: {max_registered_bytes: 64TiB}", {})
            .memory.max_registered_bytes == 64ull << 40);
}

TEST_CASE("client socket and mode") {
  const auto mode = [](const std::string& value) {
    return cfg::load_profile_text("t", "client: {socket_mode: " + value + "}", {})
        .client.socket_mode;
  };
  CHECK(mode("\"0600\"") == 0600);
  CHECK(mode("0600") == 0600);
  CHECK(mode("660") == 0660);
  CHECK(mode("\"0777\"") == 0777);
  CHECK(mode("0") == 0);
  CHECK(text_error("client: {socket_mode: \"01000\"}").reason() ==
        "out of range 0..0777, got '01000'");
  CHECK(text_error("client: {socket_mode: 0778}").key_path() == "client.socket_mode");
  CHECK(text_error("client: {socket_mode: rw}").key_path() == "client.socket_mode");

  // Group names: what /etc/group can hold.
  CHECK(text_error("client: {allowed_groups: [\"a:b\"]}").key_path() == "client.allowed_groups[0]");
  CHECK(contains(text_error("client: {allowed_groups: [ok, \"-x\"]}").reason(), "group name"));
  CHECK(text_error("client: {socket_group: \"two words\"}").key_path() == "client.socket_group");
  CHECK(text_error("client: {socket_group: " + std::string(33, 'g') + "}").key_path() ==
        "client.socket_group");

  CHECK(contains(text_error("client: {socket: run/x.sock}").reason(), "absolute path"));
  CHECK(contains(text_error("client: {socket: ''}").reason(), "absolute path"));
  const std::string at_limit = "/" + std::string(106, 's');  // 107 bytes + NUL fits sun_path
  CHECK(cfg::load_profile_text("t", "client: {socket: " + at_limit + "}", {}).client.socket ==
        at_limit);
  const cfg::ProfileError e = text_error("client: {socket: " + at_limit + "x}");
  CHECK(e.key_path() == "client.socket");
  CHECK(contains(e.reason(), "108"));
}

TEST_CASE("metrics.listen: off, host:port or a Unix socket path") {
  const auto listen = [](const std::string& value) {
    return cfg::load_profile_text("t", "metrics: {listen: " + value + "}", {}).metrics.listen;
  };
  CHECK(cfg::default_profile().metrics.listen.empty());
  CHECK(listen("\"\"").empty());
  CHECK(listen("127.0.0.1:9464") == "127.0.0.1:9464");
  CHECK(listen("\"[::1]:9464\"") == "[::1]:9464");
  CHECK(listen("/run/collectived/metrics.sock") == "/run/collectived/metrics.sock");
  CHECK(text_error("metrics: {listen: localhost:9464}").key_path() == "metrics.listen");
  CHECK(contains(text_error("metrics: {listen: 127.0.0.1}").reason(), "ADDRESS:PORT"));
  CHECK(contains(text_error("metrics: {listen: \"127.0.0.1:99999\"}").reason(), "ADDRESS:PORT"));
  CHECK(contains(text_error("metrics: {listen: /" + std::string(120, 'm') + "}").reason(), "108"));
}

TEST_CASE("to_yaml round-trips a profile") {
  SUBCASE("the default") {
    const cfg::Profile p = cfg::default_profile();
    const std::string yaml = cfg::to_yaml(p);
    CHECK(contains(yaml, "socket_mode: \"0660\""));
    for (const std::string& key : cfg::known_keys()) {
      CHECK_MESSAGE(contains(yaml, key.substr(key.rfind('.') + 1) + ":"), key);
    }
    check_equal(cfg::load_profile_text("x", yaml, {}), p);
  }
  SUBCASE("every key changed") {
    const cfg::Profile p = cfg::load_profile_text("t", R"(
node: {name: "null"}
client:
  socket: "/tmp/a b: c.sock"
  socket_mode: "0600"
  allowed_uids: [0, 1000, 4294967295]
  allowed_gids: [27]
  socket_group: ""
  allowed_groups: [video, "tenant-a"]
  max_frame_bytes: 4KiB
  max_clients: 7
  max_registrations_per_client: 9
peer:
  listen_address: "::1"
  port: 1
  secret_file: ""
  peers: ["n1:2", "[fe80::1]:47600"]
deadlines: {operation_ms: 1, connect_ms: 2, rendezvous_ms: 3, heartbeat_ms: 10,
            shutdown_ms: 5, client_request_ms: 6}
workers: {threads: 1024}
memory: {host_pool_bytes: 1000, max_registered_bytes: 64TiB}
transports: [verbs, local]
tcp: {streams_per_peer: 64, chunk_bytes: 64MiB, congestion_control: ""}
verbs: {hcas: [mlx5_0, "mlx5_3:2"], gid_index: 255, mtu: 256, qps_per_connection: 128,
        retry_count: 0, timeout: 31}
log: {level: trace}
)",
                                                  {});
    CHECK(p.node.name == "null");
    CHECK(p.peer.secret_file.empty());
    CHECK(p.tcp.congestion_control.empty());
    CHECK(p.client.socket_group.empty());
    CHECK(p.client.allowed_groups == std::vector<std::string>{"video", "tenant-a"});
    const std::string yaml = cfg::to_yaml(p);
    INFO(yaml);
    check_equal(cfg::load_profile_text("x", yaml, {}), p);
  }
}

TEST_CASE("a stray flow indicator at the top is a syntax error, not an endless parse") {
  // yaml-cpp 0.7's LoadAll loops forever (and grows memory) on ",a"; found by
  // tests/fuzz/profile_fuzz.
  for (const char* text : {",a", ",e ye\\crepee r ok`ct 3\n", "a: 1\n,b\n"}) {
    CAPTURE(text);
    CHECK_THROWS_AS(cfg::load_profile_text("f.yaml", text, {}), cfg::ProfileError);
  }
  try {
    cfg::load_profile_text("f.yaml", "client:\n  socket: /tmp/a.sock\n---\nlog:\n  level: debug\n", {});
    FAIL("two documents were accepted");
  } catch (const cfg::ProfileError& e) {
    CHECK(std::string(e.what()).find("expected one YAML document") != std::string::npos);
    CHECK(e.line() == 3);
  }
}

TEST_CASE("a string that is not UTF-8 is refused (it would not survive to_yaml)") {
  // Found by tests/fuzz/profile_fuzz: yaml-cpp's emitter writes invalid UTF-8
  // as U+FFFD, so a 68-byte socket path came back as 210 bytes.
  try {
    cfg::load_profile_text("f.yaml", "client:\n  socket: /tmp/x\xff.sock\n", {});  // a raw 0xff byte
    FAIL("a socket path with byte 0xff was accepted");
  } catch (const cfg::ProfileError& e) {
    CHECK(std::string(e.what()).find("client.socket") != std::string::npos);
    CHECK(std::string(e.what()).find("not valid UTF-8") != std::string::npos);
  }
  CHECK_THROWS_AS(cfg::load_profile_text("f.yaml", "node:\n  name: a\xc3\n", {}), cfg::ProfileError);
  CHECK(cfg::load_profile_text("f.yaml", "node:\n  name: \"h\\xe9llo \\u20ac\"\n", {}).node.name ==
        "h\xc3\xa9llo \xe2\x82\xac");
}

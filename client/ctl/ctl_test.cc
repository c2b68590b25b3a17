// Unit tests of collectivectl's printers and doctor checks. The sysfs and
// /proc trees here are written by the test: this machine has no HCA and no
// GPU, and the checks must read real hardware's layout right.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "client/ctl/doctor.h"
#include "client/ctl/json.h"
#include "client/ctl/status_print.h"
#include "client/ctl/table.h"

using namespace collectived;
using namespace collectived::client::ctl;
namespace fs = std::filesystem;

namespace {

struct Tree {
  fs::path root;
  Tree() {
    char dir[] = "/tmp/ctl-test-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    root = dir;
  }
  ~Tree() { fs::remove_all(root); }
  void put(const std::string& rel, const std::string& text) {
    const fs::path p = root / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string path(const std::string& rel = "") const { return (root / rel).string(); }
};

const Finding* find(const Report& r, const std::string& check) {
  for (const auto& f : r.findings()) {
    if (f.check == check) return &f;
  }
  return nullptr;
}

DaemonStatus sample_status() {
  DaemonStatus s;
  s.version = "0.1.0";
  s.node = "node-a";
  s.pid = 100;
  s.uptime_ms = 65000;
  s.protocol = 1;
  s.log_level = "info";
  s.client_socket = "/run/collectived/collectived.sock";
  s.clients.push_back({7, 4242, 1000, 1000, "trainer \"rank 0\"", 2, 8192, 5000});
  CommRow c;
  c.name = "3f2a";
  c.nranks = 2;
  c.ranks.push_back({0, 4242, 7, "node-a", true, 5});
  c.ranks.push_back({1, 4343, 8, "node-a", true, 4});
  c.ops.push_back({4, "all_reduce(count=1024, dtype=float32, op=sum)", 12500, false, -1, {1}});
  s.comms.push_back(c);
  s.communicators = 1;
  s.in_flight = 1;
  PeerRow p;
  p.address = "10.0.0.2:47600";
  p.node = "node-b";
  p.state = "ready";
  p.outbound = true;
  p.streams = 4;
  p.rtt_us = 85;
  p.skew_ms = -0.4;
  s.peers.push_back(p);
  return s;
}

}  // namespace

TEST_CASE("json: nesting, commas and escapes") {
  Json j;
  j.begin_object().field("a", 1).field("s", std::string("q\"\\\n\x01")).key("l").begin_array();
  j.value(true).null().begin_object().field("x", 2.5).end_object().end_array().end_object();
  CHECK(j.str() == "{\"a\":1,\"s\":\"q\\\"\\\\\\n\\u0001\",\"l\":[true,null,{\"x\":2.5}]}\n");
}

TEST_CASE("table: aligned columns, no trailing spaces") {
  Table t({"A", "LONGER"});
  t.row({"wide cell", "x"});
  t.row({"b", ""});
  CHECK(t.str() == "A          LONGER\nwide cell  x\nb\n");
  CHECK(human_bytes(512) == "512 B");
  CHECK(human_bytes(3 << 20) == "3.0 MiB");
  CHECK(human_duration_ms(850) == "850ms");
  CHECK(human_duration_ms(65000) == "1m 5s");
}

TEST_CASE("status names the ranks not arrived with pid and node, as a table and as JSON") {
  const DaemonStatus s = sample_status();
  const std::string text = print_status(s, false);
  CHECK(text.find("collectived 0.1.0 on node-a (pid 100), up 1m 5s") != std::string::npos);
  CHECK(text.find("in-flight operations: 1") != std::string::npos);
  CHECK(text.find("rank 1 (pid 4343 on node-a)") != std::string::npos);
  CHECK(text.find("waiting") != std::string::npos);
  CHECK(text.find("10.0.0.2:47600") != std::string::npos);
  const std::string json = print_status(s, true);
  CHECK(json.find("\"missing_ranks\":[{\"rank\":1,\"pid\":4343,\"node\":\"node-a\"}]") !=
        std::string::npos);
  CHECK(json.find("\"name\":\"trainer \\\"rank 0\\\"\"") != std::string::npos);
  CHECK(json.find("\"age_ms\":12500") != std::string::npos);
  const std::string comms = print_comms(s, false);
  CHECK(comms.find("3f2a") != std::string::npos);
  CHECK(comms.find("4343") != std::string::npos);
  CHECK(print_comms(s, true).find("\"next_seq\":4") != std::string::npos);
  CHECK(print_peers(s, false).find("node-b") != std::string::npos);
  CHECK(print_peers(s, true).find("\"rtt_us\":85") != std::string::npos);
}

TEST_CASE("report: exit codes 0 / 1 / 2, SKIP does not count") {
  Report r;
  r.add("a", Verdict::pass, "fine");
  r.add("b", Verdict::skip, "n/a");
  CHECK(r.exit_code() == kExitOk);
  r.add("c", Verdict::warn, "slow", "do this");
  CHECK(r.exit_code() == kExitWarnings);
  r.add("d", Verdict::fail, "broken", "do that");
  CHECK(r.exit_code() == kExitFailures);
  const std::string text = r.text();
  CHECK(text.find("WARN  c  slow\n") != std::string::npos);
  CHECK(text.find("fix: do that") != std::string::npos);
  CHECK(text.find("1 passed, 1 warnings, 1 failed, 1 skipped; exit code 2") != std::string::npos);
  CHECK(r.json().find("\"verdict\":\"FAIL\"") != std::string::npos);
}

TEST_CASE("hcas from sysfs: port state, link layer, RoCE MTU, GID table, gid_index") {
  Tree t;
  const std::string port = "class/infiniband/mlx5_0/ports/1/";
  t.put(port + "state", "4: ACTIVE\n");
  t.put(port + "phys_state", "5: LinkUp\n");
  t.put(port + "link_layer", "Ethernet\n");
  t.put(port + "rate", "100 Gb/sec (4X EDR)\n");
  t.put(port + "gids/0", "fe80:0000:0000:0000:0a00:27ff:fe00:0001\n");
  t.put(port + "gids/1", "fe80:0000:0000:0000:0a00:27ff:fe00:0001\n");
  t.put(port + "gids/2", "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
  t.put(port + "gids/3", "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
  t.put(port + "gids/4", "0000:0000:0000:0000:0000:0000:0000:0000\n");
  t.put(port + "gid_attrs/types/0", "IB/RoCE v1\n");
  t.put(port + "gid_attrs/types/1", "RoCE v2\n");
  t.put(port + "gid_attrs/types/2", "IB/RoCE v1\n");
  t.put(port + "gid_attrs/types/3", "RoCE v2\n");
  for (int i = 0; i < 4; ++i) t.put(port + "gid_attrs/ndevs/" + std::to_string(i), "eth0\n");
  t.put("class/net/eth0/mtu", "9000\n");
  t.put("class/infiniband/mlx5_0/device/infiniband_verbs/uverbs0/ibdev", "mlx5_0\n");
  t.put("dev/infiniband/uverbs0", "");

  DoctorContext ctx;
  ctx.options.sysfs_root = t.path();
  ctx.options.dev_root = t.path("dev");
  ctx.profile = config::load_profile_text("test", "verbs: {gid_index: 3}\n", {});
  Report r;
  check_hcas(ctx, r);
  CHECK(ctx.has_hca);
  const Finding* f = find(r, "hca mlx5_0:1");
  REQUIRE(f != nullptr);
  CHECK(f->verdict == Verdict::pass);
  CHECK(f->detail.find("ACTIVE (LinkUp), Ethernet, 100 Gb/sec (4X EDR), MTU 4096 (eth0 9000)") !=
        std::string::npos);
  CHECK(f->detail.find("[3] 10.0.0.1 RoCE v2 eth0") != std::string::npos);
  CHECK(f->detail.find("[4]") == std::string::npos);  // empty entries are left out
  REQUIRE(find(r, "hca mlx5_0:1 gid") != nullptr);
  CHECK(find(r, "hca mlx5_0:1 gid")->verdict == Verdict::pass);

  Report bad;
  ctx.profile = config::load_profile_text("test", "verbs: {gid_index: 7, hcas: [mlx5_9]}\n", {});
  t.put(port + "state", "1: DOWN\n");
  ::unlink(t.path("dev/infiniband/uverbs0").c_str());
  check_hcas(ctx, bad);
  CHECK(find(bad, "hca mlx5_0:1")->verdict == Verdict::warn);
  CHECK(find(bad, "hca mlx5_0:1 gid")->verdict == Verdict::fail);
  CHECK(find(bad, "hca mlx5_0:1 gid")->fix.find("RoCE v2 entry (1, 3)") != std::string::npos);
  CHECK(find(bad, "hca mlx5_9")->verdict == Verdict::fail);
  REQUIRE(find(bad, "hca mlx5_0") != nullptr);  // the device node is missing
  CHECK(find(bad, "hca mlx5_0")->fix.find("/dev/infiniband") != std::string::npos);
  CHECK(bad.exit_code() == kExitFailures);
}

TEST_CASE("no HCA: a WARN saying so, or SKIP when verbs is not in transports") {
  Tree t;
  DoctorContext ctx;
  ctx.options.sysfs_root = t.path();
  ctx.profile = config::default_profile();
  Report r;
  check_hcas(ctx, r);
  REQUIRE(find(r, "hca") != nullptr);
  CHECK(find(r, "hca")->verdict == Verdict::warn);
  CHECK(find(r, "hca")->detail.find("no RDMA device on this node") != std::string::npos);
  ctx.profile = config::load_profile_text("test", "transports: [local, tcp]\n", {});
  Report r2;
  check_hcas(ctx, r2);
  CHECK(find(r2, "hca")->verdict == Verdict::skip);
}

TEST_CASE("GPUDirect RDMA says which route is there and why it is on or off") {
  Tree t;
  DoctorContext ctx;
  ctx.options.sysfs_root = t.path();
  ctx.options.proc_root = t.path("proc");
  ctx.has_gpu = true;
  ctx.has_hca = true;
  Report off;
  check_gpudirect_rdma(ctx, off);
  REQUIRE(find(off, "gpudirect rdma") != nullptr);
  CHECK(find(off, "gpudirect rdma")->verdict == Verdict::warn);
  CHECK(find(off, "gpudirect rdma")->detail.find("no peer-memory module") != std::string::npos);
  CHECK(find(off, "gpudirect rdma")->fix.find("modprobe nvidia-peermem") != std::string::npos);
  t.put("module/nvidia_peermem/version", "580.159.04\n");
  Report on;
  check_gpudirect_rdma(ctx, on);
  CHECK(find(on, "gpudirect rdma")->verdict == Verdict::pass);
  CHECK(find(on, "gpudirect rdma")->detail.find("nvidia_peermem/version (version 580.159.04)") !=
        std::string::npos);
  ctx.has_hca = false;
  Report no_hca;
  check_gpudirect_rdma(ctx, no_hca);
  CHECK(find(no_hca, "gpudirect rdma")->verdict == Verdict::skip);
  CHECK(find(no_hca, "gpudirect rdma")->detail.rfind("off: no RDMA device", 0) == 0);
  CHECK(find(no_hca, "gpudirect rdma")->detail.find("with one it would be on (peer memory)") !=
        std::string::npos);
}

TEST_CASE("memlock: the daemon's limit from /proc/PID/limits") {
  Tree t;
  DoctorContext ctx;
  ctx.options.proc_root = t.path();
  ctx.profile = config::default_profile();
  ctx.daemon = DaemonStatus{};
  ctx.daemon->pid = 123;
  t.put("123/limits",
        "Limit                     Soft Limit           Hard Limit           Units\n"
        "Max locked memory         8388608              8388608              bytes\n");
  Report r;
  check_memlock(ctx, r);
  CHECK(find(r, "memlock")->verdict == Verdict::warn);
  CHECK(find(r, "memlock")->detail.find("the daemon (pid 123) is 8.0 MiB") != std::string::npos);
  CHECK(find(r, "memlock")->fix.find("LimitMEMLOCK=infinity") != std::string::npos);
  t.put("123/limits", "Max locked memory         unlimited            unlimited            bytes\n");
  Report ok;
  check_memlock(ctx, ok);
  CHECK(find(ok, "memlock")->verdict == Verdict::pass);
}

// Runs on machines without an HCA: libibverbs may be present or absent.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "engine/transport/verbs/devices.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "ipc/error.h"

namespace v = collectived::engine::transport::verbs;
using collectived::Code;
using collectived::Error;

namespace {

Error load_error(std::string_view soname) {
  try {
    v::IbverbsLibrary::load(soname);
  } catch (const Error& e) {
    return e;
  }
  FAIL("loading " << soname << " did not throw");
  return Error(Code::ok, "");
}

bool contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

// A throw-away directory tree standing in for /sys.
struct FakeSysfs {
  std::filesystem::path root;
  FakeSysfs() {
    root = std::filesystem::temp_directory_path() /
           ("verbs-sysfs-" + std::to_string(::getpid()));
    std::filesystem::remove_all(root);
  }
  ~FakeSysfs() { std::filesystem::remove_all(root); }
  void write(const std::string& rel, const std::string& text) const {
    const std::filesystem::path p = root / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
};

}  // namespace

TEST_CASE("a missing libibverbs is one clear error naming it and the Debian package") {
  const Error e = load_error("libibverbs-bogus-name.so.1");
  CHECK(e.code() == Code::unavailable);
  const std::string what = e.what();
  CHECK(contains(what, "libibverbs-bogus-name.so.1"));
  CHECK(contains(what, "libibverbs1"));
  CHECK(contains(what, "ibverbs-providers"));
}

TEST_CASE("a library without the verbs symbols names the first missing symbol") {
  // libc is always there and has none of them.
  const Error e = load_error("libc.so.6");
  CHECK(e.code() == Code::unavailable);
  const std::string what = e.what();
  CHECK(contains(what, "libc.so.6 has no symbol ibv_get_device_list"));
  CHECK(contains(what, "libibverbs1"));
}

TEST_CASE("the real libibverbs, when installed, resolves every symbol; discovery works without HCAs") {
  std::shared_ptr<const v::IbverbsLibrary> lib;
  try {
    lib = v::IbverbsLibrary::load();
  } catch (const Error& e) {
    MESSAGE("libibverbs.so.1 absent on this machine: " << e.what());
    CHECK(contains(e.what(), "libibverbs.so.1"));
    return;
  }
  CHECK(lib->soname() == "libibverbs.so.1");
  CHECK(contains(lib->path(), "libibverbs"));
  // rdma-core 44 (Debian 12) has the dma-buf registration.
  CHECK(lib->has_dmabuf());
  const std::vector<v::DeviceInfo> devices = v::discover_devices(*lib);
  if (devices.empty()) {
    const std::string reason = v::no_devices_reason();
    MESSAGE("no RDMA devices: " << reason);
    CHECK(!reason.empty());
  } else {
    MESSAGE(v::describe(devices));
  }
}

TEST_CASE("GID types come from sysfs gid_attrs; RoCE v2 IPv4-mapped entries are preferred") {
  FakeSysfs sys;
  sys.write("class/infiniband/rxe0/ports/1/gid_attrs/types/0", "IB/RoCE v1\n");
  sys.write("class/infiniband/rxe0/ports/1/gid_attrs/types/1", "RoCE v2\n");
  sys.write("class/infiniband/rxe0/ports/1/gid_attrs/types/2", "IB/RoCE v1\n");
  sys.write("class/infiniband/rxe0/ports/1/gid_attrs/types/3", "RoCE v2\n");
  sys.write("class/infiniband/rxe0/ports/1/gid_attrs/ndevs/3", "veth0\n");

  v::PortInfo port;
  port.link_layer = "Ethernet";
  const char* gids[] = {"fe80:0000:0000:0000:5054:00ff:fe12:3456",
                        "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                        "0000:0000:0000:0000:0000:ffff:0a63:0001",
                        "0000:0000:0000:0000:0000:ffff:0a63:0001"};
  for (int i = 0; i < 4; ++i) {
    v::GidEntry g = v::read_gid_attrs(sys.root.string(), "rxe0", 1, i);
    g.gid = gids[i];
    port.gids.push_back(g);
  }
  CHECK(port.gids[0].type == "IB/RoCE v1");
  CHECK(port.gids[1].roce_v2());
  CHECK(port.gids[3].netdev == "veth0");
  CHECK(port.gids[2].ipv4_mapped());
  CHECK(v::choose_gid_index(port) == 3);

  port.gids.pop_back();  // no v2 IPv4 entry left: the link-local v2 one
  CHECK(v::choose_gid_index(port) == 1);

  port.link_layer = "InfiniBand";  // IB: index 0 always
  CHECK(v::choose_gid_index(port) == 0);

  v::PortInfo empty;
  CHECK(!v::choose_gid_index(empty).has_value());

  // An entry whose files are missing has no type rather than an error.
  CHECK(v::read_gid_attrs(sys.root.string(), "rxe0", 1, 9).type.empty());
}

TEST_CASE("formatting helpers") {
  const std::uint8_t raw[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x50, 0x54, 0, 0xff, 0xfe, 0x12, 0x34, 0x56};
  CHECK(v::format_gid(raw) == "fe80:0000:0000:0000:5054:00ff:fe12:3456");
  CHECK(v::mtu_bytes(1) == 256);
  CHECK(v::mtu_bytes(3) == 1024);
  CHECK(v::mtu_bytes(5) == 4096);
  CHECK(v::mtu_bytes(0) == 0);
  CHECK(v::no_devices_reason("/nonexistent-sysfs").find("no RDMA device") != std::string::npos);
}

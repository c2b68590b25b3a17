#include "engine/transport/verbs/devices.h"

#include <endian.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/transport/verbs/ibverbs_functions.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "ipc/error.h"

namespace collectived::engine::transport::verbs {
namespace {

std::string read_line(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

bool all_zero(const std::uint8_t (&raw)[16]) {
  for (std::uint8_t b : raw) {
    if (b != 0) return false;
  }
  return true;
}

std::string guid_text(__be64 guid_be) {
  const std::uint64_t g = be64toh(guid_be);
  char buf[24];
  std::snprintf(buf, sizeof buf, "%04x:%04x:%04x:%04x", static_cast<unsigned>(g >> 48) & 0xffff,
                static_cast<unsigned>(g >> 32) & 0xffff, static_cast<unsigned>(g >> 16) & 0xffff,
                static_cast<unsigned>(g) & 0xffff);
  return buf;
}

const char* link_layer_name(std::uint8_t link_layer) {
  switch (link_layer) {
    case IBV_LINK_LAYER_ETHERNET: return "Ethernet";
    case IBV_LINK_LAYER_INFINIBAND: return "InfiniBand";
    default: return "InfiniBand";  // IBV_LINK_LAYER_UNSPECIFIED: old drivers, IB
  }
}

}  // namespace

bool GidEntry::ipv4_mapped() const {
  return gid.rfind("0000:0000:0000:0000:0000:ffff:", 0) == 0;
}

std::string format_gid(const std::uint8_t (&raw)[16]) {
  char buf[40];
  std::snprintf(buf, sizeof buf,
                "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", raw[0],
                raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7], raw[8], raw[9], raw[10],
                raw[11], raw[12], raw[13], raw[14], raw[15]);
  return buf;
}

std::uint32_t mtu_bytes(int ibv_mtu_value) {
  if (ibv_mtu_value < IBV_MTU_256 || ibv_mtu_value > IBV_MTU_4096) return 0;
  return 128u << ibv_mtu_value;  // IBV_MTU_256 == 1
}

GidEntry read_gid_attrs(const std::string& sysfs_root, const std::string& device,
                        std::uint32_t port, int index) {
  const std::filesystem::path attrs = std::filesystem::path(sysfs_root) / "class/infiniband" /
                                      device / "ports" / std::to_string(port) / "gid_attrs";
  GidEntry entry;
  entry.index = index;
  // The file reads "RoCE v2" or "IB/RoCE v1"; reading an unused entry fails (EINVAL).
  entry.type = read_line(attrs / "types" / std::to_string(index));
  entry.netdev = read_line(attrs / "ndevs" / std::to_string(index));
  return entry;
}

std::optional<int> choose_gid_index(const PortInfo& port) {
  if (port.gids.empty()) return std::nullopt;
  if (port.link_layer != "Ethernet") {
    for (const GidEntry& g : port.gids) {
      if (g.index == 0) return 0;
    }
    return port.gids.front().index;
  }
  // RoCE v2 is routable (UDP/IP); an IPv4-mapped entry is the one whose
  // address the fabric's routes and ECMP know; link-local v2 entries come next.
  for (const GidEntry& g : port.gids) {
    if (g.roce_v2() && g.ipv4_mapped()) return g.index;
  }
  for (const GidEntry& g : port.gids) {
    if (g.roce_v2()) return g.index;
  }
  return port.gids.front().index;
}

PortInfo query_port_info(const IbverbsFunctions& f, ibv_context* ctx, const std::string& device,
                         std::uint32_t p, const std::string& sysfs_root) {
  ibv_port_attr pa{};
  const int rc = f.query_port(ctx, static_cast<std::uint8_t>(p), &pa);
  if (rc != 0) {
    throw_errno("ibv_query_port " + device + ":" + std::to_string(p), rc > 0 ? rc : errno);
  }
  PortInfo port;
  port.number = p;
  port.state = f.port_state_str(pa.state);
  port.active = pa.state == IBV_PORT_ACTIVE;
  port.link_layer = link_layer_name(pa.link_layer);
  port.active_mtu = mtu_bytes(pa.active_mtu);
  port.max_mtu = mtu_bytes(pa.max_mtu);
  port.lid = pa.lid;
  for (int g = 0; g < pa.gid_tbl_len; ++g) {
    ibv_gid gid{};
    if (f.query_gid(ctx, static_cast<std::uint8_t>(p), g, &gid) != 0) continue;
    if (all_zero(gid.raw)) continue;
    GidEntry entry = read_gid_attrs(sysfs_root, device, p, g);
    entry.gid = format_gid(gid.raw);
    port.gids.push_back(std::move(entry));
  }
  return port;
}

std::vector<DeviceInfo> discover_devices(const IbverbsLibrary& lib, const std::string& sysfs_root) {
  const IbverbsFunctions& f = lib.fn();
  std::vector<DeviceInfo> out;
  int count = 0;
  ibv_device** list = f.get_device_list(&count);
  if (list == nullptr) return out;
  for (int i = 0; i < count; ++i) {
    DeviceInfo dev;
    dev.name = f.get_device_name(list[i]);
    dev.node_guid = guid_text(f.get_device_guid(list[i]));
    ibv_context* ctx = f.open_device(list[i]);
    if (ctx != nullptr) {
      ibv_device_attr attr{};
      if (f.query_device(ctx, &attr) == 0) {
        for (std::uint32_t p = 1; p <= attr.phys_port_cnt; ++p) {
          PortInfo port;
          try {
            port = query_port_info(f, ctx, dev.name, p, sysfs_root);
          } catch (const Error&) {
            continue;
          }
          dev.ports.push_back(std::move(port));
        }
      }
      f.close_device(ctx);
    }
    out.push_back(std::move(dev));
  }
  f.free_device_list(list);
  return out;
}

std::string no_devices_reason(const std::string& sysfs_root) {
  const std::filesystem::path cls = std::filesystem::path(sysfs_root) / "class/infiniband";
  std::error_code ec;
  if (!std::filesystem::is_directory(cls, ec) || std::filesystem::is_empty(cls, ec)) {
    return "no RDMA device in " + cls.string() +
           " (no HCA, or its kernel driver is not loaded: mlx5_ib, rdma_rxe, ...)";
  }
  return "the kernel has RDMA devices in " + cls.string() +
         " but libibverbs lists none: install the user-space provider package ibverbs-providers";
}

std::string describe(const std::vector<DeviceInfo>& devices) {
  std::ostringstream out;
  for (const DeviceInfo& d : devices) {
    out << d.name << " guid " << d.node_guid << '\n';
    for (const PortInfo& p : d.ports) {
      out << "  port " << p.number << ": " << p.state << ", " << p.link_layer << ", mtu "
          << p.active_mtu << " (max " << p.max_mtu << ")";
      if (p.link_layer == "InfiniBand") out << ", lid " << p.lid;
      const std::optional<int> chosen = choose_gid_index(p);
      out << ", gid index " << (chosen ? std::to_string(*chosen) : std::string("none")) << '\n';
      for (const GidEntry& g : p.gids) {
        out << "    gid " << g.index << ' ' << g.gid;
        if (!g.type.empty()) out << ' ' << g.type;
        if (!g.netdev.empty()) out << ' ' << g.netdev;
        out << '\n';
      }
    }
  }
  return out.str();
}

}  // namespace collectived::engine::transport::verbs

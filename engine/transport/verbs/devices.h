// RDMA device discovery: HCAs, their ports, state, link layer, MTU and GID
// table, with RoCE v2 entries identified from sysfs. Used by the verbs
// transport to pick a port and GID, and by `doctor` to print what is there.
// Free of <infiniband/verbs.h>.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

struct ibv_context;

namespace collectived::engine::transport::verbs {

class IbverbsLibrary;
struct IbverbsFunctions;

/// One GID table entry of a port.
struct GidEntry {
  int index = 0;
  std::string gid;     ///< "fe80:0000:...:0001" (8 groups of 4 hex digits), as in sysfs
  std::string type;    ///< sysfs gid_attrs/types: "RoCE v2", "IB/RoCE v1", or "" (IB, unknown)
  std::string netdev;  ///< sysfs gid_attrs/ndevs: the Ethernet device (RoCE), else ""
  bool roce_v2() const { return type == "RoCE v2"; }
  /// An IPv4-mapped GID (::ffff:a.b.c.d): the address RoCE v2 routes by.
  bool ipv4_mapped() const;
};

/// One port of an HCA.
struct PortInfo {
  std::uint32_t number = 0;      ///< 1-based
  std::string state;             ///< ibv_port_state_str(): "active", "down", "init", ...
  bool active = false;
  std::string link_layer;        ///< "InfiniBand" or "Ethernet"
  std::uint32_t active_mtu = 0;  ///< bytes (256..4096)
  std::uint32_t max_mtu = 0;     ///< bytes
  std::uint16_t lid = 0;         ///< InfiniBand only
  std::vector<GidEntry> gids;    ///< non-zero entries only
};

/// One HCA.
struct DeviceInfo {
  std::string name;        ///< "mlx5_0", "rxe0"
  std::string node_guid;   ///< "0002:c903:0042:1a2b"
  std::vector<PortInfo> ports;
};

/// Opens every device libibverbs lists, queries its ports and GIDs and reads
/// the GID types from `sysfs_root`/class/infiniband/DEV/ports/N/gid_attrs.
/// An empty result means no HCA (or no provider: see no_devices_reason()).
/// A device that cannot be opened is reported with no ports rather than thrown.
std::vector<DeviceInfo> discover_devices(const IbverbsLibrary& lib,
                                         const std::string& sysfs_root = "/sys");

/// Queries one port of an opened device (attributes, non-zero GIDs, GID types
/// from sysfs). Throws Error(system) when the port cannot be queried.
PortInfo query_port_info(const IbverbsFunctions& f, ibv_context* ctx, const std::string& device,
                         std::uint32_t port, const std::string& sysfs_root = "/sys");

/// Why discover_devices() found nothing, in one line for logs and `doctor`.
std::string no_devices_reason(const std::string& sysfs_root = "/sys");

/// Reads the GID type and netdev of entry `index` from sysfs ("" when absent).
GidEntry read_gid_attrs(const std::string& sysfs_root, const std::string& device,
                        std::uint32_t port, int index);

/// The GID index to use on a port: on Ethernet (RoCE), the first RoCE v2
/// IPv4-mapped entry, else the first RoCE v2 entry, else the first entry; on
/// InfiniBand, index 0. nullopt when the port has no usable GID.
std::optional<int> choose_gid_index(const PortInfo& port);

/// Formats 16 GID bytes like sysfs does.
std::string format_gid(const std::uint8_t (&raw)[16]);

/// Bytes of an ibv_mtu enum value (1 -> 256 ... 5 -> 4096), 0 when unknown.
std::uint32_t mtu_bytes(int ibv_mtu_value);

/// A readable multi-line listing of `devices` (for `doctor` and logs).
std::string describe(const std::vector<DeviceInfo>& devices);

}  // namespace collectived::engine::transport::verbs

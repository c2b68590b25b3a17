// doctor: libibverbs (loadable, every symbol the verbs transport calls, its
// providers) and the HCAs from sysfs (ports, state, link layer, MTU, GID
// table, device nodes), checked against the profile's verbs keys.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "client/ctl/doctor.h"
#include "engine/transport/verbs/devices.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "ipc/error.h"

namespace collectived::client::ctl {

namespace {

std::string dirname_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// "4: ACTIVE" -> "ACTIVE"
std::string after_colon(const std::string& s) {
  const auto c = s.find(": ");
  return c == std::string::npos ? s : s.substr(c + 2);
}

bool zero_gid(const std::string& gid) {
  return gid.empty() || std::all_of(gid.begin(), gid.end(), [](char c) { return c == '0' || c == ':'; });
}

// IPv4-mapped GID "0000:0000:0000:0000:0000:ffff:0a00:0001" -> "10.0.0.1".
std::string ipv4_of(const std::string& gid) {
  if (gid.size() != 39 || gid.compare(0, 30, "0000:0000:0000:0000:0000:ffff:") != 0) return "";
  const unsigned long hi = std::strtoul(gid.substr(30, 4).c_str(), nullptr, 16);
  const unsigned long lo = std::strtoul(gid.substr(35, 4).c_str(), nullptr, 16);
  return std::to_string(hi >> 8) + "." + std::to_string(hi & 255) + "." + std::to_string(lo >> 8) +
         "." + std::to_string(lo & 255);
}

// Largest InfiniBand MTU that fits an Ethernet MTU (RoCE adds headers).
std::uint32_t roce_mtu(std::uint32_t eth_mtu) {
  for (std::uint32_t m : {4096u, 2048u, 1024u, 512u, 256u}) {
    if (eth_mtu >= m + 82) return m;  // IB BTH+GRH/IP+UDP headers and ICRC
  }
  return 0;
}

}  // namespace

void check_ibverbs(DoctorContext& ctx, Report& r) {
  const bool used = ctx.uses_verbs();
  // The daemon's own loader: the same soname, every symbol it calls resolved now.
  try {
    ctx.verbs = verbs::IbverbsLibrary::load();
  } catch (const Error& e) {
    const std::string why = e.what();
    const bool symbol = why.find("has no symbol") != std::string::npos;
    r.add("ibverbs", symbol ? Verdict::fail : used ? Verdict::warn : Verdict::skip,
          why + (used && !symbol ? "; peers use tcp" : ""),
          symbol ? "an old or foreign libibverbs comes first (LD_LIBRARY_PATH, ldconfig -p | grep "
                   "ibverbs); install rdma-core's libibverbs1"
          : used ? "apt install libibverbs1 ibverbs-providers, or remove verbs from transports"
                 : "");
    return;
  }
  const verbs::IbverbsLibrary& lib = *ctx.verbs;
  ctx.dmabuf_in_verbs = lib.has_dmabuf();
  r.add("ibverbs", Verdict::pass,
        lib.path() + ": every symbol the verbs transport calls resolves" +
            (lib.has_dmabuf() ? "; ibv_reg_dmabuf_mr present (dma-buf registration)"
                              : "; no ibv_reg_dmabuf_mr (rdma-core < 34: no dma-buf registration)"));
  // Providers: rdma-core loads lib<name>-rdmav*.so from libibverbs/ beside itself.
  std::vector<std::string> providers;
  for (const auto& f : list_dir(dirname_of(lib.path()) + "/libibverbs")) {
    const auto dash = f.find("-rdmav");
    if (f.rfind("lib", 0) == 0 && dash != std::string::npos) providers.push_back(f.substr(3, dash - 3));
  }
  if (providers.empty()) {
    r.add("providers", used ? Verdict::warn : Verdict::skip,
          "no libibverbs providers in " + dirname_of(lib.path()) + "/libibverbs: no HCA can be opened",
          used ? "apt install ibverbs-providers (mlx5, efa, rxe, ... drivers of rdma-core)" : "");
  } else {
    std::string names;
    for (const auto& n : providers) names += (names.empty() ? "" : " ") + n;
    r.add("providers", Verdict::pass, std::to_string(providers.size()) + " installed: " + names);
  }
}

void check_hcas(DoctorContext& ctx, Report& r) {
  const std::string base = ctx.options.sysfs_root + "/class/infiniband";
  const auto devices = list_dir(base);
  const bool used = ctx.uses_verbs();
  if (devices.empty()) {
    r.add("hca", used ? Verdict::warn : Verdict::skip,
          "no RDMA device on this node (" + base + " is " +
              (::access(base.c_str(), F_OK) == 0 ? "empty" : "absent") +
              "): the verbs transport is unavailable, peers use tcp",
          used ? "load the HCA's kernel driver (modprobe mlx5_ib; rdma link show), or remove "
                 "verbs from transports in the profile on nodes without one"
               : "");
    if (ctx.profile) {
      for (const auto& h : ctx.profile->verbs.hcas) {
        r.add("hca " + h.name, Verdict::fail, "verbs.hcas names " + h.name + ", which does not exist",
              "fix verbs.hcas (rdma link show lists the devices) or leave it empty to discover");
      }
    }
    return;
  }
  ctx.has_hca = true;
  // What libibverbs itself reports (active MTU): the daemon's discovery code.
  std::vector<verbs::DeviceInfo> found;
  const bool real_sysfs = ctx.options.sysfs_root == "/sys";
  if (ctx.verbs && real_sysfs) {
    found = verbs::discover_devices(*ctx.verbs, ctx.options.sysfs_root);
    if (found.empty()) {
      r.add("hca", Verdict::warn, verbs::no_devices_reason(ctx.options.sysfs_root),
            "apt install ibverbs-providers (the user-space driver of the HCA)");
    }
  }
  if (ctx.profile) {
    for (const auto& h : ctx.profile->verbs.hcas) {
      if (std::find(devices.begin(), devices.end(), h.name) == devices.end()) {
        r.add("hca " + h.name, Verdict::fail,
              "verbs.hcas names " + h.name + ", which does not exist (present: " +
                  [&] {
                    std::string s;
                    for (const auto& d : devices) s += (s.empty() ? "" : " ") + d;
                    return s;
                  }() + ")",
              "fix verbs.hcas or leave it empty to discover");
      }
    }
  }
  for (const auto& dev : devices) {
    const std::string dir = base + "/" + dev;
    // The character device the verbs library opens: missing inside containers
    // that did not mount /dev/infiniband.
    for (const auto& uv : list_dir(dir + "/device/infiniband_verbs")) {
      const std::string node = ctx.options.dev_root + "/infiniband/" + uv;
      if (::access(node.c_str(), R_OK | W_OK) != 0) {
        r.add("hca " + dev, Verdict::fail, node + ": " + std::strerror(errno),
              "give the daemon the RDMA device nodes: in Kubernetes mount hostPath /dev/infiniband "
              "(docs/kubernetes/), under systemd keep DeviceAllow=char-infiniband_verbs");
      }
    }
    for (const auto& port : list_dir(dir + "/ports")) {
      const std::string pdir = dir + "/ports/" + port;
      const std::string state = after_colon(read_line(pdir + "/state").value_or("?"));
      const std::string phys = after_colon(read_line(pdir + "/phys_state").value_or("?"));
      const std::string link = read_line(pdir + "/link_layer").value_or("?");
      const std::string rate = read_line(pdir + "/rate").value_or("?");
      std::string gids;
      std::vector<int> present, roce_v2;
      for (const auto& g : list_dir(pdir + "/gids")) {
        const std::string gid = read_line(pdir + "/gids/" + g).value_or("");
        if (zero_gid(gid)) continue;
        const int index = std::atoi(g.c_str());
        present.push_back(index);
        const std::string type = read_line(pdir + "/gid_attrs/types/" + g).value_or("");
        const std::string ndev = read_line(pdir + "/gid_attrs/ndevs/" + g).value_or("");
        if (type == "RoCE v2") roce_v2.push_back(index);
        const std::string ip = ipv4_of(gid);
        gids += std::string(gids.empty() ? " [" : "; [") + g + "] " + (ip.empty() ? gid : ip) +
                (type.empty() ? "" : " " + type) + (ndev.empty() ? "" : " " + ndev);
      }
      std::sort(present.begin(), present.end());
      std::string mtu = "MTU unknown (libibverbs did not open " + dev + ")";
      for (const auto& d : found) {
        for (const auto& fp : d.ports) {
          if (d.name == dev && std::to_string(fp.number) == port) {
            mtu = "MTU " + std::to_string(fp.active_mtu) + " (max " + std::to_string(fp.max_mtu) + ")";
          }
        }
      }
      if (found.empty() && link == "Ethernet") {
        // RoCE: the path MTU follows the Ethernet device's MTU.
        const std::string ndev = read_line(pdir + "/gid_attrs/ndevs/0").value_or("");
        const auto eth = read_line(ctx.options.sysfs_root + "/class/net/" + ndev + "/mtu");
        if (eth) {
          const auto m = roce_mtu(static_cast<std::uint32_t>(std::atoi(eth->c_str())));
          mtu = "MTU " + std::to_string(m) + " (" + ndev + " " + *eth + ")";
        }
      }
      const std::string name = "hca " + dev + ":" + port;
      const std::string detail = state + " (" + phys + "), " + link + ", " + rate + ", " + mtu +
                                 "; GIDs:" + (gids.empty() ? " none" : gids);
      if (state != "ACTIVE") {
        r.add(name, Verdict::warn, detail,
              "bring the link up: check the cable and switch port (ibstat, rdma link show); an "
              "InfiniBand port stuck in INIT needs a subnet manager (opensm)");
      } else if (present.empty()) {
        r.add(name, Verdict::warn, detail,
              "the port has no GID: on RoCE give its Ethernet device an IP address");
      } else {
        r.add(name, Verdict::pass, detail);
      }
      if (ctx.profile && ctx.profile->verbs.gid_index >= 0) {
        const int want = ctx.profile->verbs.gid_index;
        if (!std::binary_search(present.begin(), present.end(), want)) {
          std::string v2;
          for (int i : roce_v2) v2 += (v2.empty() ? "" : ", ") + std::to_string(i);
          r.add(name + " gid", Verdict::fail,
                "verbs.gid_index " + std::to_string(want) + " is not a GID of this port",
                "set verbs.gid_index to " +
                    (v2.empty() ? std::string("a listed index") : "a RoCE v2 entry (" + v2 + ")") +
                    ", or -1 to discover");
        } else if (link == "Ethernet" &&
                   std::find(roce_v2.begin(), roce_v2.end(), want) == roce_v2.end()) {
          r.add(name + " gid", Verdict::warn,
                "verbs.gid_index " + std::to_string(want) + " is not a RoCE v2 entry",
                "RoCE v1 is not routable across subnets; prefer a RoCE v2 index or -1");
        } else {
          r.add(name + " gid", Verdict::pass,
                "verbs.gid_index " + std::to_string(want) + " is valid on this port");
        }
      }
    }
  }
}

}  // namespace collectived::client::ctl

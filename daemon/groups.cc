#include "daemon/groups.h"

#include <grp.h>

#include <algorithm>
#include <cerrno>

#include "ipc/error.h"

namespace collectived::daemon {

std::optional<gid_t> group_id(const std::string& name) {
  group entry{};
  group* found = nullptr;
  std::vector<char> buffer(16384);
  for (;;) {
    const int rc = ::getgrnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &found);
    if (rc == ERANGE && buffer.size() < (1u << 24)) {
      buffer.resize(buffer.size() * 4);  // a group with very many members
      continue;
    }
    // Not found is 0 with found == nullptr; glibc also reports ENOENT-like
    // codes for a database that has no such entry.
    if (rc == 0 || rc == ENOENT || rc == ESRCH) break;
    throw_errno("looking up group '" + name + "' (getgrnam_r)", rc);
  }
  if (found == nullptr) return std::nullopt;
  return found->gr_gid;
}

std::vector<gid_t> resolve_allowed_gids(const std::vector<std::uint32_t>& gids,
                                        const std::vector<std::string>& names,
                                        std::vector<std::string>& missing) {
  std::vector<gid_t> out(gids.begin(), gids.end());
  for (const std::string& name : names) {
    if (const auto gid = group_id(name)) {
      out.push_back(*gid);
    } else if (std::find(missing.begin(), missing.end(), name) == missing.end()) {
      missing.push_back(name);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace collectived::daemon

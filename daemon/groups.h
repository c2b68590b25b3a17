// Group names of the profile (client.socket_group, client.allowed_groups)
// turned into gids: a package creates its group at install time with a gid
// that no profile can know in advance, so names are resolved when the daemon
// loads the profile, not when the profile is parsed.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>


namespace collectived::daemon {

/// The gid of group `name`; nullopt where no such group exists. Throws
/// Error(Code::system) when the group database cannot be read.
std::optional<gid_t> group_id(const std::string& name);

/// allowed_gids plus the gids of allowed_groups. A name with no group allows
/// no one; it is added to `missing` (for the caller's one warning).
std::vector<gid_t> resolve_allowed_gids(const std::vector<std::uint32_t>& gids,
                                        const std::vector<std::string>& names,
                                        std::vector<std::string>& missing);

}  // namespace collectived::daemon

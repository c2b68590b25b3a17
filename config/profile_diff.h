// Key-by-key comparison of two profiles (SIGHUP reload reports what changed).
#pragma once

#include <string>
#include <vector>

#include "config/profile.h"

namespace collectived::config {

struct KeyChange {
  std::string key;     ///< dotted key path, e.g. "log.level"
  std::string before;  ///< value as YAML flow text
  std::string after;
};

/// Every key whose value differs between `before` and `after`, in schema order.
std::vector<KeyChange> diff(const Profile& before, const Profile& after);

}  // namespace collectived::config

#include "config/profile_diff.h"

#include <yaml-cpp/yaml.h>

#include <map>

namespace collectived::config {
namespace {

// Flattens a rendered profile into "a.b" -> flow text, so that the comparison
// follows the schema's own rendering instead of a second list of fields.
void flatten(const YAML::Node& node, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  if (node.IsMap()) {
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      flatten(kv.second, prefix.empty() ? key : prefix + "." + key, out);
    }
    return;
  }
  YAML::Emitter e;
  e << YAML::Flow << node;
  out[prefix] = e.c_str();
}

std::map<std::string, std::string> flat(const Profile& p) {
  std::map<std::string, std::string> out;
  flatten(YAML::Load(to_yaml(p)), "", out);
  return out;
}

}  // namespace

std::vector<KeyChange> diff(const Profile& before, const Profile& after) {
  const auto a = flat(before);
  const auto b = flat(after);
  std::vector<KeyChange> changes;
  for (const std::string& key : known_keys()) {
    const auto ia = a.find(key);
    const auto ib = b.find(key);
    const std::string va = ia == a.end() ? "" : ia->second;
    const std::string vb = ib == b.end() ? "" : ib->second;
    if (va != vb) changes.push_back({key, va, vb});
  }
  return changes;
}

}  // namespace collectived::config

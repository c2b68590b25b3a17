#include "engine/algorithm_options.h"

namespace collectived::engine {

std::optional<AlgorithmOverride> parse_algorithm_override(std::string_view name) {
  if (name == "auto") return AlgorithmOverride::automatic;
  if (name == "ring") return AlgorithmOverride::ring;
  if (name == "pairwise") return AlgorithmOverride::pairwise;
  if (name == "direct") return AlgorithmOverride::direct;
  if (name == "tree") return AlgorithmOverride::tree;
  return std::nullopt;
}

std::string_view to_string(AlgorithmOverride forced) {
  switch (forced) {
    case AlgorithmOverride::automatic: break;
    case AlgorithmOverride::ring: return "ring";
    case AlgorithmOverride::pairwise: return "pairwise";
    case AlgorithmOverride::direct: return "direct";
    case AlgorithmOverride::tree: return "tree";
  }
  return "auto";
}

}  // namespace collectived::engine

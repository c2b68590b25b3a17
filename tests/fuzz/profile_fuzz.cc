// Fuzz target: YAML node profiles (config/profile.h), as collectived
// --profile FILE --set KEY=VALUE reads them.
//
// Input: the file's text, optionally followed by "\n#--set\n" and one
// override. Loading must either give a valid profile or throw ProfileError;
// a valid profile must survive to_yaml and load again to the same YAML.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "config/profile.h"

using namespace collectived;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Debugging aid: the input being run, for crashes libFuzzer cannot save
  // (an out-of-memory kill).
  if (const char* save = std::getenv("COLLECTIVED_FUZZ_SAVE")) {
    if (std::FILE* f = std::fopen(save, "wb")) {
      std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  constexpr std::string_view kSep = "\n#--set\n";
  if (const auto at = text.find(kSep); at != std::string_view::npos) {
    overrides.emplace_back(text.substr(at + kSep.size()));
    text = text.substr(0, at);
  }
  config::Profile profile;
  try {
    profile = config::load_profile_text("fuzz.yaml", text, overrides);
  } catch (const config::ProfileError&) {
    return 0;
  }
  const std::string yaml = config::to_yaml(profile);
  std::string again;
  try {
    again = config::to_yaml(config::load_profile_text("round-trip.yaml", yaml, {}));
  } catch (const config::ProfileError& e) {
    std::fprintf(stderr, "a valid profile's YAML does not load again: %s\n%s\n", e.what(),
                 yaml.c_str());
    std::abort();
  }
  if (again != yaml) {
    std::fprintf(stderr, "to_yaml is not stable:\n%s\n---\n%s\n", yaml.c_str(), again.c_str());
    std::abort();
  }
  return 0;
}

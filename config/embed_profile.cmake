# Writes a C++ source whose default_profile_text() returns INPUT's bytes exactly.
# Run at build time: cmake -DINPUT=<yaml> -DOUTPUT=<.cc> -P embed_profile.cmake
# Bytes go in as a hex array, so no content can break out of a string literal.
file(READ "${INPUT}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REPEAT "0x[0-9a-f][0-9a-f]," 16 sixteen)
string(REGEX REPLACE "(${sixteen})" "\\1\n    " bytes "${bytes}")
file(WRITE "${OUTPUT}" "// Generated from ${INPUT} by embed_profile.cmake; do not edit.
#include \"config/profile.h\"

namespace collectived::config {
namespace {
// A trailing NUL keeps the array non-empty when the file is empty.
constexpr unsigned char kText[] = {
    ${bytes}0x00};
}  // namespace

std::string_view default_profile_text() {
  return {reinterpret_cast<const char*>(kText), sizeof kText - 1};
}

}  // namespace collectived::config
")

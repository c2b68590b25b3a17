// A small streaming JSON writer for collectivectl's --json output.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace collectived::client::ctl {

/// Builds one JSON document: objects and arrays nest, commas and string
/// escapes are handled here. Output is compact (one line) plus a final newline.
class Json {
 public:
  Json& begin_object();
  Json& end_object();
  Json& begin_array();
  Json& end_array();
  /// The key of the next value inside an object.
  Json& key(std::string_view k);
  Json& value(std::string_view v);
  Json& value(const char* v) { return value(std::string_view(v)); }
  Json& value(const std::string& v) { return value(std::string_view(v)); }
  Json& value(bool v);
  Json& value(std::int64_t v);
  Json& value(std::uint64_t v);
  Json& value(int v) { return value(static_cast<std::int64_t>(v)); }
  Json& value(unsigned v) { return value(static_cast<std::uint64_t>(v)); }
  Json& value(double v);
  Json& null();
  /// key(k).value(v)
  template <typename T>
  Json& field(std::string_view k, const T& v) {
    return key(k).value(v);
  }
  std::string str() const { return out_ + "\n"; }

  /// `s` as a quoted JSON string.
  static std::string quote(std::string_view s);

 private:
  void before_value();
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

}  // namespace collectived::client::ctl

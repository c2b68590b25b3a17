#include "client/ctl/json.h"

#include <cmath>
#include <cstdio>

namespace collectived::client::ctl {

std::string Json::quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

void Json::before_value() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!first_.empty()) {
    if (!first_.back()) out_ += ',';
    first_.back() = false;
  }
}

Json& Json::begin_object() {
  before_value();
  out_ += '{';
  first_.push_back(true);
  return *this;
}

Json& Json::end_object() {
  out_ += '}';
  first_.pop_back();
  return *this;
}

Json& Json::begin_array() {
  before_value();
  out_ += '[';
  first_.push_back(true);
  return *this;
}

Json& Json::end_array() {
  out_ += ']';
  first_.pop_back();
  return *this;
}

Json& Json::key(std::string_view k) {
  before_value();
  out_ += quote(k);
  out_ += ':';
  after_key_ = true;
  return *this;
}

Json& Json::value(std::string_view v) {
  before_value();
  out_ += quote(v);
  return *this;
}

Json& Json::value(bool v) {
  before_value();
  out_ += v ? "true" : "false";
  return *this;
}

Json& Json::value(std::int64_t v) {
  before_value();
  out_ += std::to_string(v);
  return *this;
}

Json& Json::value(std::uint64_t v) {
  before_value();
  out_ += std::to_string(v);
  return *this;
}

Json& Json::value(double v) {
  before_value();
  if (!std::isfinite(v)) {
    out_ += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  out_ += buf;
  return *this;
}

Json& Json::null() {
  before_value();
  out_ += "null";
  return *this;
}

}  // namespace collectived::client::ctl

// Structured logging: one line per event, key=value fields, journald-friendly.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>

#include "config/profile.h"

namespace collectived::engine {

/// One key=value field of a log line.
struct Field {
  std::string_view key;
  std::string value;
  Field(std::string_view k, std::string_view v) : key(k), value(v) {}
  Field(std::string_view k, const std::string& v) : key(k), value(v) {}
  Field(std::string_view k, const char* v) : key(k), value(v) {}
  template <typename T>
    requires std::is_arithmetic_v<T>
  Field(std::string_view k, T v) : key(k), value(std::to_string(v)) {}
};

/// Writes `level=... event=... k=v ...` lines to a descriptor (stderr by
/// default). When stderr is connected to the journal (JOURNAL_STREAM names
/// it), each line starts with the syslog priority `<N>` and carries no
/// timestamp, since journald adds both. Thread-safe; the level can change live.
class Logger {
 public:
  explicit Logger(config::LogLevel level, int fd = 2);

  void set_level(config::LogLevel level) { level_.store(level); }
  config::LogLevel level() const { return level_.load(); }
  bool enabled(config::LogLevel level) const { return level >= level_.load(); }

  void log(config::LogLevel level, std::string_view event, std::initializer_list<Field> fields);
  void debug(std::string_view event, std::initializer_list<Field> fields) {
    log(config::LogLevel::debug, event, fields);
  }
  void info(std::string_view event, std::initializer_list<Field> fields) {
    log(config::LogLevel::info, event, fields);
  }
  void warn(std::string_view event, std::initializer_list<Field> fields) {
    log(config::LogLevel::warn, event, fields);
  }
  void error(std::string_view event, std::initializer_list<Field> fields) {
    log(config::LogLevel::error, event, fields);
  }

  /// Formats one line without writing it (tests, status).
  std::string format(config::LogLevel level, std::string_view event,
                     std::initializer_list<Field> fields) const;

 private:
  std::atomic<config::LogLevel> level_;
  int fd_;
  bool journal_;
  std::mutex write_mutex_;
};

}  // namespace collectived::engine

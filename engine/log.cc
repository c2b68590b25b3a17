#include "engine/log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace collectived::engine {
namespace {

// JOURNAL_STREAM is "device:inode" of the stream systemd connected to the
// journal; it only applies if our descriptor is still that stream.
bool is_journal(int fd) {
  const char* js = std::getenv("JOURNAL_STREAM");
  if (js == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  if (std::sscanf(js, "%llu:%llu", &dev, &ino) != 2) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  return st.st_dev == dev && st.st_ino == ino;
}

int syslog_priority(config::LogLevel level) {
  switch (level) {
    case config::LogLevel::trace:
    case config::LogLevel::debug: return 7;
    case config::LogLevel::info: return 6;
    case config::LogLevel::warn: return 4;
    case config::LogLevel::error: return 3;
  }
  return 6;
}

void append_value(std::string& out, std::string_view v) {
  bool quote = v.empty();
  for (char c : v) {
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20) {
      quote = true;
      break;
    }
  }
  if (!quote) {
    out += v;
    return;
  }
  out += '"';
  for (char c : v) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += '?';
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace

Logger::Logger(config::LogLevel level, int fd) : level_(level), fd_(fd), journal_(is_journal(fd)) {}

std::string Logger::format(config::LogLevel level, std::string_view event,
                           std::initializer_list<Field> fields) const {
  std::string line;
  line.reserve(160);
  if (journal_) {
    line += '<';
    line += std::to_string(syslog_priority(level));
    line += '>';
  } else {
    using namespace std::chrono;
    const auto now = system_clock::now();
    const std::time_t t = system_clock::to_time_t(now);
    const auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
    std::tm tm{};
    ::gmtime_r(&t, &tm);
    char ts[64];
    std::snprintf(ts, sizeof ts, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03dZ ", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<int>(ms));
    line += ts;
  }
  line += "level=";
  line += config::to_string(level);
  line += " event=";
  append_value(line, event);
  for (const Field& f : fields) {
    line += ' ';
    line += f.key;
    line += '=';
    append_value(line, f.value);
  }
  line += '\n';
  return line;
}

void Logger::log(config::LogLevel level, std::string_view event,
                 std::initializer_list<Field> fields) {
  if (!enabled(level)) return;
  const std::string line = format(level, event, fields);
  std::lock_guard lock(write_mutex_);
  // One write per line keeps lines whole when several threads log.
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n <= 0) return;  // nowhere to report a failing log sink
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace collectived::engine

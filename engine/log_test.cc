// The log line format operators and journald rely on: one line per event,
// key=value fields quoted where needed, levels from the profile, and the
// syslog priority instead of a timestamp when stderr is the journal.
#include "engine/log.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

using collectived::config::LogLevel;
using collectived::engine::Logger;

namespace {

/// A temporary file as the log's descriptor, read back whole.
struct Sink {
  Sink() = default;
  Sink(const Sink&) = delete;
  Sink& operator=(const Sink&) = delete;
  std::FILE* f = std::tmpfile();
  int fd() const { return ::fileno(f); }
  std::string text() const {
    std::string out;
    std::rewind(f);
    char buf[4096];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    return out;
  }
  ~Sink() { std::fclose(f); }
};

std::size_t count(const std::string& s, char c) {
  std::size_t n = 0;
  for (char x : s) n += x == c;
  return n;
}

}  // namespace

TEST_CASE(
    "key=value fields; values with spaces, quotes, '=' or newlines are quoted and stay on one "
    "line") {
  ::unsetenv("JOURNAL_STREAM");
  Sink sink;
  Logger log(LogLevel::info, sink.fd());
  log.warn("operation_timeout", {{"comm", "ef589c76"},
                                 {"seq", 3},
                                 {"missing", "rank 1 (pid 42)"},
                                 {"why", "a \"quoted\" x=y\nsecond line"},
                                 {"empty", ""}});
  const std::string line = sink.text();
  CHECK(line.rfind("ts=", 0) == 0);  // not the journal: a UTC timestamp first
  CHECK(line.find(
            "Z level=warn event=operation_timeout comm=ef589c76 seq=3 missing=\"rank 1 (pid 42)\" "
            "why=\"a \\\"quoted\\\" x=y\\nsecond line\" empty=\"\"\n") != std::string::npos);
  CHECK(count(line, '\n') == 1);
}

TEST_CASE("the level from the profile filters, and changes live") {
  ::unsetenv("JOURNAL_STREAM");
  Sink sink;
  Logger log(LogLevel::warn, sink.fd());
  log.info("hidden", {});
  log.debug("hidden", {});
  log.error("shown", {{"k", 1}});
  log.set_level(LogLevel::debug);  // SIGHUP's reload does this
  log.debug("now_shown", {});
  const std::string text = sink.text();
  CHECK(text.find("hidden") == std::string::npos);
  CHECK(text.find("level=error event=shown k=1") != std::string::npos);
  CHECK(text.find("level=debug event=now_shown") != std::string::npos);
  CHECK(count(text, '\n') == 2);
}

TEST_CASE(
    "under journald (JOURNAL_STREAM names our descriptor) lines carry <priority>, not a "
    "timestamp") {
  Sink sink;
  struct stat st {};
  REQUIRE(::fstat(sink.fd(), &st) == 0);
  const std::string js = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  ::setenv("JOURNAL_STREAM", js.c_str(), 1);
  {
    Logger log(LogLevel::debug, sink.fd());
    log.error("fatal", {{"code", "system"}});
    log.warn("w", {});
    log.info("i", {});
    log.debug("d", {});
  }
  CHECK(sink.text() ==
        "<3>level=error event=fatal code=system\n<4>level=warn event=w\n"
        "<6>level=info event=i\n<7>level=debug event=d\n");
  // Another stream (stderr redirected elsewhere after systemd set the
  // variable): timestamps again.
  Sink other;
  Logger log(LogLevel::info, other.fd());
  log.info("i", {});
  CHECK(other.text().rfind("ts=", 0) == 0);
  ::unsetenv("JOURNAL_STREAM");
}

// Test harness: real collectived processes, raw protocol clients and child
// client processes. No mocks: everything here talks to the real daemon binary.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ipc/fd.h"
#include "ipc/frame.h"

namespace collectived::test {

/// A private temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Writes `text` to `path`.
void write_file(const std::string& path, const std::string& text);
std::string read_file(const std::string& path);

/// Absolute paths of the binaries under test (from the build).
std::string collectived_binary();
std::string demo_binary();
std::string perf_binary();

/// Result of a finished child process.
struct ExitStatus {
  bool exited = false;  ///< false: killed by a signal (or still running at the deadline)
  int code = -1;        ///< exit code, or the signal number when !exited
  std::string output;   ///< stdout + stderr for exec'ed programs
};

/// Runs a program to completion (deadline: `timeout`), capturing its output.
ExitStatus run_program(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                       const std::map<std::string, std::string>& env = {});

/// Runs `fn` in a forked child (a real client process); its return value is
/// the child's exit code.
ExitStatus run_child(const std::function<int()>& fn, std::chrono::milliseconds timeout);

/// A forked child that keeps running until killed or finished.
class Child {
 public:
  explicit Child(const std::function<int()>& fn);
  ~Child();
  pid_t pid() const { return pid_; }
  void kill(int sig);
  ExitStatus wait(std::chrono::milliseconds timeout);

 private:
  pid_t pid_ = -1;
};

/// A real collectived on a temporary socket.
class Daemon {
 public:
  struct Options {
    std::vector<std::string> overrides{};      ///< extra --set KEY=VALUE
    std::vector<std::string> test_hooks{};     ///< --test-hook NAME=VALUE (daemon/options.h)
    std::string profile_file{};                ///< --profile FILE (optional)
    std::map<std::string, std::string> env{};  ///< extra environment
    bool wait_ready = true;                    ///< wait until the socket answers
  };
  Daemon();
  explicit Daemon(Options options);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }
  bool alive();
  void signal(int sig);
  /// SIGTERM and wait; returns how it ended and how long it took.
  ExitStatus terminate(std::chrono::milliseconds timeout, std::chrono::milliseconds* took = nullptr);
  ExitStatus wait(std::chrono::milliseconds timeout);
  /// Everything the daemon has logged so far.
  std::string log() const;
  /// Waits until the log contains `text`.
  bool wait_for_log(const std::string& text, std::chrono::milliseconds timeout) const;

 private:
  TempDir dir_;
  std::string socket_;
  std::string log_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  ExitStatus status_;
};

/// A protocol-level client for feeding the daemon good and bad input.
class RawClient {
 public:
  explicit RawClient(const std::string& socket_path);
  int fd() const { return fd_.get(); }
  /// Writes raw bytes (may be garbage), optionally with descriptors.
  void send_bytes(const std::vector<std::byte>& bytes, std::vector<int> fds = {});
  /// Encodes and sends a message (id set by the caller).
  void send(capnp::MessageBuilder& message, std::vector<int> fds = {});
  /// Sends Hello with `version` and waits for the answer.
  std::unique_ptr<ipc::IncomingFrame> hello(std::uint32_t version = wire::PROTOCOL_VERSION);
  /// Next frame, or nullptr on EOF or timeout.
  std::unique_ptr<ipc::IncomingFrame> receive(std::chrono::milliseconds timeout);
  /// True when the daemon closed the connection within `timeout`.
  bool closed_by_peer(std::chrono::milliseconds timeout);
  /// Sends RegisterHost{size} with `fds` and returns the reply frame.
  std::unique_ptr<ipc::IncomingFrame> register_host(std::uint64_t id, std::uint64_t size,
                                                    std::vector<int> fds);
  /// Sends Deregister{handle} and returns the reply frame.
  std::unique_ptr<ipc::IncomingFrame> deregister(std::uint64_t id, std::uint64_t handle);
  /// Sends Status and returns the reply frame.
  std::unique_ptr<ipc::IncomingFrame> status(std::uint64_t id = 1000);

 private:
  UniqueFd fd_;
  ipc::FrameDecoder decoder_;
  bool eof_ = false;
};

/// A sealed memfd of `size` bytes.
UniqueFd sealed_memfd(std::size_t size);

/// The error code of an Error frame (Code::ok when the frame is not an error).
Code error_code(ipc::IncomingFrame& frame);
std::string error_message(ipc::IncomingFrame& frame);

/// Polls `pred` every few milliseconds until true or `timeout`.
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

}  // namespace collectived::test

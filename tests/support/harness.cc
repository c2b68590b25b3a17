#include "tests/support/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <poll.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace collectived::test {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

TempDir::TempDir() {
  std::string tmpl = std::filesystem::temp_directory_path().string() + "/cdtest.XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
  // Let test clients that drop privileges reach sockets inside.
  ::chmod(path_.c_str(), 0755);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string collectived_binary() { return COLLECTIVED_BIN; }
std::string demo_binary() { return COLLECTIVE_DEMO_BIN; }
std::string perf_binary() { return COLLECTIVE_PERF_BIN; }

namespace {

ExitStatus decode(int status) {
  ExitStatus s;
  if (WIFEXITED(status)) {
    s.exited = true;
    s.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    s.code = WTERMSIG(status);
  }
  return s;
}

// waitpid with a deadline; kills the child when the deadline passes.
ExitStatus wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return decode(status);
    if (r < 0) return {};
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ExitStatus s;
      s.exited = false;
      s.code = -1;  // timed out
      s.output = "(killed: still running after the deadline)";
      return s;
    }
    std::this_thread::sleep_for(2ms);
  }
}

}  // namespace

ExitStatus run_program(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                       const std::map<std::string, std::string>& env) {
  TempDir dir;
  const std::string out = dir.file("out");
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ExitStatus s = wait_child(pid, timeout);
  s.output = read_file(out) + s.output;
  return s;
}

ExitStatus run_child(const std::function<int()>& fn, std::chrono::milliseconds timeout) {
  Child c(fn);
  return c.wait(timeout);
}

Child::Child(const std::function<int()>& fn) {
  std::fflush(nullptr);
  pid_ = ::fork();
  if (pid_ == 0) {
    int code = 99;
    try {
      code = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: uncaught exception: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
}

Child::~Child() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

// Never kill(-1, sig) (every process this user may signal) once the child
// has been waited for (pid_ is -1 then).
void Child::kill(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

ExitStatus Child::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return ExitStatus{};  // already waited for: never waitpid(-1)
  ExitStatus s = wait_child(pid_, timeout);
  pid_ = -1;
  return s;
}

Daemon::Daemon() : Daemon(Options{}) {}

Daemon::Daemon(Options options) {
  socket_ = dir_.file("cd.sock");
  log_path_ = dir_.file("daemon.log");
  std::vector<std::string> argv = {collectived_binary()};
  if (!options.profile_file.empty()) {
    argv.push_back("--profile");
    argv.push_back(options.profile_file);
  }
  argv.push_back("--set");
  argv.push_back("client.socket=" + socket_);
  // Tests run as root; the socket stays reachable for privilege-dropping children.
  argv.push_back("--set");
  argv.push_back("client.socket_mode=0666");
  for (const auto& o : options.overrides) {
    argv.push_back("--set");
    argv.push_back(o);
  }
  for (const auto& h : options.test_hooks) {
    argv.push_back("--test-hook");
    argv.push_back(h);
  }
  std::fflush(nullptr);
  pid_ = ::fork();
  if (pid_ == 0) {
    const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    ::dup2(fd, 2);
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0);
    ::dup2(null, 1);
    // Nothing else of the test's: a descriptor it holds now (a pipe to its
    // children, a client socket) would be the daemon's until it exits, and
    // would count in the daemon's descriptors (fault_client saw a restarted
    // daemon with 8 more than before: its pipes).
    ::close_range(3, ~0U, 0);
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("JOURNAL_STREAM");
    for (const auto& [k, v] : options.env) {
      // WATCHDOG_PID must name the daemon itself, known only here.
      ::setenv(k.c_str(), v == "$PID" ? std::to_string(::getpid()).c_str() : v.c_str(), 1);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  if (!options.wait_ready) return;
  const bool up = eventually(
      [&] {
        if (!alive()) return true;
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, socket_.c_str(), sizeof addr.sun_path - 1);
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
      },
      10s);
  if (!up || !alive()) {
    throw std::runtime_error("collectived did not start; its log:\n" + log());
  }
}

Daemon::~Daemon() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

bool Daemon::alive() {
  if (reaped_) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    status_ = decode(status);
    return false;
  }
  return true;
}

void Daemon::signal(int sig) {
  if (!reaped_) ::kill(pid_, sig);
}

ExitStatus Daemon::wait(std::chrono::milliseconds timeout) {
  if (reaped_) return status_;
  status_ = wait_child(pid_, timeout);
  reaped_ = true;
  return status_;
}

ExitStatus Daemon::terminate(std::chrono::milliseconds timeout, std::chrono::milliseconds* took) {
  const auto t0 = Clock::now();
  signal(SIGTERM);
  ExitStatus s = wait(timeout);
  if (took) *took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  return s;
}

std::string Daemon::log() const { return read_file(log_path_); }

bool Daemon::wait_for_log(const std::string& text, std::chrono::milliseconds timeout) const {
  return eventually([&] { return log().find(text) != std::string::npos; }, timeout);
}

RawClient::RawClient(const std::string& socket_path)
    : decoder_(ipc::Limits::for_max_frame(64 << 20)) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
  fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error("connect " + socket_path + ": " + std::strerror(errno));
  }
}

void RawClient::send_bytes(const std::vector<std::byte>& bytes, std::vector<int> fds) {
  ipc::send_frame(fd_.get(), bytes, fds, Clock::now() + 5s);
}

void RawClient::send(capnp::MessageBuilder& message, std::vector<int> fds) {
  send_bytes(ipc::encode_frame(message, static_cast<std::uint32_t>(fds.size())), fds);
}

std::unique_ptr<ipc::IncomingFrame> RawClient::hello(std::uint32_t version) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(1);
  auto h = m.initHello();
  h.setProtocolVersion(version);
  h.setClientName("raw test client");
  h.setLibraryVersion("test");
  send(b);
  return receive(5s);
}

std::unique_ptr<ipc::IncomingFrame> RawClient::receive(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto f = decoder_.next()) return f;
    if (eof_) return nullptr;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return nullptr;
    pollfd p{fd_.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    std::vector<UniqueFd> fds;
    auto r = ipc::recv_some(fd_.get(), decoder_.read_space(), fds);
    if (r.eof) {
      eof_ = true;
      continue;
    }
    decoder_.commit(r.bytes);
  }
}

bool RawClient::closed_by_peer(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (eof_) return true;
    receive(std::chrono::milliseconds(20));
    if (eof_) return true;
  }
  return eof_;
}

std::unique_ptr<ipc::IncomingFrame> RawClient::register_host(std::uint64_t id, std::uint64_t size,
                                                             std::vector<int> fds) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.initRegisterHost().setSize(size);
  send(b, std::move(fds));
  return receive(5s);
}

std::unique_ptr<ipc::IncomingFrame> RawClient::deregister(std::uint64_t id, std::uint64_t handle) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.initDeregister().setHandle(handle);
  send(b);
  return receive(5s);
}

std::unique_ptr<ipc::IncomingFrame> RawClient::status(std::uint64_t id) {
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.initStatus();
  send(b);
  return receive(5s);
}

UniqueFd sealed_memfd(std::size_t size) {
  UniqueFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) throw std::runtime_error("ftruncate");
  ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  return fd;
}

Code error_code(ipc::IncomingFrame& frame) {
  if (!frame.message().isError()) return Code::ok;
  return code_from_wire(static_cast<std::uint16_t>(frame.message().getError().getCode()));
}

std::string error_message(ipc::IncomingFrame& frame) {
  if (!frame.message().isError()) return "";
  return frame.message().getError().getMessage().cStr();
}

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

}  // namespace collectived::test

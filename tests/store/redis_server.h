// A private redis-server for tests: started on 127.0.0.1 on a free port,
// without persistence, in a fresh temporary directory that is removed
// afterwards. Header-only and free of gtest: every failure is a
// std::runtime_error with a message saying what went wrong (a missing
// redis-server names the Debian package), so a test using it fails rather
// than skips. Nothing but 127.0.0.1 is ever contacted.
//
// The server gets SIGTERM when the thread that started it ends (Linux's
// PR_SET_PDEATHSIG, so that a crashed test leaves no server behind): start
// it from a thread that outlives its use, such as the test's own.
//
//   RedisServer server({"--maxmemory", "4mb", "--maxmemory-policy", "noeviction"});
//   auto store = rwd::make_redis_store({.port = server.port()});
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace rwd::test {

class RedisServer {
 public:
  // Starts the server (and waits until it answers PING, at most
  // `start_timeout_s`). `extra_args` go to redis-server after the fixed
  // ones. Throws std::runtime_error when it cannot.
  explicit RedisServer(std::vector<std::string> extra_args = {}, double start_timeout_s = 10.0)
      : extra_args_(std::move(extra_args)), start_timeout_s_(start_timeout_s) {
    executable_ = find_on_path("redis-server");
    if (executable_.empty()) {
      throw std::runtime_error(
          "RedisServer: redis-server is not on PATH; the Redis store tests need it (Debian package "
          "redis-server: apt-get install redis-server, or make deps)");
    }
    std::string templ = (std::filesystem::temp_directory_path() / "rewind-redis-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) {
      throw std::runtime_error("RedisServer: cannot create a temporary directory from " + templ + ": " +
                               std::strerror(errno));
    }
    dir_ = templ;
    port_ = free_port();
    try {
      start();
    } catch (...) {
      remove_dir();
      throw;
    }
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;
  ~RedisServer() {
    try {
      stop();
    } catch (...) {
      // A destructor cannot report; the server got SIGKILL in stop().
    }
    remove_dir();
  }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  const std::string& dir() const { return dir_; }

  // SIGTERM, then waits for the exit (SIGKILL after 10 s). No-op when
  // stopped.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);  // a paused server cannot handle SIGTERM
    ::kill(pid_, SIGTERM);
    if (!wait_exit(10.0)) {
      ::kill(pid_, SIGKILL);
      wait_exit(-1.0);
    }
    pid_ = -1;
  }
  // Stops (when running) and starts again on the same port and directory.
  void restart() {
    stop();
    start();
  }
  // SIGSTOP / SIGCONT: a server that accepts connections but never answers.
  void pause() { signal_server(SIGSTOP); }
  void resume() { signal_server(SIGCONT); }

  // The server's log (its stdout and stderr), for failure messages.
  std::string log() const {
    std::ifstream in(dir_ + "/redis.log");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  static std::string find_on_path(const std::string& name) {
    const char* path = std::getenv("PATH");
    std::stringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
    for (std::string d; std::getline(dirs, d, ':');) {
      if (d.empty()) continue;
      const std::string candidate = d + "/" + name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return "";
  }

  // A port nobody listens on now: the kernel picks it for a socket bound to
  // port 0. Another program could take it before the server does; the
  // start then fails with the server's log in the message.
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(std::string("RedisServer: socket: ") + std::strerror(errno));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error(std::string("RedisServer: cannot find a free port on 127.0.0.1: ") + std::strerror(err));
    }
    ::close(fd);
    return ntohs(addr.sin_port);
  }

  void start() {
    std::vector<std::string> args = {
        executable_, "--bind", "127.0.0.1",   "--port", std::to_string(port_), "--save", "", "--appendonly", "no",
        "--dir",     dir_,     "--daemonize", "no",     "--logfile",           ""};
    args.insert(args.end(), extra_args_.begin(), extra_args_.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log_path = dir_ + "/redis.log";
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("RedisServer: fork: ") + std::strerror(errno));
    if (pid == 0) {
      // The server must not outlive a test process that dies without
      // running destructors.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(126);
      const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (log >= 0) {
        ::dup2(log, 1);
        ::dup2(log, 2);
      }
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    pid_ = pid;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(start_timeout_s_);
    while (true) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("RedisServer: " + executable_ + " on port " + std::to_string(port_) +
                                 " exited during start (status " + std::to_string(status) + "); its log:\n" + log());
      }
      if (ping()) return;
      if (std::chrono::steady_clock::now() > deadline) {
        stop();
        throw std::runtime_error("RedisServer: " + executable_ + " on port " + std::to_string(port_) +
                                 " did not answer PING within " + std::to_string(start_timeout_s_) + " s; its log:\n" +
                                 log());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // True when the server on 127.0.0.1:port_ answers PING with +PONG.
  bool ping() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<std::uint16_t>(port_));
    bool ok = false;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const char request[] = "PING\r\n";
      if (::send(fd, request, sizeof request - 1, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof request - 1)) {
        char reply[16] = {};
        const ssize_t n = ::recv(fd, reply, sizeof reply - 1, 0);
        ok = n >= 5 && std::strncmp(reply, "+PONG", 5) == 0;
      }
    }
    ::close(fd);
    return ok;
  }

  // Waits for the server's exit, at most `timeout_s` (< 0: without bound).
  bool wait_exit(double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (true) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, timeout_s < 0 ? 0 : WNOHANG);
      if (r == pid_ || (r < 0 && errno == ECHILD)) return true;
      if (timeout_s >= 0 && std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void signal_server(int sig) {
    if (pid_ <= 0) throw std::runtime_error("RedisServer: the server on port " + std::to_string(port_) + " is stopped");
    ::kill(pid_, sig);
  }

  void remove_dir() {
    if (dir_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::vector<std::string> extra_args_;
  double start_timeout_s_;
  std::string executable_;
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace rwd::test

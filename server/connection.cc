#include "server/connection.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace rwd::server {
namespace {

// The numeric host and port of `addr` (getnameinfo's NI_NUMERICHOST form,
// which httplib's remote_addr also is); false for a non-IP socket.
bool numeric(const sockaddr_storage& addr, socklen_t len, std::string& host, int& port) {
  if (addr.ss_family != AF_INET && addr.ss_family != AF_INET6) return false;
  char h[NI_MAXHOST];
  char p[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, h, sizeof h, p, sizeof p,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  host = h;
  port = std::atoi(p);
  return true;
}

}  // namespace

ClientConnection::ClientConnection(const std::string& remote_addr, int remote_port, const std::string& local_addr,
                                   int local_port) {
  if (remote_port < 0 || local_port < 0) return;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    char* rest = nullptr;
    const long fd = std::strtol(name.c_str(), &rest, 10);
    if (rest == name.c_str() || *rest != '\0') continue;
    int type = 0;
    socklen_t type_len = sizeof type;
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_len = sizeof peer, local_len = sizeof local;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) continue;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    std::string peer_host, local_host;
    int peer_port = -1, port = -1;
    if (!numeric(peer, peer_len, peer_host, peer_port) || !numeric(local, local_len, local_host, port)) continue;
    if (peer_host == remote_addr && peer_port == remote_port && local_host == local_addr && port == local_port) {
      fd_ = static_cast<int>(fd);
      return;
    }
  }
}

bool ClientConnection::gone() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;  // nothing happened (or poll failed: assume still there)
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
  if (!(p.revents & (POLLIN | POLLRDHUP))) return false;
  // Readable: the client's next request on a kept-alive connection, or its
  // end. Only the end (a zero-byte read) means it left.
  char byte;
  const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace rwd::server

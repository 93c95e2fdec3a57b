// Whether the client of a request still waits for its answer. cpp-httplib
// 0.11 (Debian 12's) gives a handler no socket, and a client that leaves is
// seen only by a write; a request waiting in the queue or for a whole
// (non-streamed) answer writes nothing until the end. This finds the
// request's TCP connection among the process's descriptors by its two
// addresses, which no other open connection shares, and asks it.
#pragma once

#include <string>

namespace rwd::server {

class ClientConnection {
 public:
  // The connection from `remote_addr`:`remote_port` to this process's
  // `local_addr`:`local_port` (numeric, as httplib's Request holds them).
  // Not found (a request not from a socket): gone() is always false.
  ClientConnection(const std::string& remote_addr, int remote_port, const std::string& local_addr, int local_port);
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // True once the peer closed or reset the connection (an orderly close
  // with nothing left unread, a reset, an error). Never blocks. The socket
  // is httplib's: it stays open while the handler that made this runs.
  bool gone() const;
  bool found() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace rwd::server

// ClientConnection finds a request's socket by its addresses and tells an
// open connection from one its peer closed or reset.
#include "server/connection.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace rwt::server {
namespace {

using rwd::server::ClientConnection;

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if ((peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
            : getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
    return -1;
  return ntohs(a.sin_port);
}

// A connected pair on 127.0.0.1: the accepted (server) end and the client's.
struct Pair {
  int listener = -1, server = -1, client = -1;
  Pair() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(listen(listener, 4), 0);
    a.sin_port = htons(static_cast<std::uint16_t>(port_of(listener, false)));
    client = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    server = accept(listener, nullptr, nullptr);
    EXPECT_GE(server, 0);
  }
  ~Pair() {
    for (int fd : {listener, server, client})
      if (fd >= 0) close(fd);
  }
  ClientConnection find() const {
    return ClientConnection("127.0.0.1", port_of(client, false), "127.0.0.1", port_of(listener, false));
  }
};

TEST(ClientConnection, FindsTheRequestsSocketAndSeesAnOrderlyClose) {
  Pair p;
  const ClientConnection c = p.find();
  ASSERT_TRUE(c.found());
  EXPECT_FALSE(c.gone());
  // Unread bytes (a kept-alive client's next request) are not a close.
  ASSERT_EQ(write(p.client, "GET", 3), 3);
  EXPECT_FALSE(c.gone());
  char buf[3];
  ASSERT_EQ(read(p.server, buf, 3), 3);
  EXPECT_FALSE(c.gone());
  close(p.client);
  p.client = -1;
  EXPECT_TRUE(c.gone());
  EXPECT_TRUE(c.gone()) << "asked twice";
}

TEST(ClientConnection, SeesAReset) {
  Pair p;
  const ClientConnection c = p.find();
  ASSERT_TRUE(c.found());
  linger l{1, 0};  // close with RST
  ASSERT_EQ(setsockopt(p.client, SOL_SOCKET, SO_LINGER, &l, sizeof l), 0);
  close(p.client);
  p.client = -1;
  EXPECT_TRUE(c.gone());
}

TEST(ClientConnection, AnotherAddressFindsNothingAndIsNeverGone) {
  Pair p;
  const int client_port = port_of(p.client, false), local_port = port_of(p.listener, false);
  for (const ClientConnection& c : {ClientConnection("127.0.0.2", client_port, "127.0.0.1", local_port),
                                    ClientConnection("127.0.0.1", client_port, "127.0.0.2", local_port),
                                    ClientConnection("127.0.0.1", client_port, "127.0.0.1", local_port + 1),
                                    ClientConnection("127.0.0.1", -1, "127.0.0.1", local_port)}) {
    EXPECT_FALSE(c.found());
    EXPECT_FALSE(c.gone());
  }
}

}  // namespace
}  // namespace rwt::server

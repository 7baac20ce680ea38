// Messages between two independently started processes over UCX (Debian's libucx: TCP on any
// network, RDMA where there is one): a listener that accepts connections, a connection that sends and
// receives whole messages. A message is a u64 little-endian length and that many bytes on UCX's
// stream API; every wait has a deadline, and a peer that goes away fails the wait at once (UCX's peer
// error handling). A wait that ends before its operation does (the deadline, a failed peer, a stop)
// closes the endpoint by force, so nothing here hangs on a dead or silent peer.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsv41 {

struct UcxHandles;  // the UCX objects (ucx_link.cpp)

// "HOST:PORT" (a name or an IPv4/IPv6 address; "[::1]:PORT" for IPv6). Error naming `flag` otherwise.
struct UcxAddress {
  std::string host;
  uint16_t port = 0;
  std::string text() const { return host + ":" + std::to_string(port); }
};
UcxAddress parse_ucx_address(const std::string& text, const std::string& flag);

using Deadline = std::chrono::steady_clock::time_point;

// One UCX context and worker, used by one thread at a time.
class UcxWorker {
 public:
  UcxWorker();  // Error when UCX cannot start
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  UcxHandles& handles() { return *h_; }

 private:
  std::unique_ptr<UcxHandles> h_;
};

class UcxConnection {
 public:
  // Connects to `to`; Error naming the address when it cannot. Every wait on the connection also
  // ends (with an Error) once `cancel` (if given) becomes true.
  static std::unique_ptr<UcxConnection> connect(UcxWorker& worker, const UcxAddress& to,
                                                const std::atomic<bool>* cancel = nullptr);
  ~UcxConnection();  // flushes what was sent, then closes (at once if the peer failed); never waits long
  UcxConnection(const UcxConnection&) = delete;
  UcxConnection& operator=(const UcxConnection&) = delete;

  // Error naming `what` when the peer fails or the deadline passes first.
  void send(const std::vector<uint8_t>& message, Deadline deadline, const std::string& what);
  // A whole message of at most `max_bytes` (a longer one is an Error, never read).
  std::vector<uint8_t> receive(uint64_t max_bytes, Deadline deadline, const std::string& what);

  struct Failure;  // set by UCX's error callback when the peer goes away

 private:
  friend class UcxListener;
  UcxConnection(UcxWorker& worker, void* endpoint, const std::atomic<bool>* cancel);
  void wait(void* request, Deadline deadline, const std::string& what);
  // Closes the endpoint, by force (dropping what is in flight) or after a flush, within a bounded wait.
  void close(bool force);
  UcxWorker& worker_;
  void* ep_ = nullptr;  // ucp_ep_h
  std::unique_ptr<Failure> failed_;
  const std::atomic<bool>* cancel_;
};

class UcxListener {
 public:
  // Listens on `at` (port 0: any free port, see port()); Error naming the address when it cannot.
  // UCX's TCP connection manager binds with SO_REUSEADDR only when its environment says
  // UCX_TCP_CM_REUSEADDR=y (UCX 1.13 takes the setting from nowhere else; `serve --role prefill`
  // sets it), so that a listener started again at once is not refused its port for a minute while
  // its predecessor's closed connections sit in TIME_WAIT.
  UcxListener(UcxWorker& worker, const UcxAddress& at);
  ~UcxListener();
  UcxListener(const UcxListener&) = delete;
  UcxListener& operator=(const UcxListener&) = delete;
  uint16_t port() const { return port_; }
  // The next connection, or null when none came within `wait`; its waits end once `cancel` is true.
  std::unique_ptr<UcxConnection> accept(std::chrono::milliseconds wait, const std::atomic<bool>* cancel = nullptr);

 private:
  UcxWorker& worker_;
  void* listener_ = nullptr;  // ucp_listener_h
  uint16_t port_ = 0;
  struct Pending;
  std::unique_ptr<Pending> pending_;
};

}  // namespace dsv41

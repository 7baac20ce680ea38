#include "transfer/ucx_link.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <deque>
#include <thread>

#include "util/error.h"

namespace dsv41 {

struct UcxHandles {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
};

struct UcxConnection::Failure {
  bool failed = false;
  ucs_status_t status = UCS_OK;
};

struct UcxListener::Pending {
  std::deque<ucp_conn_request_h> requests;
};

namespace {

// How long a closing endpoint is waited for: a forced close needs no peer; a flush waits for the
// peer's transport to take the last bytes sent.
constexpr std::chrono::seconds kForcedCloseWait{1};
constexpr std::chrono::seconds kFlushCloseWait{5};

std::string status_text(ucs_status_t s) { return ucs_status_string(s); }

sockaddr_storage resolve(const UcxAddress& a, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = a.host.empty() ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(a.host.empty() ? nullptr : a.host.c_str(), std::to_string(a.port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) fail(a.text(), std::string("cannot be resolved: ") + gai_strerror(rc));
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  *length = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

void on_peer_failure(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* f = static_cast<UcxConnection::Failure*>(arg);
  f->failed = true;
  f->status = status;
}

// Naps that grow from 10 us to 1 ms while nothing happens: a long wait (a prompt being prefilled on
// the other side) costs no core, a short one little latency.
class Backoff {
 public:
  void idle() {
    nap_ = std::min(std::chrono::microseconds(1000), std::max(std::chrono::microseconds(10), nap_ * 2));
    std::this_thread::sleep_for(nap_);
  }
  void busy() { nap_ = std::chrono::microseconds(0); }

 private:
  std::chrono::microseconds nap_{0};
};

}  // namespace

UcxAddress parse_ucx_address(const std::string& text, const std::string& flag) {
  const size_t colon = text.rfind(':');
  UcxAddress a;
  if (colon == std::string::npos) fail(flag, "expects HOST:PORT, got \"" + text + "\"");
  a.host = text.substr(0, colon);
  if (a.host.size() >= 2 && a.host.front() == '[' && a.host.back() == ']') a.host = a.host.substr(1, a.host.size() - 2);
  const std::string port = text.substr(colon + 1);
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    fail(flag, "expects HOST:PORT with a port from 0 to 65535, got \"" + text + "\"");
  a.port = static_cast<uint16_t>(std::stoi(port));
  return a;
}

UcxWorker::UcxWorker() : h_(std::make_unique<UcxHandles>()) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) fail("UCX", "cannot read its configuration: " + status_text(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_STREAM;
  s = ucp_init(&params, config, &h_->context);
  ucp_config_release(config);
  if (s != UCS_OK) fail("UCX", "cannot start: " + status_text(s));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(h_->context, &wp, &h_->worker);
  if (s != UCS_OK) {
    ucp_cleanup(h_->context);
    fail("UCX", "cannot create a worker: " + status_text(s));
  }
}

UcxWorker::~UcxWorker() {
  ucp_worker_destroy(h_->worker);
  ucp_cleanup(h_->context);
}

UcxConnection::UcxConnection(UcxWorker& worker, void* endpoint, const std::atomic<bool>* cancel)
    : worker_(worker), ep_(endpoint), failed_(std::make_unique<Failure>()), cancel_(cancel) {}

std::unique_ptr<UcxConnection> UcxConnection::connect(UcxWorker& worker, const UcxAddress& to,
                                                      const std::atomic<bool>* cancel) {
  socklen_t length = 0;
  const sockaddr_storage addr = resolve(to, &length);
  std::unique_ptr<UcxConnection> c(new UcxConnection(worker, nullptr, cancel));
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  p.sockaddr.addrlen = length;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_peer_failure;
  p.err_handler.arg = c->failed_.get();
  ucp_ep_h ep = nullptr;
  const ucs_status_t s = ucp_ep_create(worker.handles().worker, &p, &ep);
  if (s != UCS_OK) fail(to.text(), "cannot be connected to: " + status_text(s));
  c->ep_ = ep;
  return c;
}

UcxConnection::~UcxConnection() { close(failed_->failed); }  // flush what was sent, unless nobody listens

void UcxConnection::close(bool force) {
  if (ep_ == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(static_cast<ucp_ep_h>(ep_), &p);
  ep_ = nullptr;
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  // A forced close ends at once; a flush waits for the peer's transport to take what was sent, which
  // a frozen peer never does: either is waited for a bounded time (and a flush not past a stop), and
  // then left to UCX, which finishes or drops it with the worker.
  const Deadline deadline = std::chrono::steady_clock::now() + (force ? kForcedCloseWait : kFlushCloseWait);
  Backoff backoff;
  while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline &&
         (force || cancel_ == nullptr || !*cancel_)) {
    if (ucp_worker_progress(worker_.handles().worker) == 0) backoff.idle(); else backoff.busy();
  }
  ucp_request_free(request);
}

void UcxConnection::wait(void* request, Deadline deadline, const std::string& what) {
  if (request == nullptr) return;  // done at once
  if (UCS_PTR_IS_ERR(request)) fail(what, "failed: " + status_text(UCS_PTR_STATUS(request)));
  ucp_worker_h worker = worker_.handles().worker;
  Backoff backoff;
  std::string why;
  for (;;) {
    const ucs_status_t s = ucp_request_check_status(request);
    if (s != UCS_INPROGRESS) {
      ucp_request_free(request);
      if (s != UCS_OK) fail(what, "failed: " + status_text(s));
      return;
    }
    if (failed_->failed) why = "the peer went away (" + status_text(failed_->status) + ")";
    if (std::chrono::steady_clock::now() > deadline) why = "timed out";
    if (cancel_ != nullptr && *cancel_) why = "cancelled: this server is stopping";
    if (!why.empty()) break;
    if (ucp_worker_progress(worker) == 0) backoff.idle(); else backoff.busy();
  }
  // The endpoint is closed by force, which completes every request on it (this one with
  // UCS_ERR_CANCELED) without the peer. Cancelling the request alone would not do: UCX cancels no
  // stream operation, so that wait would last as long as the peer stays silent. A cut-off message
  // leaves the stream unusable anyway.
  failed_->failed = true;
  close(true);
  ucp_request_free(request);
  fail(what, why);
}

void UcxConnection::send(const std::vector<uint8_t>& message, Deadline deadline, const std::string& what) {
  if (ep_ == nullptr) fail(what, "the connection was closed after a failure");
  const uint64_t length = message.size();
  ucp_request_param_t p{};
  wait(ucp_stream_send_nbx(static_cast<ucp_ep_h>(ep_), &length, sizeof length, &p), deadline, what);
  if (length > 0) wait(ucp_stream_send_nbx(static_cast<ucp_ep_h>(ep_), message.data(), length, &p), deadline, what);
}

std::vector<uint8_t> UcxConnection::receive(uint64_t max_bytes, Deadline deadline, const std::string& what) {
  if (ep_ == nullptr) fail(what, "the connection was closed after a failure");
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_STREAM_RECV_FLAG_WAITALL;
  uint64_t length = 0;
  size_t got = 0;
  wait(ucp_stream_recv_nbx(static_cast<ucp_ep_h>(ep_), &length, sizeof length, &got, &p), deadline, what);
  if (length > max_bytes) {
    failed_->failed = true;  // the rest of the stream is not read: close at once
    fail(what, "announces " + std::to_string(length) + " bytes, more than the " + std::to_string(max_bytes) + " allowed");
  }
  std::vector<uint8_t> message(static_cast<size_t>(length));
  if (length > 0) {
    wait(ucp_stream_recv_nbx(static_cast<ucp_ep_h>(ep_), message.data(), length, &got, &p), deadline, what);
  }
  return message;
}

UcxListener::UcxListener(UcxWorker& worker, const UcxAddress& at) : worker_(worker), pending_(std::make_unique<Pending>()) {
  socklen_t length = 0;
  const sockaddr_storage addr = resolve(at, &length);
  ucp_listener_params_t p{};
  p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  p.sockaddr.addrlen = length;
  p.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
    static_cast<Pending*>(arg)->requests.push_back(request);
  };
  p.conn_handler.arg = pending_.get();
  ucp_listener_h listener = nullptr;
  const ucs_status_t s = ucp_listener_create(worker.handles().worker, &p, &listener);
  if (s != UCS_OK) fail(at.text(), "cannot be listened on: " + status_text(s));
  listener_ = listener;
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucp_listener_query(listener, &attr) == UCS_OK) {
    const auto* sa = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
    port_ = ntohs(sa->sa_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port
                                            : reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
  }
}

UcxListener::~UcxListener() {
  for (ucp_conn_request_h r : pending_->requests) ucp_listener_reject(static_cast<ucp_listener_h>(listener_), r);
  ucp_listener_destroy(static_cast<ucp_listener_h>(listener_));
}

std::unique_ptr<UcxConnection> UcxListener::accept(std::chrono::milliseconds wait, const std::atomic<bool>* cancel) {
  const Deadline deadline = std::chrono::steady_clock::now() + wait;
  Backoff backoff;
  while (pending_->requests.empty() && std::chrono::steady_clock::now() < deadline) {
    if (ucp_worker_progress(worker_.handles().worker) == 0) backoff.idle(); else backoff.busy();
  }
  if (pending_->requests.empty()) return nullptr;
  ucp_conn_request_h request = pending_->requests.front();
  pending_->requests.pop_front();
  std::unique_ptr<UcxConnection> c(new UcxConnection(worker_, nullptr, cancel));
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.conn_request = request;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_peer_failure;
  p.err_handler.arg = c->failed_.get();
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker_.handles().worker, &p, &ep) != UCS_OK) return nullptr;
  c->ep_ = ep;
  return c;
}

}  // namespace dsv41

#include "server/http_connection.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <mutex>
#include <sstream>

#include "util/error.h"

namespace dsv41::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using Headers = std::vector<std::pair<std::string, std::string>>;

namespace {

// Whether posts from other threads may still reach the I/O context: cleared before it is destroyed,
// so an engine event arriving after the server has gone is dropped instead of touching freed memory.
struct PostGate {
  std::mutex mu;
  bool open = true;
};

}  // namespace

class Connection;

struct ListenerState {
  HttpLimits limits;
  HeadCheck check;
  RequestHandler handler;
  ReplyObserver observer;
  std::shared_ptr<PostGate> gate = std::make_shared<PostGate>();
  std::mutex mu;
  std::vector<std::weak_ptr<Connection>> live;  // for stop()
  std::atomic<size_t> connections{0};
  std::atomic<bool> stopping{false};
  // Last, so it goes first: destroying it destroys the handlers still queued, and with them the
  // connections they hold, which use the members above.
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};

  void accept();
  void forget_closed();
};

// One client connection, all of whose work runs on its strand.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ListenerState& owner, tcp::socket socket)
      : owner_(owner), stream_(std::move(socket)), tick_(stream_.get_executor()) {
    ++owner_.connections;
  }
  ~Connection() { --owner_.connections; }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_next(); });
  }
  void close_now() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->close(); });
  }

  // --- what an exchange asks for, on the strand; `from` must be the current exchange
  struct Exchange;
  void reply(const Exchange* from, HttpReply r);
  void start_stream(const Exchange* from, int status, std::string type, Headers headers, std::string idle_text,
                    std::chrono::milliseconds idle_every);
  void send(const Exchange* from, std::string data);
  void finish(const Exchange* from);
  void on_gone(const Exchange* from, std::function<void()> fn);
  void after(const Exchange* from, std::chrono::milliseconds delay, std::function<void()> fn);

 private:
  struct Out {
    std::string bytes;
    bool ends_reply = false;
  };

  void read_next();
  void on_header(beast::error_code ec);
  void on_body(beast::error_code ec);
  void dispatch_request();
  void queue(Out out);
  void write_next();
  void reply_complete();
  void refuse(int status, const std::string& message, const std::string& code);
  void arm_tick();
  void on_tick();
  void gone();
  void close();
  void linger();
  bool current(const Exchange* from) const;
  bool peer_closed();

  ListenerState& owner_;
  beast::tcp_stream stream_;
  net::steady_timer tick_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  RequestHead head_;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  Headers extra_;  // from the head check, on every reply to this request

  std::shared_ptr<Exchange> exchange_;  // the request being answered
  bool replying_ = false;               // a reply (or stream head) has been queued
  bool streaming_ = false;
  bool gone_ = false;
  bool closed_ = false;
  bool close_after_ = false;
  int status_ = 0;
  std::function<void()> on_gone_;
  std::vector<std::pair<Clock::time_point, std::function<void()>>> deadlines_;
  std::string idle_text_;
  std::chrono::milliseconds idle_every_{0};
  Clock::time_point last_write_{};
  bool tick_armed_ = false;

  std::deque<Out> out_;
  bool writing_ = false;
  bool body_unread_ = false;  // the request was answered before its body was read
  size_t lingered_ = 0;
  std::array<char, 16384> discard_{};
};

// Held by the handler and by the engine's sink, possibly past the connection and the server: it
// keeps only weak references, and reaches the connection's strand only while the gate is open (the
// I/O context alive), never holding an executor of its own that would outlive it.
// Each posted call holds its exchange, so the address it is matched by (is it still the connection's
// current exchange?) cannot be reused by a later exchange while the call waits.
struct Connection::Exchange : HttpExchange, std::enable_shared_from_this<Exchange> {
  std::weak_ptr<Connection> conn;
  std::shared_ptr<PostGate> gate;

  template <class F>
  void on_strand(F f) {
    std::lock_guard<std::mutex> lock(gate->mu);
    if (!gate->open) return;
    const std::shared_ptr<Connection> c = conn.lock();
    if (!c) return;
    net::post(c->stream_.get_executor(), [w = conn, self = shared_from_this(), f = std::move(f)]() mutable {
      if (auto alive = w.lock()) f(*alive, self.get());
    });
  }
  void reply(HttpReply r) override {
    on_strand([r = std::move(r)](Connection& c, const Exchange* ex) mutable { c.reply(ex, std::move(r)); });
  }
  void start_stream(int status, std::string type, Headers headers, std::string idle_text,
                    std::chrono::milliseconds idle_every) override {
    on_strand([=](Connection& c, const Exchange* ex) mutable {
      c.start_stream(ex, status, std::move(type), std::move(headers), std::move(idle_text), idle_every);
    });
  }
  void send(std::string data) override {
    on_strand([d = std::move(data)](Connection& c, const Exchange* ex) mutable { c.send(ex, std::move(d)); });
  }
  void finish() override {
    on_strand([](Connection& c, const Exchange* ex) { c.finish(ex); });
  }
  void on_gone(std::function<void()> fn) override {
    on_strand([fn = std::move(fn)](Connection& c, const Exchange* ex) mutable { c.on_gone(ex, std::move(fn)); });
  }
  void after(std::chrono::milliseconds delay, std::function<void()> fn) override {
    on_strand([delay, fn = std::move(fn)](Connection& c, const Exchange* ex) mutable { c.after(ex, delay, std::move(fn)); });
  }
};

// ---------------------------------------------------------------------------------------------
// Reading

void Connection::read_next() {
  if (closed_) return;
  exchange_.reset();
  replying_ = streaming_ = false;
  on_gone_ = nullptr;
  deadlines_.clear();
  extra_.clear();
  close_after_ = false;
  parser_.emplace();
  parser_->header_limit(static_cast<std::uint32_t>(owner_.limits.header_bytes));
  parser_->body_limit(owner_.limits.body_bytes);
  stream_.expires_after(owner_.limits.header_timeout);
  http::async_read_header(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
    self->on_header(ec);
  });
}

void Connection::on_header(beast::error_code ec) {
  if (ec == http::error::header_limit) return refuse(431, "the request head is larger than " + std::to_string(owner_.limits.header_bytes) + " bytes", "request_header_too_large");
  if (ec == http::error::body_limit) {
    return refuse(413, "The request body is larger than this server's limit of " + std::to_string(owner_.limits.body_bytes) + " bytes", "request_too_large");
  }
  if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == net::error::eof ||
      ec == net::error::connection_reset || ec == net::error::operation_aborted || owner_.stopping) {
    return close();  // the client left, idled past the deadline, or the server stops
  }
  if (ec) return refuse(400, "malformed HTTP request (" + ec.message() + ")", "malformed_request");
  const auto& req = parser_->get();
  version_ = req.version();
  keep_alive_ = req.keep_alive();
  head_ = RequestHead{std::string(req.method_string()), std::string(req.target()), {}};
  head_.path = head_.path.substr(0, head_.path.find('?'));
  for (const auto& f : req) head_.headers.emplace(std::string(f.name_string()), std::string(f.value()));
  const bool body_unread = !parser_->is_done();
  if (std::optional<HttpReply> answer = owner_.check(head_, extra_)) {
    // A refusal closes the connection (the unread body must not be parsed as a request, and a
    // refused client gets nothing more); an accepted preflight keeps it.
    if (body_unread || answer->status >= 400) answer->close = true;
    body_unread_ = body_unread;
    exchange_ = std::make_shared<Exchange>();
    return reply(exchange_.get(), std::move(*answer));
  }
  if (!body_unread) return dispatch_request();
  if (beast::iequals(req[http::field::expect], "100-continue")) {
    queue({"HTTP/1.1 100 Continue\r\n\r\n", false});
  }
  stream_.expires_after(owner_.limits.body_timeout);
  http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code e, size_t) { self->on_body(e); });
}

void Connection::on_body(beast::error_code ec) {
  if (ec == http::error::body_limit) {
    return refuse(413, "The request body is larger than this server's limit of " + std::to_string(owner_.limits.body_bytes) + " bytes", "request_too_large");
  }
  if (ec) return close();  // cut off, too slow (the body deadline), or the server stops
  dispatch_request();
}

void Connection::dispatch_request() {
  stream_.expires_never();
  HttpRequest r;
  r.head = head_;
  r.target = std::string(parser_->get().target());
  r.version = static_cast<int>(version_);
  r.body = std::move(parser_->get().body());
  auto ex = std::make_shared<Exchange>();
  ex->conn = weak_from_this();
  ex->gate = owner_.gate;
  exchange_ = ex;
  arm_tick();
  owner_.handler(ex, std::move(r));
}

void Connection::refuse(int status, const std::string& message, const std::string& code) {
  ApiError e(status, "invalid_request_error", message, "", code);
  HttpReply r;
  r.status = status;
  r.body = nlohmann::json(error_body(e)).dump();
  r.close = true;
  body_unread_ = true;
  head_ = RequestHead{"-", "-", {}};
  exchange_ = std::make_shared<Exchange>();
  reply(exchange_.get(), std::move(r));
}

// ---------------------------------------------------------------------------------------------
// Replying

bool Connection::current(const Exchange* from) const { return !closed_ && !gone_ && exchange_ && exchange_.get() == from; }

void Connection::reply(const Exchange* from, HttpReply r) {
  if (!current(from) || replying_) return;
  replying_ = true;
  http::response<http::string_body> res{static_cast<http::status>(r.status), version_};
  res.set(http::field::server, "dsv41");
  res.set(http::field::content_type, r.content_type);
  for (const auto& [k, v] : r.headers) res.set(k, v);
  for (const auto& [k, v] : extra_) res.set(k, v);
  res.body() = std::move(r.body);
  close_after_ = r.close || !keep_alive_ || owner_.stopping;
  res.keep_alive(!close_after_);
  res.prepare_payload();
  status_ = r.status;
  std::ostringstream os;
  os << res;
  queue({os.str(), true});
}

void Connection::start_stream(const Exchange* from, int status, std::string type, Headers headers, std::string idle_text,
                              std::chrono::milliseconds idle_every) {
  if (!current(from) || replying_) return;
  replying_ = streaming_ = true;
  http::response<http::empty_body> res{static_cast<http::status>(status), version_};
  res.set(http::field::server, "dsv41");
  res.set(http::field::content_type, type);
  for (const auto& [k, v] : headers) res.set(k, v);
  for (const auto& [k, v] : extra_) res.set(k, v);
  if (version_ >= 11) {
    res.chunked(true);
    close_after_ = !keep_alive_;
    res.keep_alive(keep_alive_);
  } else {
    close_after_ = true;  // HTTP/1.0 has no chunks: the end of the stream is the end of the connection
    res.keep_alive(false);
  }
  status_ = status;
  idle_text_ = std::move(idle_text);
  idle_every_ = idle_every;
  std::ostringstream os;
  os << res.base();
  queue({os.str(), false});
}

void Connection::send(const Exchange* from, std::string data) {
  if (!current(from) || !streaming_ || data.empty()) return;
  queue({version_ >= 11 ? beast::buffers_to_string(http::make_chunk(net::buffer(data))) : std::move(data), false});
}

void Connection::finish(const Exchange* from) {
  if (!current(from) || !streaming_) return;
  streaming_ = false;  // nothing more is sent for this request, keep-alive comments included
  queue({version_ >= 11 ? beast::buffers_to_string(http::make_chunk_last()) : std::string(), true});
}

void Connection::on_gone(const Exchange* from, std::function<void()> fn) {
  if (exchange_.get() != from) return;
  if (gone_ || closed_) {
    fn();  // already gone before the work was wired: cancel it now
  } else {
    on_gone_ = std::move(fn);
  }
}

void Connection::after(const Exchange* from, std::chrono::milliseconds delay, std::function<void()> fn) {
  if (!current(from)) return;
  deadlines_.push_back({Clock::now() + delay, std::move(fn)});
}

void Connection::queue(Out out) {
  if (closed_) return;
  out_.push_back(std::move(out));
  write_next();
}

void Connection::write_next() {
  if (writing_ || out_.empty() || closed_) return;
  writing_ = true;
  stream_.expires_after(owner_.limits.write_timeout);
  net::async_write(stream_, net::buffer(out_.front().bytes), [self = shared_from_this()](beast::error_code ec, size_t) {
    self->writing_ = false;
    if (ec || self->closed_) {  // the client stopped reading or left, or the connection was closed meanwhile
      self->out_.clear();
      return self->gone();
    }
    self->last_write_ = Clock::now();
    const bool ends = self->out_.front().ends_reply;
    self->out_.pop_front();
    if (ends) return self->reply_complete();
    if (self->out_.empty() && !self->streaming_) self->stream_.expires_never();
    self->write_next();
  });
}

void Connection::reply_complete() {
  if (owner_.observer) owner_.observer(status_, head_.method, head_.path);
  exchange_.reset();
  on_gone_ = nullptr;
  if (close_after_) {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (body_unread_) return linger();
    return close();
  }
  read_next();
}

// After answering a request whose body was not read (refused, or over the limit), the client may
// still be sending it; closing at once would reset the connection and could destroy the answer
// before the client reads it. So what it sends is read and dropped for a short while (a lingering
// close), bounded in time and bytes.
void Connection::linger() {
  if (closed_ || lingered_ > 4 * owner_.limits.body_bytes + (1u << 20)) return close();
  if (lingered_ == 0) stream_.expires_after(std::chrono::seconds(1));
  stream_.async_read_some(net::buffer(discard_), [self = shared_from_this()](beast::error_code ec, size_t n) {
    self->lingered_ += n + 1;
    if (ec) return self->close();
    self->linger();
  });
}

// ---------------------------------------------------------------------------------------------
// While a request runs: the client's departure, keep-alive comments, request deadlines

void Connection::arm_tick() {
  if (tick_armed_ || closed_) return;
  tick_armed_ = true;
  tick_.expires_after(std::chrono::milliseconds(100));
  tick_.async_wait([self = shared_from_this()](beast::error_code) {
    self->tick_armed_ = false;
    self->on_tick();
  });
}

bool Connection::peer_closed() {
  char byte = 0;
  const ssize_t n = ::recv(stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void Connection::on_tick() {
  if (closed_ || !exchange_) return;
  if (peer_closed()) return gone();
  const auto now = Clock::now();
  for (size_t i = 0; i < deadlines_.size();) {
    if (deadlines_[i].first <= now) {
      auto fn = std::move(deadlines_[i].second);
      deadlines_.erase(deadlines_.begin() + static_cast<std::ptrdiff_t>(i));
      fn();
    } else {
      ++i;
    }
  }
  if (streaming_ && idle_every_.count() > 0 && !writing_ && out_.empty() && now - last_write_ >= idle_every_) {
    send(exchange_.get(), idle_text_);
  }
  if (exchange_) arm_tick();
}

void Connection::gone() {
  if (gone_ || closed_) return;
  gone_ = true;
  if (on_gone_) {
    auto fn = std::move(on_gone_);
    on_gone_ = nullptr;
    if (exchange_) fn();
  }
  close();
}

void Connection::close() {
  if (closed_) return;
  closed_ = true;
  if (on_gone_ && exchange_ && !gone_) {  // the server closes a request still running: it ends too
    gone_ = true;
    auto fn = std::move(on_gone_);
    on_gone_ = nullptr;
    fn();
  }
  beast::error_code ec;
  tick_.cancel();
  stream_.socket().close(ec);
  if (!writing_) out_.clear();  // a write in flight still uses its buffer; its handler clears
}

// ---------------------------------------------------------------------------------------------
// The listener

void ListenerState::forget_closed() {
  std::lock_guard<std::mutex> lock(mu);
  live.erase(std::remove_if(live.begin(), live.end(), [](const std::weak_ptr<Connection>& w) { return w.expired(); }),
             live.end());
}

void ListenerState::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec || stopping) return;  // the acceptor was closed
    socket.set_option(tcp::no_delay(true), ec);  // SSE events are small; do not wait to coalesce them
    if (connections.load() >= limits.max_connections) {
      // Over the cap: a short answer written without waiting (the socket's buffer takes it), then closed.
      const std::string busy = "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
      socket.non_blocking(true, ec);
      net::write(socket, net::buffer(busy), ec);
      socket.close(ec);
    } else {
      auto c = std::make_shared<Connection>(*this, std::move(socket));
      forget_closed();
      {
        std::lock_guard<std::mutex> lock(mu);
        live.push_back(c);
      }
      c->start();
    }
    accept();
  });
}

HttpListener::HttpListener(HttpLimits limits, HeadCheck check, RequestHandler handler, ReplyObserver observer)
    : impl_(std::make_shared<ListenerState>()) {
  impl_->limits = limits;
  impl_->check = std::move(check);
  impl_->handler = std::move(handler);
  impl_->observer = std::move(observer);
}

HttpListener::~HttpListener() {
  stop();
  std::lock_guard<std::mutex> lock(impl_->gate->mu);
  impl_->gate->open = false;
}

int HttpListener::bind(const std::string& host, int port) {
  beast::error_code ec;
  const std::string where = host + ":" + std::to_string(port);
  tcp::resolver resolver(impl_->ioc);
  const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
  if (ec || results.empty()) fail(where, "cannot resolve the address to listen on: " + ec.message());
  const tcp::endpoint endpoint = results.begin()->endpoint();
  tcp::acceptor& a = impl_->acceptor;
  a.open(endpoint.protocol(), ec);
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(endpoint, ec);
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  if (ec) fail(where, "cannot listen here (" + ec.message() + ")");
  return a.local_endpoint().port();
}

void HttpListener::run() {
  if (impl_->stopping) return;
  impl_->accept();
  impl_->ioc.run();
}

void HttpListener::stop() {
  ListenerState& m = *impl_;
  if (m.stopping.exchange(true)) return;
  net::post(m.ioc, [&m] {
    beast::error_code ec;
    m.acceptor.close(ec);
    std::lock_guard<std::mutex> lock(m.mu);
    for (auto& w : m.live) {
      if (auto c = w.lock()) c->close_now();
    }
  });
}

}  // namespace dsv41::server

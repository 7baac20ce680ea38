#include "server/http_connection.h"

#include <malloc.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <map>
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

// The head deadline of a probe-only connection.
constexpr std::chrono::milliseconds kProbeHeadTimeout{2000};

namespace {

// Whether posts from other threads may still reach the I/O context: cleared before it is destroyed,
// so an engine event arriving after the server has gone is dropped instead of touching freed memory.
struct PostGate {
  std::mutex mu;
  bool open = true;
};

// The server-wide budget of body bytes; shares of it outlive the listener (a worker may hold one).
struct BodyBudget {
  std::mutex mu;
  size_t limit = 0;
  size_t held = 0;
};

// Which connections a new one may take: a full one, one for probes only, or none.
enum class Slot { Full, Probe, None };

// After a share this large is given back, the allocator returns its free pages to the system: a
// parsed 8 MiB body is tens of MB of small blocks that would otherwise stay in the process.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

}  // namespace

class BodyShare {
 public:
  BodyShare(std::shared_ptr<BodyBudget> budget, size_t bytes) : budget_(std::move(budget)), bytes_(bytes) {}
  ~BodyShare() {
    {
      std::lock_guard<std::mutex> lock(budget_->mu);
      budget_->held -= bytes_;
    }
    if (bytes_ >= kTrimAfterBytes) malloc_trim(0);
  }
  BodyShare(const BodyShare&) = delete;
  BodyShare& operator=(const BodyShare&) = delete;
  // Takes `bytes` of the budget, or null when they do not fit.
  static std::shared_ptr<BodyShare> take(const std::shared_ptr<BodyBudget>& budget, size_t bytes) {
    std::lock_guard<std::mutex> lock(budget->mu);
    if (budget->held + bytes > budget->limit) return nullptr;
    budget->held += bytes;
    return std::make_shared<BodyShare>(budget, bytes);
  }
  // Gives back what a chunked body, reserved at the body limit, did not use.
  void shrink_to(size_t bytes) {
    if (bytes >= bytes_) return;
    std::lock_guard<std::mutex> lock(budget_->mu);
    budget_->held -= bytes_ - bytes;
    bytes_ = bytes;
  }

 private:
  std::shared_ptr<BodyBudget> budget_;
  size_t bytes_;
};

class Connection;

struct ListenerState {
  HttpLimits limits;
  HeadCheck check;
  RequestHandler handler;
  ReplyObserver observer;
  ListenerEvents events;
  std::shared_ptr<PostGate> gate = std::make_shared<PostGate>();
  std::shared_ptr<BodyBudget> bodies = std::make_shared<BodyBudget>();
  std::mutex mu;
  std::vector<std::weak_ptr<Connection>> live;  // for stop()
  // Connections held, in all and per client address: full ones, and those for probes only.
  size_t full = 0, probes = 0;
  std::map<net::ip::address, std::pair<size_t, size_t>> per_client;
  std::atomic<bool> stopping{false};
  bool accept_failing = false;  // on the I/O thread: an episode of failed accepts is under way
  // Last, so it goes first: destroying it destroys the handlers still queued, and with them the
  // connections they hold, which use the members above.
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_retry{ioc};

  void accept();
  void accept_failed(const beast::error_code& ec);
  void forget_closed();
  // Takes a slot for a connection from `client`; `why` says which cap was reached when it is not Full.
  Slot admit(const net::ip::address& client, std::string& why);
  void release(const net::ip::address& client, Slot slot);
  void log(const std::string& line) const {
    if (events.log) events.log(line);
  }
  void turned_away(int status) const {
    if (events.turned_away) events.turned_away(status);
  }
};

// One client connection, all of whose work runs on its strand.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ListenerState& owner, tcp::socket socket, net::ip::address client, Slot slot, std::string why)
      : owner_(owner), stream_(std::move(socket)), tick_(stream_.get_executor()), client_(std::move(client)),
        slot_(slot), probe_refusal_(std::move(why)) {}
  ~Connection() { owner_.release(client_, slot_); }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_next(); });
  }
  // The server stops: closes an idle connection now, and one answering a request once its reply is
  // complete or `grace` has passed.
  void wind_down(std::chrono::milliseconds grace) {
    net::post(stream_.get_executor(), [self = shared_from_this(), grace] {
      if (!self->exchange_ || grace.count() <= 0) return self->close();
      self->close_after_ = true;
      self->deadlines_.push_back({Clock::now() + grace, [c = self.get()] { c->close(); }});
      self->arm_tick();
    });
  }
  bool is_gone() const { return gone_flag_; }

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
  void refuse(int status, const std::string& message, const std::string& code, Headers headers = {});
  bool take_body_share();
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
  const net::ip::address client_;
  const Slot slot_;
  const std::string probe_refusal_;  // a probe-only connection's answer to anything but a probe
  std::atomic<bool> gone_flag_{false};  // gone_ || closed_, for other threads (HttpExchange::gone)
  std::shared_ptr<BodyShare> share_;  // the request's share of the body budget, until dispatched
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
  size_t out_bytes_ = 0;  // in out_
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
  bool gone() const override {
    const std::shared_ptr<Connection> c = conn.lock();
    return !c || c->is_gone();
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
  share_.reset();
  parser_.emplace();
  parser_->header_limit(static_cast<std::uint32_t>(owner_.limits.header_bytes));
  parser_->body_limit(owner_.limits.body_bytes);
  // A probe sends its request at once: a probe-only slot is not held longer than that.
  stream_.expires_after(slot_ == Slot::Probe ? std::min(owner_.limits.header_timeout, kProbeHeadTimeout)
                                             : owner_.limits.header_timeout);
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
  keep_alive_ = req.keep_alive() && slot_ == Slot::Full;
  head_ = RequestHead{std::string(req.method_string()), std::string(req.target()), {}};
  head_.path = head_.path.substr(0, head_.path.find('?'));
  for (const auto& f : req) head_.headers.emplace(std::string(f.name_string()), std::string(f.value()));
  const bool body_unread = !parser_->is_done();
  // RFC 9112 3.2: exactly one Host in HTTP/1.1, at most one in HTTP/1.0; anything else is a 400.
  const size_t hosts = req.count(http::field::host);
  if (hosts > 1 || (version_ >= 11 && hosts == 0)) {
    return refuse(400, "an HTTP/1.1 request carries exactly one Host header field (this one has " +
                           std::to_string(hosts) + ")", "bad_host");
  }
  if (slot_ == Slot::Probe) {
    const bool probe = (head_.method == "GET" || head_.method == "HEAD") &&
                       (head_.path == "/health" || head_.path == "/metrics");
    if (!probe) {
      owner_.turned_away(503);
      return refuse(503, probe_refusal_ + "; only GET /health and /metrics are answered beyond it", "too_many_connections",
                    {{"Retry-After", "1"}});
    }
  }
  if (std::optional<HttpReply> answer = owner_.check(head_, extra_)) {
    // A refusal closes the connection (the unread body must not be parsed as a request, and a
    // refused client gets nothing more); an accepted preflight keeps it.
    if (body_unread || answer->status >= 400) answer->close = true;
    body_unread_ = body_unread;
    exchange_ = std::make_shared<Exchange>();
    return reply(exchange_.get(), std::move(*answer));
  }
  if (!take_body_share()) {
    owner_.turned_away(503);
    return refuse(503, "the server holds as many request bodies as it may (" +
                           std::to_string(owner_.limits.body_bytes_in_flight) + " bytes); retry shortly",
                  "server_busy", {{"Retry-After", "1"}});
  }
  if (!body_unread) return dispatch_request();
  if (beast::iequals(req[http::field::expect], "100-continue")) {
    queue({"HTTP/1.1 100 Continue\r\n\r\n", false});
  }
  stream_.expires_after(owner_.limits.body_timeout);
  http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code e, size_t) { self->on_body(e); });
}

// A body's bytes are taken from the server-wide budget before any is read: as declared, or, when
// chunked, as much as the body limit allows (given back down to its size once it is read).
bool Connection::take_body_share() {
  const auto& req = parser_->get();
  const size_t bytes = req.chunked() ? owner_.limits.body_bytes
                                     : static_cast<size_t>(std::min<std::uint64_t>(parser_->content_length().value_or(0),
                                                                                  owner_.limits.body_bytes));
  if (bytes == 0) return true;
  share_ = BodyShare::take(owner_.bodies, bytes);
  return share_ != nullptr;
}

// Whether a read failed on the request's bytes (answered 400) rather than on the connection (closed).
static bool malformed(const beast::error_code& ec) {
  static const beast::error_category& http_errors = http::make_error_code(http::error::bad_chunk).category();
  return ec.category() == http_errors && ec != http::error::partial_message && ec != http::error::end_of_stream;
}

void Connection::on_body(beast::error_code ec) {
  if (ec == http::error::body_limit) {
    return refuse(413, "The request body is larger than this server's limit of " + std::to_string(owner_.limits.body_bytes) + " bytes", "request_too_large");
  }
  if (ec && malformed(ec) && !owner_.stopping) return refuse(400, "malformed request body (" + ec.message() + ")", "malformed_request");
  if (ec) return close();  // cut off, too slow (the body deadline), or the server stops
  dispatch_request();
}

void Connection::dispatch_request() {
  stream_.expires_never();
  HttpRequest r;
  if (share_) share_->shrink_to(parser_->get().body().size());
  r.share = std::move(share_);
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

void Connection::refuse(int status, const std::string& message, const std::string& code, Headers headers) {
  ApiError e(status, status >= 500 ? "server_error" : "invalid_request_error", message, "", code);
  HttpReply r;
  r.status = status;
  r.body = nlohmann::json(error_body(e)).dump();
  r.headers = std::move(headers);
  r.close = true;
  share_.reset();
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
  if (head_.method == "HEAD") {
    os << res.base();  // the head a GET gets, Content-Length included, and no body (RFC 9110 9.3.2)
  } else {
    os << res;
  }
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
    close_after_ = close_after_ || !keep_alive_ || owner_.stopping;
    res.keep_alive(!close_after_);
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
  // A client this far behind has stopped reading: its request is cancelled rather than its events
  // buffered without end (the write deadline alone would let minutes of tokens pile up).
  if (out_bytes_ > owner_.limits.stream_buffer_bytes) gone();
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
  out_bytes_ += out.bytes.size();
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
      self->out_bytes_ = 0;
      return self->gone();
    }
    self->last_write_ = Clock::now();
    const bool ends = self->out_.front().ends_reply;
    self->out_bytes_ -= self->out_.front().bytes.size();
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
  if (close_after_ || owner_.stopping) {
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
  gone_flag_ = true;
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
  gone_flag_ = true;
  share_.reset();
  if (on_gone_ && exchange_ && !gone_) {  // the server closes a request still running: it ends too
    gone_ = true;
    auto fn = std::move(on_gone_);
    on_gone_ = nullptr;
    fn();
  }
  beast::error_code ec;
  tick_.cancel();
  stream_.socket().close(ec);
  if (!writing_) {  // a write in flight still uses its buffer; its handler clears
    out_.clear();
    out_bytes_ = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The listener

void ListenerState::forget_closed() {
  std::lock_guard<std::mutex> lock(mu);
  live.erase(std::remove_if(live.begin(), live.end(), [](const std::weak_ptr<Connection>& w) { return w.expired(); }),
             live.end());
}

Slot ListenerState::admit(const net::ip::address& client, std::string& why) {
  std::lock_guard<std::mutex> lock(mu);
  auto& [client_full, client_probes] = per_client[client];
  if (full < limits.max_connections && client_full < limits.max_client_connections) {
    ++full, ++client_full;
    return Slot::Full;
  }
  why = full >= limits.max_connections
            ? "the server holds its maximum of " + std::to_string(limits.max_connections) + " connections"
            : "this client holds its maximum of " + std::to_string(limits.max_client_connections) + " connections";
  // Half the probe slots at most per address, so one client cannot take them all either.
  if (probes < limits.probe_connections && client_probes < std::max<size_t>(1, limits.probe_connections / 2)) {
    ++probes, ++client_probes;
    return Slot::Probe;
  }
  if (client_full == 0 && client_probes == 0) per_client.erase(client);
  return Slot::None;
}

void ListenerState::release(const net::ip::address& client, Slot slot) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = per_client.find(client);
  if (it == per_client.end()) return;
  if (slot == Slot::Full) --full, --it->second.first;
  if (slot == Slot::Probe) --probes, --it->second.second;
  if (it->second.first == 0 && it->second.second == 0) per_client.erase(it);
}

void ListenerState::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (stopping) return;  // the acceptor was closed
    if (ec) return accept_failed(ec);
    if (accept_failing) {
      accept_failing = false;
      log("accepting connections again");
    }
    socket.set_option(tcp::no_delay(true), ec);  // SSE events are small; do not wait to coalesce them
    socket.set_option(net::socket_base::send_buffer_size(limits.socket_send_buffer), ec);
    const net::ip::address client = socket.remote_endpoint(ec).address();
    std::string why;
    const Slot slot = ec ? Slot::None : admit(client, why);
    if (ec) {
      socket.close(ec);  // the client left before it could be looked at
    } else if (slot == Slot::None) {
      // Over every cap: a short answer written without waiting (the socket's buffer takes it), then closed.
      ApiError e(503, "server_error", why + "; retry shortly", "", "too_many_connections");
      const std::string body = nlohmann::json(error_body(e)).dump();
      const std::string busy = "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
                               "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                               "\r\n\r\n" + body;
      socket.non_blocking(true, ec);
      net::write(socket, net::buffer(busy), ec);
      socket.close(ec);
      turned_away(503);
    } else {
      auto c = std::make_shared<Connection>(*this, std::move(socket), client, slot, std::move(why));
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

// A failed accept (EMFILE or ENFILE when descriptors run out, ENOBUFS, ECONNABORTED) is tried again
// after a back-off: accepting again at once would spin on the same error, and not accepting again
// would leave the server deaf for good. The first failure of an episode is logged.
void ListenerState::accept_failed(const beast::error_code& ec) {
  if (events.accept_failed) events.accept_failed();
  if (!accept_failing) {
    accept_failing = true;
    log("cannot accept a connection (" + ec.message() + "); trying again every " +
        std::to_string(limits.accept_backoff.count()) + " ms");
  }
  accept_retry.expires_after(limits.accept_backoff);
  accept_retry.async_wait([this](beast::error_code e) {
    if (!e && !stopping) accept();
  });
}

HttpListener::HttpListener(HttpLimits limits, HeadCheck check, RequestHandler handler, ReplyObserver observer,
                           ListenerEvents events)
    : impl_(std::make_shared<ListenerState>()) {
  impl_->limits = limits;
  impl_->check = std::move(check);
  impl_->handler = std::move(handler);
  impl_->observer = std::move(observer);
  impl_->events = std::move(events);
  impl_->bodies->limit = std::max(limits.body_bytes_in_flight, limits.body_bytes);
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

void HttpListener::stop(std::chrono::milliseconds grace) {
  ListenerState& m = *impl_;
  if (m.stopping.exchange(true)) return;
  net::post(m.ioc, [&m, grace] {
    beast::error_code ec;
    m.acceptor.close(ec);
    m.accept_retry.cancel();
    std::lock_guard<std::mutex> lock(m.mu);
    for (auto& w : m.live) {
      if (auto c = w.lock()) c->wind_down(grace);
    }
  });
}

}  // namespace dsv41::server

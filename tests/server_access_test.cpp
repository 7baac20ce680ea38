// Who may call the server and which bodies it reads (server/access_policy.h), first as the pure
// decision, then through the live server: API keys, Host and Origin checks, CORS preflight, the
// framings refused before the body is read (and the connection closed after), served model names and
// aliases, /tokenize and /detokenize, and escaped request logging.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>

#include "server/access_policy.h"
#include "server/json_body.h"
#include "server/openai_api.h"
#include "server_util.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace dsv41::server {
namespace {

RequestHead head(const std::string& method, const std::string& path,
                 std::multimap<std::string, std::string> headers = {}) {
  return {method, path, std::move(headers)};
}

std::multimap<std::string, std::string> json_body(size_t bytes = 2) {
  return {{"Content-Type", "application/json"}, {"Content-Length", std::to_string(bytes)}};
}

int status_of(const AccessDecision& d) { return d.refusal ? d.refusal->status : 0; }

TEST(AccessPolicy, LoopbackServersAnswerOnlyLoopbackHostNames) {
  AccessPolicy p;
  p.loopback_only_hosts = true;
  for (const char* host : {"localhost", "localhost:8080", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:8080", "127.1.2.3",
                           "[::1]", "[::1]:8080"}) {
    EXPECT_EQ(status_of(decide_access(head("GET", "/health", {{"Host", host}}), p)), 0) << host;
  }
  for (const char* host : {"evil.example", "evil.example:8080", "127.0.0.1.evil.example", "127.0.0.1.", "10.0.0.1",
                           "[::2]:80", "127.0.0.1x", "1270.0.0.1"}) {
    const AccessDecision d = decide_access(head("GET", "/health", {{"Host", host}}), p);
    EXPECT_EQ(status_of(d), 403) << host;
    if (d.refusal) {
      EXPECT_EQ(d.refusal->code, "host_not_allowed");
    }
  }
  EXPECT_EQ(status_of(decide_access(head("GET", "/health"), p)), 0) << "HTTP/1.0 clients may send no Host";
  p.loopback_only_hosts = false;  // a server on a public address is reached under any name
  EXPECT_EQ(status_of(decide_access(head("GET", "/health", {{"Host", "evil.example"}}), p)), 0);

  for (const char* a : {"127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"}) EXPECT_TRUE(is_loopback_address(a)) << a;
  for (const char* a : {"0.0.0.0", "::", "192.168.1.2", "example.com", "127.0.0.1.example.com"}) {
    EXPECT_FALSE(is_loopback_address(a)) << a;
  }
}

TEST(AccessPolicy, WebPagesNeedTheirOriginListed) {
  AccessPolicy none;
  const AccessDecision refused = decide_access(head("POST", "/v1/chat/completions",
                                                    {{"Origin", "http://evil.example"}, {"Content-Type", "application/json"},
                                                     {"Content-Length", "2"}}),
                                               none);
  EXPECT_EQ(status_of(refused), 403);
  EXPECT_EQ(refused.refusal->code, "origin_not_allowed");
  EXPECT_TRUE(refused.headers.empty()) << "no CORS headers for an origin not allowed";

  AccessPolicy listed;
  listed.cors_origins = {"http://app.example"};
  EXPECT_EQ(status_of(decide_access(head("GET", "/v1/models", {{"Origin", "http://evil.example"}}), listed)), 403);
  const AccessDecision ok = decide_access(head("GET", "/v1/models", {{"Origin", "http://app.example"}}), listed);
  EXPECT_EQ(status_of(ok), 0);
  EXPECT_FALSE(ok.preflight);
  ASSERT_EQ(ok.headers.size(), 2u);
  EXPECT_EQ(ok.headers[0], std::make_pair(std::string("Access-Control-Allow-Origin"), std::string("http://app.example")));

  // the preflight is answered before the key is asked for: browsers send no credentials with it
  listed.api_key = "k";
  const AccessDecision pre = decide_access(
      head("OPTIONS", "/v1/chat/completions", {{"Origin", "http://app.example"}, {"Access-Control-Request-Method", "POST"}}),
      listed);
  EXPECT_EQ(status_of(pre), 0);
  EXPECT_TRUE(pre.preflight);
  bool methods = false, allow_headers = false;
  for (const auto& [k, v] : pre.headers) {
    methods |= k == "Access-Control-Allow-Methods" && v.find("POST") != std::string::npos;
    allow_headers |= k == "Access-Control-Allow-Headers" && v.find("Authorization") != std::string::npos;
  }
  EXPECT_TRUE(methods && allow_headers);

  AccessPolicy any;
  any.cors_origins = {"*"};
  EXPECT_EQ(status_of(decide_access(head("GET", "/v1/models", {{"Origin", "null"}}), any)), 0);
}

TEST(AccessPolicy, ApiKeyGuardsTheApiRoutesOnly) {
  AccessPolicy p;
  p.api_key = "s3cret-key";
  for (const char* path : {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/x", "/tokenize",
                           "/detokenize", "/v1/debug/render", "/v1/unknown"}) {
    const std::string method = std::string(path).find("models") != std::string::npos ? "GET" : "POST";
    auto with = [&](const std::string& auth) {
      auto h = json_body();
      if (!auth.empty()) h.insert({"Authorization", auth});
      return status_of(decide_access(head(method, path, h), p));
    };
    EXPECT_EQ(with(""), 401) << path;
    EXPECT_EQ(with("Bearer wrong"), 401) << path;
    EXPECT_EQ(with("Bearer s3cret-ke"), 401) << path;
    EXPECT_EQ(with("Bearer s3cret-key!"), 401) << path;
    EXPECT_EQ(with("Basic s3cret-key"), 401) << path;
    EXPECT_EQ(with("Bearer s3cret-key"), 0) << path;
    EXPECT_EQ(with("bearer  s3cret-key "), 0) << path;  // the scheme is case-insensitive
  }
  for (const char* path : {"/health", "/metrics"}) {
    EXPECT_EQ(status_of(decide_access(head("GET", path), p)), 0) << path << " stays open for probes";
  }
  EXPECT_EQ(decide_access(head("GET", "/v1/models"), p).refusal->code, "invalid_api_key");
  p.api_key.clear();
  EXPECT_EQ(status_of(decide_access(head("GET", "/v1/models"), p)), 0);
}

TEST(AccessPolicy, BodiesMustBeDeclaredUncompressedJson) {
  const AccessPolicy p;
  auto check = [&](std::multimap<std::string, std::string> h) { return status_of(decide_access(head("POST", "/v1/completions", h), p)); };
  EXPECT_EQ(check(json_body()), 0);
  EXPECT_EQ(check({{"Content-Type", "Application/JSON; charset=utf-8"}, {"Content-Length", "5"}}), 0);
  EXPECT_EQ(check({{"Content-Type", "application/json"}}), 411) << "no length";
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Transfer-Encoding", "chunked"}}), 0);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Transfer-Encoding", "gzip, chunked"}}), 501);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Transfer-Encoding", "gzip"}}), 501);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Content-Length", "-5"}}), 400);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Content-Length", "5x"}}), 400);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Content-Length", "5"}, {"Content-Encoding", "gzip"}}), 415);
  EXPECT_EQ(check({{"Content-Type", "application/json"}, {"Content-Length", "5"}, {"Content-Encoding", "identity"}}), 0);
  EXPECT_EQ(check({{"Content-Type", "text/plain"}, {"Content-Length", "5"}}), 415);
  EXPECT_EQ(check({{"Content-Type", "application/x-www-form-urlencoded"}, {"Content-Length", "9000"}}), 415);
  EXPECT_EQ(check({{"Content-Type", "multipart/form-data; boundary=x"}, {"Content-Length", "5"}}), 415);
  EXPECT_EQ(check({{"Content-Type", "application/jsonx"}, {"Content-Length", "5"}}), 415);
  EXPECT_EQ(check({{"Content-Length", "5"}}), 415) << "no type";
  EXPECT_EQ(status_of(decide_access(head("GET", "/v1/models"), p)), 0) << "a GET has no body to check";
}

TEST(AccessPolicy, PrintableEscapesEverythingThatCouldForgeALogLine) {
  EXPECT_EQ(printable("/v1/models"), "/v1/models");
  EXPECT_EQ(printable("/a\nGET /b 200"), "/a%0AGET /b 200");
  EXPECT_EQ(printable("\r\x1b[31m%"), "%0D%1B[31m%25");
  EXPECT_EQ(printable(std::string("\xff\x00", 2)), "%FF%00");
}

// JSON that is valid text but not a valid request value: 400, and the body is not echoed.
TEST(AccessPolicy, NumbersOutOfRangeAre400) {
  const Tokenizer tok = Tokenizer::from_file(test::tiny_model_dir() + "/tokenizer.json");
  ModelInfo m;
  m.name = "tiny";
  m.context_length = 4096;
  m.tokenizer = &tok;
  for (const char* body : {R"({"prompt":"x","max_tokens":1e309})", R"({"prompt":"x","temperature":-1e400})",
                           R"({"prompt":"x","junk":[1e309]})"}) {
    try {
      parse_request(Endpoint::Completions, body, m);
      ADD_FAILURE() << "accepted " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.message.find("309"), std::string::npos) << e.message;
      EXPECT_EQ(e.message.find("400"), std::string::npos) << e.message;
    }
  }
}

// The linear-time parser builds what nlohmann's own (quadratic) ordered parser builds: key order,
// duplicate keys (first place, last value), every kind of value.
TEST(JsonBody, BuildsWhatNlohmannsOrderedParserBuilds) {
  for (const char* text : {R"({"b":1,"a":[true,false,null],"c":{"z":"\u00e9\n","y":-0.5e3}})",
                           R"({"a":1,"b":2,"a":{"x":[1,{"a":3,"a":4}]}})", R"([1,[2,[3,{}]],[]])", R"("x")", "18446744073709551615",
                           R"({"k":-9223372036854775808,"f":1.5,"e":1e308})"}) {
    nlohmann::ordered_json mine;
    JsonBodyError error;
    ASSERT_TRUE(parse_json_limited(text, JsonLimits{}, mine, error)) << text << ": " << error.detail;
    EXPECT_EQ(mine.dump(), nlohmann::ordered_json::parse(text).dump()) << text;
  }
  for (const char* text : {"{", R"({"a":1,})", R"({"a":1} x)", "\"\xff\"", ""}) {
    nlohmann::ordered_json mine;
    JsonBodyError error;
    EXPECT_FALSE(parse_json_limited(text, JsonLimits{}, mine, error)) << text;
    EXPECT_EQ(error.kind, JsonBodyError::Kind::Syntax) << text;
    EXPECT_TRUE(mine.is_null());
  }
}

// One object of 200,000 keys parses in well under a second (nlohmann's ordered parser, whose insert is
// a linear search, took about a minute), and the limits stop a body the moment it crosses them.
TEST(JsonBody, LinearInMembersAndBoundedInMembersAndDepth) {
  std::string wide = "{";
  for (int i = 0; i < 200000; ++i) wide += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  wide += "}";
  nlohmann::ordered_json v;
  JsonBodyError error;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(parse_json_limited(wide, JsonLimits{128, 1000000}, v, error)) << error.detail;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(v.size(), 200000u);
  EXPECT_EQ(v.begin().key(), "0");
  EXPECT_EQ((--v.end()).key(), "199999");
  EXPECT_LT(secs, test::kSanitized ? 10.0 : 2.0);

  EXPECT_FALSE(parse_json_limited(wide, JsonLimits{128, 199999}, v, error));
  EXPECT_EQ(error.kind, JsonBodyError::Kind::TooManyMembers);
  EXPECT_NE(error.detail.find("199999"), std::string::npos) << error.detail;
  EXPECT_TRUE(parse_json_limited(wide, JsonLimits{128, 200000}, v, error)) << "the limit itself is allowed";

  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  EXPECT_FALSE(parse_json_limited(deep, JsonLimits{}, v, error));
  EXPECT_EQ(error.kind, JsonBodyError::Kind::TooDeep);
  EXPECT_TRUE(parse_json_limited(std::string(128, '[') + std::string(128, ']'), JsonLimits{}, v, error));
  EXPECT_FALSE(parse_json_limited(std::string(129, '[') + std::string(129, ']'), JsonLimits{}, v, error));

  // A request body: 400 naming the limit, and repeated keys do not count twice.
  std::string many = R"({"prompt":"x","junk":{)";
  for (int i = 0; i <= static_cast<int>(kMaxJsonMembers); ++i) many += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  many += "}}";
  try {
    parse_json_body(many);
    ADD_FAILURE() << "accepted an object of " << kMaxJsonMembers + 1 << " members";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(e.message.find("more than 10000 members"), std::string::npos) << e.message;
  }
  std::string repeated = R"({"prompt":"x")";
  for (int i = 0; i < 20000; ++i) repeated += R"(,"prompt":"y")";
  EXPECT_EQ(parse_json_body(repeated + "}")["prompt"], "y");
}

// ---------------------------------------------------------------------------------------------
// Through the live server

// Sends raw bytes on a fresh connection and returns what the server sends back until it closes the
// connection (or 5 s pass, which the caller sees as a missing close), or with `wait_for_close`
// false until one whole response has come.
ServerOptions guarded_options() {
  ServerOptions so;
  so.api_key = "test-key";
  so.served_model_names = {"dsv41-tiny", "tiny-alias"};
  so.cors_origins = {"http://app.example"};
  return so;
}

Reply call(int port, const std::string& method, const std::string& path, const std::string& body,
           const httplib::Headers& headers) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(std::chrono::seconds(60));
  return reply_of(method == "GET" ? cli.Get(path.c_str(), headers)
                                  : cli.Post(path.c_str(), headers, body, "application/json"));
}

TEST(ServerAccess, KeyNamesAndTokenRoutesThroughTheServer) {
  LiveServer s(tiny_engine_options(), guarded_options());
  const httplib::Headers key = {{"Authorization", "Bearer test-key"}};
  EXPECT_EQ(call(s.port(), "GET", "/v1/models", "", {}).status, 401);
  EXPECT_EQ(call(s.port(), "GET", "/v1/models", "", {{"Authorization", "Bearer nope"}}).status, 401);
  EXPECT_EQ(call(s.port(), "GET", "/health", "", {}).status, 200);

  const Reply models = call(s.port(), "GET", "/v1/models", "", key);
  ASSERT_EQ(models.status, 200) << models.raw;
  ASSERT_EQ(models.body["data"].size(), 2u);
  EXPECT_EQ(models.body["data"][0]["id"], "dsv41-tiny");
  EXPECT_EQ(models.body["data"][1]["id"], "tiny-alias");
  EXPECT_EQ(call(s.port(), "GET", "/v1/models/tiny-alias", "", key).status, 200);
  EXPECT_EQ(call(s.port(), "GET", "/v1/models/tiny", "", key).status, 404) << "the folder name is not served";

  // a request naming the alias is answered under that name; one naming no model under the first
  const json completion = {{"prompt", "Hi"}, {"max_tokens", 2}, {"temperature", 0}};
  json aliased = completion;
  aliased["model"] = "tiny-alias";
  const Reply a = call(s.port(), "POST", "/v1/completions", aliased.dump(), key);
  ASSERT_EQ(a.status, 200) << a.raw;
  EXPECT_EQ(a.body["model"], "tiny-alias");
  const Reply plain = call(s.port(), "POST", "/v1/completions", completion.dump(), key);
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["model"], "dsv41-tiny");
  EXPECT_EQ(plain.body["choices"][0]["text"], a.body["choices"][0]["text"]);
  json other = completion;
  other["model"] = "tiny";
  EXPECT_EQ(call(s.port(), "POST", "/v1/completions", other.dump(), key).status, 404);

  // /tokenize is the completions prompt (BOS first); /detokenize gives the text back
  const Tokenizer& tok = s.engine().tokenizer();
  const Reply t = call(s.port(), "POST", "/tokenize", json{{"prompt", "Hello there, world"}}.dump(), key);
  ASSERT_EQ(t.status, 200) << t.raw;
  std::vector<int32_t> expected = {static_cast<int32_t>(s.engine().config().bos_token_id)};
  for (int32_t id : tok.encode("Hello there, world", true)) expected.push_back(id);
  EXPECT_EQ(t.body["tokens"].get<std::vector<int32_t>>(), expected);
  EXPECT_EQ(t.body["count"], expected.size());
  EXPECT_EQ(t.body["max_model_len"], s.engine().config().max_seq_len);
  const Reply bare = call(s.port(), "POST", "/tokenize",
                          json{{"prompt", "Hello there, world"}, {"add_special_tokens", false}}.dump(), key);
  EXPECT_EQ(bare.body["count"], expected.size() - 1);
  const Reply d = call(s.port(), "POST", "/detokenize", json{{"tokens", bare.body["tokens"]}}.dump(), key);
  ASSERT_EQ(d.status, 200) << d.raw;
  EXPECT_EQ(d.body["prompt"], "Hello there, world");
  const Reply chat = call(s.port(), "POST", "/tokenize",
                          json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}}.dump(), key);
  ASSERT_EQ(chat.status, 200) << chat.raw;
  EXPECT_GT(chat.body["count"].get<int>(), 3);
  EXPECT_EQ(call(s.port(), "POST", "/detokenize", json{{"tokens", {1, -4}}}.dump(), key).status, 400);
  EXPECT_EQ(call(s.port(), "POST", "/tokenize", json{{"prompt", 5}}.dump(), key).status, 400);
  EXPECT_EQ(call(s.port(), "POST", "/tokenize", json{{"prompt", "x"}}.dump(), {}).status, 401);
}

// Refusals decided from the head are answered at once, without waiting for (or reading) the body,
// and the connection is closed so the unread bytes are never taken for a request.
TEST(ServerAccess, RefusedFramingsAreAnsweredAtOnceAndClosed) {
  LiveServer s(tiny_engine_options(), guarded_options());
  const std::string auth = "Authorization: Bearer test-key\r\nHost: 127.0.0.1\r\n";
  struct Case {
    std::string head;
    const char* status;
  };
  const Case cases[] = {
      // a body that is never sent: the answer must not wait for it
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n", " 415 "},
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", " 501 "},
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: application/json\r\n\r\n", " 411 "},
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 100000\r\n\r\n", " 415 "},
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 9000\r\n\r\n", " 415 "},
      {"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer test-key\r\nHost: attacker.example:8080\r\n\r\n", " 403 "},
      {"GET /v1/models HTTP/1.1\r\n" + auth + "Origin: http://attacker.example\r\n\r\n", " 403 "},
      {"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n", " 401 "},
  };
  std::vector<std::future<std::pair<std::string, bool>>> replies;  // all at once: each lingers a moment
  const auto t0 = std::chrono::steady_clock::now();
  for (const Case& c : cases) {
    replies.push_back(std::async(std::launch::async, [&s, &c] {
      bool closed = false;
      std::string reply = exchange(s.port(), c.head, &closed);
      return std::make_pair(reply, closed);
    }));
  }
  for (size_t i = 0; i < replies.size(); ++i) {
    const Case& c = cases[i];
    const auto [reply, closed] = replies[i].get();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(reply.find(c.status), std::string::npos) << c.head << "\n---\n" << reply;
    EXPECT_TRUE(closed) << c.head;
    EXPECT_LT(secs, 4.0) << c.head;  // the lingering close waits up to 1 s for the unsent body
    EXPECT_NE(reply.find("\"error\""), std::string::npos) << reply;
  }

  // a body that is itself a request (what a page could send as text/plain to smuggle a request
  // without an Origin past the checks) is never parsed: one answer, then the connection ends
  const std::string smuggled = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer test-key\r\n\r\n";
  bool smuggle_closed = false;
  const std::string answer = exchange(s.port(),
                                      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                                      "Content-Length: " + std::to_string(smuggled.size()) + "\r\n\r\n" + smuggled,
                                      &smuggle_closed);
  EXPECT_NE(answer.find(" 401 "), std::string::npos) << answer;  // no key on the outer request
  EXPECT_EQ(answer.find("HTTP/1.1", 1), std::string::npos) << "the body was parsed as a request: " << answer;
  EXPECT_TRUE(smuggle_closed);

  // an allowed page: its preflight is answered, and the real request carries the CORS header
  bool closed = false;
  const std::string pre = exchange(s.port(),
                                   "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: http://app.example\r\n"
                                   "Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n",
                                   &closed);
  EXPECT_NE(pre.find(" 204 "), std::string::npos) << pre;
  EXPECT_NE(pre.find("Access-Control-Allow-Origin: http://app.example"), std::string::npos) << pre;
  const Reply models = call(s.port(), "GET", "/v1/models", "",
                            {{"Authorization", "Bearer test-key"}, {"Origin", "http://app.example"}});
  EXPECT_EQ(models.status, 200);
}

TEST(ServerAccess, TheDefaultNameIsTheFolderHoweverItIsWritten) {
  EngineOptions eo = tiny_engine_options();
  const std::string name = std::filesystem::path(eo.model_dir).filename().string();
  ASSERT_FALSE(name.empty());
  eo.model_dir += "/";
  Engine slash(eo);
  EXPECT_EQ(slash.model_name(), name);
  eo.model_dir += "./";
  Engine dot(eo);
  EXPECT_EQ(dot.model_name(), name);
}

}  // namespace
}  // namespace dsv41::server

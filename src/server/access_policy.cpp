#include "server/access_policy.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace dsv41::server {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Compares without an early exit, so the time taken does not tell how much of a guess was right
// (only its length, which is not the secret).
bool same_secret(const std::string& given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ key[i]);
  return diff == 0;
}

// localhost, ::1, or an IPv4 literal in 127.0.0.0/8 (a literal only: "127.0.0.1.example.com" is a
// name anyone can register and point anywhere).
bool loopback_name(const std::string& name) {
  const std::string h = lower(name);
  if (h == "localhost" || h == "::1") return true;
  if (h.rfind("127.", 0) != 0 || h.find_first_not_of("0123456789.") != std::string::npos) return false;
  int dots = 0, digits = 0;
  for (char c : h) {
    if (c == '.') {
      if (digits == 0 || digits > 3) return false;
      ++dots, digits = 0;
    } else {
      ++digits;
    }
  }
  return dots == 3 && digits > 0 && digits <= 3;
}

// The host name of a Host header value: "name", "name:port", "[v6]" or "[v6]:port".
std::string host_name(const std::string& value) {
  if (!value.empty() && value[0] == '[') {
    const size_t close = value.find(']');
    return close == std::string::npos ? value : value.substr(1, close - 1);
  }
  return value.substr(0, value.find(':'));
}

bool needs_key(const std::string& path) {
  return path.rfind("/v1/", 0) == 0 || path == "/tokenize" || path == "/detokenize";
}

ApiError refuse(int status, const std::string& message, const std::string& code) {
  return ApiError(status, "invalid_request_error", message, "", code);
}

}  // namespace

std::string RequestHead::header(const std::string& name) const {
  const std::string want = lower(name);
  for (const auto& [k, v] : headers) {
    if (lower(k) == want) return v;
  }
  return "";
}

bool RequestHead::has_header(const std::string& name) const {
  const std::string want = lower(name);
  return std::any_of(headers.begin(), headers.end(), [&](const auto& kv) { return lower(kv.first) == want; });
}

bool is_loopback_address(const std::string& host) {
  return loopback_name(host.size() > 2 && host.front() == '[' && host.back() == ']' ? host.substr(1, host.size() - 2) : host);
}

AccessDecision decide_access(const RequestHead& head, const AccessPolicy& policy) {
  AccessDecision d;
  if (policy.loopback_only_hosts && head.has_header("Host")) {
    if (!loopback_name(host_name(head.header("Host")))) {
      d.refusal = refuse(403, "this server listens on a loopback address and answers only Host names of this machine "
                              "(localhost, 127.0.0.1, [::1])",
                         "host_not_allowed");
      return d;
    }
  }
  if (head.has_header("Origin")) {
    const std::string origin = head.header("Origin");
    const bool allowed = std::any_of(policy.cors_origins.begin(), policy.cors_origins.end(),
                                     [&](const std::string& o) { return o == "*" || o == origin; });
    if (!allowed) {
      d.refusal = refuse(403,
                         "requests from web pages (Origin " + printable(origin) +
                             ") are not allowed; the server lists the origins it accepts with --cors-origins",
                         "origin_not_allowed");
      return d;
    }
    d.headers = {{"Access-Control-Allow-Origin", origin}, {"Vary", "Origin"}};
    if (head.method == "OPTIONS" && head.has_header("Access-Control-Request-Method")) {
      d.preflight = true;
      d.headers.push_back({"Access-Control-Allow-Methods", "GET, POST, OPTIONS"});
      d.headers.push_back({"Access-Control-Allow-Headers", "Authorization, Content-Type, x-api-key, anthropic-version"});
      d.headers.push_back({"Access-Control-Max-Age", "600"});
      return d;
    }
  }
  if (!policy.api_key.empty() && needs_key(head.path)) {
    // OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"; either will do
    const std::string auth = head.header("Authorization");
    const std::string scheme = "bearer ";
    const bool bearer = auth.size() > scheme.size() && lower(auth.substr(0, scheme.size())) == scheme;
    const bool x_key = head.has_header("x-api-key");
    const std::string given = bearer ? trim(auth.substr(scheme.size())) : trim(head.header("x-api-key"));
    if ((!bearer && !x_key) || !same_secret(given, policy.api_key)) {
      d.refusal = refuse(401,
                         bearer || x_key ? "Incorrect API key provided"
                                         : "This server needs an API key: Authorization: Bearer KEY (or x-api-key: KEY)",
                         "invalid_api_key");
      return d;
    }
  }
  if (head.method == "POST") {
    const std::string coding = lower(trim(head.header("Transfer-Encoding")));
    if (!coding.empty() && coding != "chunked") {
      d.refusal = refuse(501, "transfer coding " + printable(coding) + " is not supported (only chunked)",
                         "unsupported_transfer_encoding");
      return d;
    }
    const std::string length = head.header("Content-Length");
    if (length.empty() && coding.empty()) {
      d.refusal = refuse(411, "a POST request needs a Content-Length and a JSON body", "length_required");
      return d;
    }
    if (!length.empty() && (length.find_first_not_of("0123456789") != std::string::npos || length.size() > 18)) {
      d.refusal = refuse(400, "Content-Length must be a decimal byte count", "bad_content_length");
      return d;
    }
    const std::string encoding = lower(trim(head.header("Content-Encoding")));
    if (!encoding.empty() && encoding != "identity") {
      d.refusal = refuse(415, "compressed request bodies (Content-Encoding " + printable(encoding) + ") are not accepted",
                         "unsupported_media_type");
      return d;
    }
    const std::string type = lower(trim(head.header("Content-Type").substr(0, head.header("Content-Type").find(';'))));
    if (type != "application/json") {
      d.refusal = refuse(415,
                         "request bodies must be JSON with Content-Type: application/json, got " +
                             (type.empty() ? std::string("none") : printable(type)),
                         "unsupported_media_type");
      return d;
    }
  }
  return d;
}

std::string printable(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '%') {
      out += ch;
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace dsv41::server

// Who may talk to the server, and which request framings it reads, decided from the request line and
// headers alone, before any body byte is read (so a refused body is never buffered):
//
//  - Host check: a server bound to a loopback address answers only Host names that are loopback
//    (localhost, 127.0.0.1, [::1], any port). A web page that rebinds its own DNS name to 127.0.0.1
//    (DNS rebinding) sends its own name as Host and is refused.
//  - Origin: browsers send it on cross-origin and on every POST request; without --cors-origins no
//    origin is allowed, so a page the user opens cannot drive the local server. Allowed origins get
//    CORS headers and their preflight (OPTIONS) answered.
//  - API key: with one set, every /v1/ route, /tokenize and /detokenize need
//    "Authorization: Bearer KEY" or "x-api-key: KEY" (Anthropic's clients), 401 otherwise; /health and
//    /metrics stay open for probes.
//  - Bodies: POST bodies must be JSON (Content-Type application/json, 415 otherwise: a text/plain or
//    form body is what a page can send without a preflight), framed by Content-Length or chunked
//    (411 for neither; 501 for any other transfer coding), and not compressed (415 for any
//    Content-Encoding but identity: a small gzip body can inflate without bound). The size limit
//    itself is the connection's (server/http_connection.h), for every framing.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/api_error.h"

namespace dsv41::server {

struct AccessPolicy {
  std::string api_key;                    // empty: no authentication
  std::vector<std::string> cors_origins;  // allowed Origin values; "*" allows any; empty: none
  bool loopback_only_hosts = false;       // set when the server listens on a loopback address
};

// What the policy looks at. Header names are matched case-insensitively.
struct RequestHead {
  std::string method;
  std::string path;
  std::multimap<std::string, std::string> headers;
  std::string header(const std::string& name) const;  // "" when absent
  bool has_header(const std::string& name) const;
};

struct AccessDecision {
  std::optional<ApiError> refusal;  // set: answer this and read nothing more of the request
  bool preflight = false;           // an allowed CORS preflight: answer 204 with `headers`
  std::vector<std::pair<std::string, std::string>> headers;  // to add to the response (CORS)
};

AccessDecision decide_access(const RequestHead& head, const AccessPolicy& policy);

// True for addresses that only this machine can reach: 127.0.0.0/8, ::1, localhost.
bool is_loopback_address(const std::string& host);

// `text` with every byte outside printable ASCII written as %XX, so a logged path cannot forge
// a log line or carry terminal escapes.
std::string printable(const std::string& text);

}  // namespace dsv41::server

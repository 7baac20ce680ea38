#include "server/json_fields.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "server/api_error.h"

namespace dsv41::server {

namespace {

// A bound as a person writes it: 0, 2, 0.5 (std::to_string would give 0.000000).
std::string bound(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

}  // namespace

std::string kind(const ojson& v) {
  if (v.is_number_integer()) return "integer";
  return v.type_name();
}

// A present, non-null field, or nullptr: OpenAI clients send null for "not set".
const ojson* field(const ojson& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const ojson& body, const char* key, bool fallback) {
  const ojson* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) throw invalid_request(key, std::string(key) + " must be a boolean, got " + kind(*v));
  return v->get<bool>();
}

double get_number(const ojson& body, const char* key, double fallback, double lo, double hi, bool lo_open) {
  const ojson* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_number()) throw invalid_request(key, std::string(key) + " must be a number, got " + kind(*v));
  const double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    throw invalid_request(key, std::string(key) + " must be in " + (lo_open ? "(" : "[") + bound(lo) + ", " +
                                   bound(hi) + "], got " + v->dump());
  }
  return x;
}

// An integer field; integral floats (100.0) are accepted since some JSON writers produce them.
bool integer_of(const ojson& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::floor(d) != d || std::fabs(d) > 9.0e15) return false;
    out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

int64_t require_integer(const ojson& v, const std::string& key) {
  int64_t out = 0;
  if (!integer_of(v, out)) throw invalid_request(key, key + " must be an integer, got " + (v.is_number() ? v.dump() : kind(v)));
  return out;
}

}  // namespace dsv41::server

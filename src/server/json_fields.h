// Reading fields of a parsed request body the way every OpenAI route does: null means "not set",
// and a wrong type or value is a 400 (ApiError) naming the field.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace dsv41::server {

using ojson = nlohmann::ordered_json;

std::string kind(const ojson& v);  // "integer", "string", "object", ... for messages
// A present, non-null field, or nullptr: OpenAI clients send null for "not set".
const ojson* field(const ojson& body, const char* key);
bool get_bool(const ojson& body, const char* key, bool fallback);
// A number in [lo, hi] ((lo, hi] with lo_open), or `fallback` when absent.
double get_number(const ojson& body, const char* key, double fallback, double lo, double hi, bool lo_open = false);
// An integer; integral floats (100.0) are accepted since some JSON writers produce them.
bool integer_of(const ojson& v, int64_t& out);
int64_t require_integer(const ojson& v, const std::string& key);

}  // namespace dsv41::server

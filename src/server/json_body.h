// A request body's JSON, parsed in time linear in its size, with the client's key order kept.
//
// nlohmann::ordered_json keeps insertion order by storing an object as a vector and finding a key by
// a linear search, so its own parser is quadratic in an object's members: one 2 MB body of 160,000
// keys held a worker for 40 s. This parser builds the same value through nlohmann's SAX interface
// and finds duplicate keys with a hash index per open object, so every byte costs O(1) on average.
// Duplicate keys keep the first key's place and the last value (as Python's json and nlohmann do).
//
// It also bounds what a body may build: objects of at most `max_members` members and nesting of at
// most `max_depth` levels (the code that walks the value recurses), refused the moment they are seen.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace dsv41::server {

struct JsonLimits {
  size_t max_depth = 128;        // arrays and objects nested inside each other
  size_t max_members = 10000;    // members of one object (a tool schema's properties, say)
};

// Why a text is not an acceptable JSON value; `detail` says where (nlohmann's position) and what.
struct JsonBodyError {
  enum class Kind { Syntax, NumberOutOfRange, TooDeep, TooManyMembers } kind = Kind::Syntax;
  std::string detail;
};

// The value of `text`, or false with `error` filled. Never throws for bad input.
bool parse_json_limited(std::string_view text, const JsonLimits& limits, nlohmann::ordered_json& out,
                        JsonBodyError& error);

}  // namespace dsv41::server

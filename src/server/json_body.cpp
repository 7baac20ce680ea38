#include "server/json_body.h"

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dsv41::server {
namespace {

using ojson = nlohmann::ordered_json;
// ordered_map is a vector of pairs underneath; appending through the vector skips its linear search.
using Members = ojson::object_t::Container;

// Builds the value as nlohmann's DOM parser does (a stack of open containers, each new value placed
// in the innermost one), with a key index per open object.
class OrderedBuilder final : public nlohmann::json_sax<ojson> {
 public:
  OrderedBuilder(ojson& root, const JsonLimits& limits, JsonBodyError& error)
      : root_(root), limits_(limits), error_(error) {}

  bool null() override { return place(nullptr); }
  bool boolean(bool v) override { return place(v); }
  bool number_integer(number_integer_t v) override { return place(v); }
  bool number_unsigned(number_unsigned_t v) override { return place(v); }
  bool number_float(number_float_t v, const string_t&) override { return place(v); }
  bool string(string_t& v) override { return place(std::move(v)); }
  bool binary(binary_t& v) override { return place(ojson::binary(std::move(v))); }

  bool start_object(std::size_t) override { return open(ojson::value_t::object); }
  bool start_array(std::size_t) override { return open(ojson::value_t::array); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    Open& o = open_.back();
    Members& members = *o.value->get_ptr<ojson::object_t*>();
    const auto found = o.index.find(k);
    if (found != o.index.end()) {
      // A repeated key: its first place, the value that comes now (the old one is replaced).
      slot_ = &members[found->second].second;
      return true;
    }
    if (members.size() >= limits_.max_members) {
      return refuse(JsonBodyError::Kind::TooManyMembers,
                    "an object has more than " + std::to_string(limits_.max_members) + " members");
    }
    o.index.emplace(k, members.size());
    members.emplace_back(std::move(k), nullptr);
    slot_ = &members.back().second;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // 406: a number beyond a double's range (1e309); everything else is the text's syntax.
    return refuse(e.id == 406 ? JsonBodyError::Kind::NumberOutOfRange : JsonBodyError::Kind::Syntax, e.what());
  }

 private:
  struct Open {
    ojson* value;
    std::unordered_map<std::string, size_t> index;  // objects only: key -> its place among the members
  };

  // Where the next value goes: the root, the end of the innermost array, or the slot of the last key.
  ojson* next_slot() {
    if (open_.empty()) return &root_;
    ojson* parent = open_.back().value;
    if (parent->is_array()) {
      parent->get_ptr<ojson::array_t*>()->emplace_back();
      return &parent->get_ptr<ojson::array_t*>()->back();
    }
    return slot_;
  }
  template <class V>
  bool place(V&& v) {
    *next_slot() = ojson(std::forward<V>(v));
    return true;
  }
  bool open(ojson::value_t type) {
    if (open_.size() >= limits_.max_depth) {
      return refuse(JsonBodyError::Kind::TooDeep, "the JSON body nests deeper than " +
                                                      std::to_string(limits_.max_depth) + " levels");
    }
    ojson* v = next_slot();
    *v = ojson(type);
    // The containers below stay where they are until closed: only the innermost one grows.
    open_.push_back({v, {}});
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  bool refuse(JsonBodyError::Kind kind, std::string detail) {
    error_.kind = kind;
    error_.detail = std::move(detail);
    return false;
  }

  ojson& root_;
  const JsonLimits& limits_;
  JsonBodyError& error_;
  std::vector<Open> open_;
  ojson* slot_ = nullptr;
};

}  // namespace

bool parse_json_limited(std::string_view text, const JsonLimits& limits, ojson& out, JsonBodyError& error) {
  out = ojson();
  OrderedBuilder builder(out, limits, error);
  bool ok = false;
  try {
    ok = ojson::sax_parse(text, &builder, ojson::input_format_t::json, /*strict=*/true);
  } catch (const nlohmann::json::exception& e) {  // the SAX parser reports through parse_error; kept as a net
    error = {JsonBodyError::Kind::Syntax, e.what()};
    ok = false;
  }
  if (!ok) out = ojson();
  return ok;
}

}  // namespace dsv41::server

// Reading the golden sets of tests/golden (their README says what each file holds) and comparing
// logits rows with them.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"

namespace dsv41::test {

using nlohmann::json;

template <typename T>
std::vector<T> read_array(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<T> v(static_cast<size_t>(in.tellg()) / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

struct Golden {
  std::string dir;
  json meta;
  std::vector<int32_t> ids;
  explicit Golden(const std::string& name) : dir(test::golden_dir(name)) {
    std::ifstream in(dir + "/golden.json");
    meta = json::parse(in);
    ids = meta["input_ids"].get<std::vector<int32_t>>();
  }
  std::vector<float> f32(const std::string& file) const { return read_array<float>(dir + "/" + file); }
};

// How far our logits rows are from the reference's.
struct Agreement {
  double rel_l2 = 0, median_max_abs = 0, worst_max_abs = 0, argmax = 0;
  int64_t rows = 0, identical_rows = 0;  // rows whose every value equals the reference's
};

inline Agreement compare_rows(const std::vector<float>& ours, const std::vector<float>& ref, int64_t vocab) {
  const int64_t rows = static_cast<int64_t>(ref.size()) / vocab;
  double num = 0, den = 0;
  int same = 0;
  int64_t identical = 0;
  std::vector<double> max_abs;
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0;
    for (int64_t j = 0; j < vocab; ++j) {
      double d = ours[r * vocab + j] - ref[r * vocab + j];
      num += d * d;
      den += static_cast<double>(ref[r * vocab + j]) * ref[r * vocab + j];
      m = std::max(m, std::fabs(d));
    }
    max_abs.push_back(m);
    identical += m == 0;
    auto a = std::max_element(&ours[r * vocab], &ours[r * vocab] + vocab) - &ours[r * vocab];
    auto b = std::max_element(&ref[r * vocab], &ref[r * vocab] + vocab) - &ref[r * vocab];
    same += a == b;
  }
  Agreement g;
  g.rel_l2 = std::sqrt(num / den);
  std::sort(max_abs.begin(), max_abs.end());
  g.median_max_abs = max_abs[max_abs.size() / 2];
  g.worst_max_abs = max_abs.back();
  g.argmax = static_cast<double>(same) / static_cast<double>(rows);
  g.rows = rows;
  g.identical_rows = identical;
  return g;
}

}  // namespace dsv41::test

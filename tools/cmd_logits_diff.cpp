#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.h"
#include "commands.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

struct Dump {
  int64_t vocab = 0, rows = 0;
  std::vector<float> data;
};

// Reads a --dump-logits file, checking its header against its size.
Dump read_dump(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot be opened");
  std::string header;
  std::getline(in, header);
  Dump d;
  long long v = 0, r = 0;
  if (std::sscanf(header.c_str(), "dsv41-logits v1 vocab=%lld rows=%lld", &v, &r) != 2 || v <= 0 || r < 0) {
    fail(path, "is not a dsv41 logits dump (header \"" + header.substr(0, 60) + "\")");
  }
  d.vocab = v;
  d.rows = r;
  d.data.resize(static_cast<size_t>(v * r));
  in.read(reinterpret_cast<char*>(d.data.data()), static_cast<std::streamsize>(d.data.size() * sizeof(float)));
  if (in.gcount() != static_cast<std::streamsize>(d.data.size() * sizeof(float)) || in.peek() != EOF) {
    fail(path, "holds a different number of bytes than its header says");
  }
  return d;
}

}  // namespace

int run_logits_diff(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::puts(
        "usage: dsv41 logits-diff A B [--json]\n\n"
        "Compares two --dump-logits files row by row: max |A-B|, mean KL(softmax A || softmax B) in nats,\n"
        "top-1 agreement, relative L2 of all rows.");
    return 0;
  }
  Args args("logits-diff", argc, argv, {}, {"--json"});
  if (args.positional().size() != 2) fail("logits-diff", "expects two dump files");
  Dump a = read_dump(args.positional()[0]), b = read_dump(args.positional()[1]);
  if (a.vocab != b.vocab || a.rows != b.rows) fail("logits-diff", "the two dumps have different shapes");
  double max_abs = 0, kl_sum = 0, num = 0, den = 0;
  int64_t top1 = 0;
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* x = &a.data[r * a.vocab];
    const float* y = &b.data[r * a.vocab];
    double mx = x[0], my = y[0];
    int64_t ax = 0, ay = 0;
    for (int64_t j = 0; j < a.vocab; ++j) {
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(x[j]) - y[j]));
      num += (static_cast<double>(x[j]) - y[j]) * (static_cast<double>(x[j]) - y[j]);
      den += static_cast<double>(x[j]) * x[j];
      if (x[j] > mx) mx = x[ax = j];
      if (y[j] > my) my = y[ay = j];
    }
    top1 += ax == ay;
    double zx = 0, zy = 0;
    for (int64_t j = 0; j < a.vocab; ++j) {
      zx += std::exp(x[j] - mx);
      zy += std::exp(y[j] - my);
    }
    double kl = 0;
    for (int64_t j = 0; j < a.vocab; ++j) {
      const double lp = x[j] - mx - std::log(zx), lq = y[j] - my - std::log(zy);
      kl += std::exp(lp) * (lp - lq);
    }
    kl_sum += kl;
  }
  const double rows = static_cast<double>(std::max<int64_t>(a.rows, 1));
  nlohmann::json j = {{"rows", a.rows},
                      {"max_abs_diff", max_abs},
                      {"mean_kl", kl_sum / rows},
                      {"top1_agreement", static_cast<double>(top1) / rows},
                      {"rel_l2", den > 0 ? std::sqrt(num / den) : 0.0}};
  if (args.has("--json")) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("rows %lld  max |diff| %.4g  mean KL %.4g nats  top-1 agreement %.1f%%  rel L2 %.4g\n",
                static_cast<long long>(a.rows), max_abs, kl_sum / rows, 100.0 * static_cast<double>(top1) / rows,
                j["rel_l2"].get<double>());
  }
  return 0;
}

}  // namespace dsv41::cli

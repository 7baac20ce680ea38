// The prompt-cache entry format: round trips, and every way a file on disk can be wrong is refused
// with a reason instead of being trusted.
#include "state/disk_cache.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "io/cache_namespace.h"
#include "io/safetensors_writer.h"
#include "state/cache_folder.h"
#include "util/error.h"

namespace dsv41 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Bytes = std::vector<uint8_t>;

const std::string kFp = "dsv41-test-model";

// A fresh folder per test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (fs::temp_directory_path() / "dsv41-disk-cache-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const Bytes& bytes, size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(n));
}
void write_bytes(const std::string& path, const Bytes& bytes) { write_bytes(path, bytes, bytes.size()); }

Bytes filled(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 31 * i);
  return b;
}

CacheEntry small_entry() {
  CacheEntry e;
  e.model_fingerprint = kFp;
  e.mode = "exact";
  e.tokens = {7, 0, 42};
  e.sections = {{"main_kv", 2, 1, filled(6, 1)}, {"engram_recent", -1, 0, {}}, {"window", 0, 3, filled(5, 9)}};
  e.last_logits = {0.5f, -1.25f};
  return e;
}

CacheEntry big_entry() {
  std::mt19937 rng(5);
  CacheEntry e;
  e.model_fingerprint = kFp;
  e.mode = "replay";
  for (int i = 0; i < 3000; ++i) e.tokens.push_back(static_cast<int32_t>(rng() % 129280));
  for (int layer = 0; layer < 12; ++layer) {
    e.sections.push_back({layer % 3 ? "window" : "main_kv", layer, 1500, filled(1000 + 97 * layer, uint8_t(layer))});
  }
  for (int i = 0; i < 5000; ++i) e.last_logits.push_back(static_cast<float>(i) * 0.25f - 7.0f);
  return e;
}

void expect_same(const CacheEntry& a, const CacheEntry& b) {
  EXPECT_EQ(a.model_fingerprint, b.model_fingerprint);
  EXPECT_EQ(a.mode, b.mode);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.last_logits, b.last_logits);
  ASSERT_EQ(a.sections.size(), b.sections.size());
  for (size_t i = 0; i < a.sections.size(); ++i) {
    EXPECT_EQ(a.sections[i].name, b.sections[i].name);
    EXPECT_EQ(a.sections[i].layer, b.sections[i].layer);
    EXPECT_EQ(a.sections[i].rows, b.sections[i].rows);
    EXPECT_EQ(a.sections[i].bytes, b.sections[i].bytes);
  }
}

// Reads `path` expecting a refusal; returns the reason, which must name the file and be one line.
std::string refusal(const std::string& path, const std::string& fingerprint = kFp) {
  std::string why;
  const auto entry = read_cache_entry(path, fingerprint, &why);
  EXPECT_FALSE(entry.has_value()) << path;
  EXPECT_EQ(why.rfind(path + ": ", 0), 0u) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  return why;
}

// Byte offsets where the regions of a written file end.
struct Regions {
  size_t header_end, tokens_end, body_end, logits_end, size;
};
Regions regions_of(const Bytes& f) {
  uint32_t header_bytes;
  std::memcpy(&header_bytes, f.data() + 12, 4);
  const json h = json::parse(f.begin() + 16, f.begin() + 16 + header_bytes);
  Regions r{};
  r.header_end = 16 + header_bytes;
  r.tokens_end = r.header_end + 4 * h["tokens"].get<size_t>();
  r.body_end = r.tokens_end + h["body_bytes"].get<size_t>();
  r.logits_end = r.body_end + 4 * h["logits"].get<size_t>();
  r.size = f.size();
  EXPECT_EQ(r.logits_end + 8, r.size);
  return r;
}

// Writes a file by hand around an arbitrary header text, with a correct checksum, so that only the
// reader's own consistency checks can catch what is wrong with it.
void craft(const std::string& path, const std::string& header, const Bytes& payload, uint32_t version = 1) {
  Bytes f = {'D', 'S', 'V', '4', '1', 'K', 'V', 'C'};
  const uint32_t lengths[2] = {version, static_cast<uint32_t>(header.size())};
  f.insert(f.end(), reinterpret_cast<const uint8_t*>(lengths), reinterpret_cast<const uint8_t*>(lengths) + 8);
  f.insert(f.end(), header.begin(), header.end());
  f.insert(f.end(), payload.begin(), payload.end());
  const uint64_t sum = XXH3_64bits(f.data(), f.size());
  f.insert(f.end(), reinterpret_cast<const uint8_t*>(&sum), reinterpret_cast<const uint8_t*>(&sum) + 8);
  write_bytes(path, f);
}

// A consistent header: 2 tokens, two sections of 4 and 6 bytes, 1 logit → 22 payload bytes.
json good_header() {
  return {{"fingerprint", kFp}, {"mode", "exact"}, {"tokens", 2}, {"logits", 1}, {"body_bytes", 10},
          {"sections", {{{"name", "main_kv"}, {"layer", 2}, {"rows", 1}, {"offset", 0}, {"size", 4}},
                        {{"name", "window"}, {"layer", 0}, {"rows", 2}, {"offset", 4}, {"size", 6}}}}};
}
const Bytes kGoodPayload(22, 0);

TEST(DiskCache, RoundTripKeepsEverything) {
  ScratchDir dir;
  const std::string path = dir / "a.dsv41kv";
  const uint64_t written = write_cache_entry(path, small_entry());
  EXPECT_EQ(written, fs::file_size(path));
  std::string why = "stale";
  const auto back = read_cache_entry(path, kFp, &why);
  ASSERT_TRUE(back.has_value()) << why;
  EXPECT_TRUE(why.empty());
  expect_same(*back, small_entry());

  const CacheEntry big = big_entry();
  write_cache_entry(path, big);  // replaces the previous entry
  const auto big_back = read_cache_entry(path, kFp, nullptr);
  ASSERT_TRUE(big_back.has_value());
  expect_same(*big_back, big);
}

// A salted namespace's entry (io/cache_namespace.h) is version 2 and comes back with its namespace;
// the shared namespace's stays version 1, which builds before namespaces read too.
TEST(DiskCache, RoundTripKeepsTheNamespaceAndItsVersion) {
  ScratchDir dir;
  CacheEntry salted = small_entry();
  salted.cache_namespace = cache_namespace_of_salt("tenant-a");
  write_cache_entry(dir / "s.dsv41kv", salted);
  write_cache_entry(dir / "u.dsv41kv", small_entry());
  EXPECT_EQ(read_bytes(dir / "s.dsv41kv")[8], 2);
  EXPECT_EQ(read_bytes(dir / "u.dsv41kv")[8], 1);
  std::string why;
  const auto back = read_cache_entry(dir / "s.dsv41kv", kFp, &why);
  ASSERT_TRUE(back.has_value()) << why;
  EXPECT_EQ(back->cache_namespace, salted.cache_namespace);
  expect_same(*back, salted);
  EXPECT_EQ(read_cache_entry(dir / "u.dsv41kv", kFp, &why)->cache_namespace, "");
  std::vector<std::string> warnings;
  std::set<std::string> found;
  for (const CacheIndexItem& item : scan_cache_dir(dir.path(), kFp, &warnings)) found.insert(item.cache_namespace);
  EXPECT_EQ(found, (std::set<std::string>{"", salted.cache_namespace}));
  EXPECT_TRUE(warnings.empty());

  CacheEntry bad = small_entry();
  bad.cache_namespace = "tenant-a";  // a salt, not its digest
  EXPECT_THROW(write_cache_entry(dir / "b.dsv41kv", bad), Error);

  // A hand-made header whose version and namespace disagree is refused.
  const std::string path = dir / "c.dsv41kv";
  json h = good_header();
  h["namespace"] = salted.cache_namespace;
  craft(path, h.dump(), kGoodPayload, 1);
  EXPECT_NE(refusal(path).find("version 1 header names a namespace"), std::string::npos);
  craft(path, good_header().dump(), kGoodPayload, 2);
  EXPECT_NE(refusal(path).find("no string 'namespace'"), std::string::npos) << refusal(path);
  h["namespace"] = "ABC";
  craft(path, h.dump(), kGoodPayload, 2);
  EXPECT_NE(refusal(path).find("namespace 'ABC' is not 32 lowercase hex digits"), std::string::npos);
  h["namespace"] = salted.cache_namespace;
  craft(path, h.dump(), kGoodPayload, 2);
  ASSERT_TRUE(read_cache_entry(path, kFp, &why).has_value()) << why;
}

TEST(DiskCache, RoundTripEmptyPieces) {
  ScratchDir dir;
  CacheEntry e;
  e.model_fingerprint = "";
  e.mode = "replay";
  for (const bool with_empty_section : {false, true}) {
    if (with_empty_section) e.sections.push_back({"compressor_tail", 8, 0, {}});
    write_cache_entry(dir / "e.dsv41kv", e);
    std::string why;
    const auto back = read_cache_entry(dir / "e.dsv41kv", "", &why);
    ASSERT_TRUE(back.has_value()) << why;
    expect_same(*back, e);
  }
}

TEST(DiskCache, WritingLeavesNoTempFiles) {
  ScratchDir dir;
  write_cache_entry(dir / "a.dsv41kv", small_entry());
  write_cache_entry(dir / "a.dsv41kv", big_entry());
  write_cache_entry(dir / "b.dsv41kv", small_entry());
  std::set<std::string> names;
  for (const auto& item : fs::directory_iterator(dir.path())) names.insert(item.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"a.dsv41kv", "b.dsv41kv"}));
  // A write that cannot happen throws and leaves nothing behind either.
  EXPECT_THROW(write_cache_entry(dir / "missing/c.dsv41kv", small_entry()), Error);
  EXPECT_FALSE(fs::exists(dir / "missing"));
}

TEST(DiskCache, WriterRefusesEntriesTheReaderWouldRefuse) {
  ScratchDir dir;
  CacheEntry bad_mode = small_entry();
  bad_mode.mode = "fuzzy";
  CacheEntry unnamed = small_entry();
  unnamed.sections[1].name.clear();
  CacheEntry negative_token = small_entry();
  negative_token.tokens[1] = -3;
  CacheEntry bad_layer = small_entry();
  bad_layer.sections[0].layer = -2;
  CacheEntry bad_utf8 = small_entry();
  bad_utf8.model_fingerprint = "\xff\xfe";
  for (const CacheEntry* e : {&bad_mode, &unnamed, &negative_token, &bad_layer, &bad_utf8}) {
    EXPECT_THROW(write_cache_entry(dir / "x.dsv41kv", *e), Error);
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(DiskCacheCorruption, MissingFile) {
  ScratchDir dir;
  EXPECT_NE(refusal(dir / "nothing.dsv41kv").find("no such file"), std::string::npos);
  EXPECT_NE(refusal(dir.path()).find("not a regular file"), std::string::npos);
  // a FIFO carrying the extension is refused at once, not waited on for a writer
  ASSERT_EQ(::mkfifo((dir / "fifo.dsv41kv").c_str(), 0600), 0);
  EXPECT_NE(refusal(dir / "fifo.dsv41kv").find("not a regular file"), std::string::npos);
}

TEST(DiskCacheCorruption, EveryTruncationOfASmallEntry) {
  ScratchDir dir;
  write_cache_entry(dir / "full", small_entry());
  const Bytes f = read_bytes(dir / "full");
  const std::string path = dir / "cut.dsv41kv";
  for (size_t n = 0; n < f.size(); ++n) {
    write_bytes(path, f, n);
    EXPECT_NE(refusal(path).find("truncated"), std::string::npos) << "cut at " << n;
    std::vector<std::string> warnings;
    EXPECT_TRUE(scan_cache_dir(dir.path(), kFp, &warnings).empty()) << "cut at " << n;
    EXPECT_EQ(warnings.size(), 1u);
  }
}

TEST(DiskCacheCorruption, TruncationAtBoundariesAndRandomPointsOfABigEntry) {
  ScratchDir dir;
  write_cache_entry(dir / "full", big_entry());
  const Bytes f = read_bytes(dir / "full");
  const Regions r = regions_of(f);
  std::vector<size_t> cuts = {0, 1, 7, 8, 12, 15, 16, 17};
  for (const size_t b : {r.header_end, r.tokens_end, r.body_end, r.logits_end}) cuts.insert(cuts.end(), {b - 1, b, b + 1});
  cuts.push_back(r.size - 1);
  std::mt19937 rng(11);
  for (int i = 0; i < 40; ++i) cuts.push_back(rng() % f.size());
  const std::string path = dir / "cut.dsv41kv";
  for (const size_t n : cuts) {
    ASSERT_LT(n, f.size());
    write_bytes(path, f, n);
    EXPECT_NE(refusal(path).find("truncated"), std::string::npos) << "cut at " << n;
  }
}

TEST(DiskCacheCorruption, EveryFlippedBitPatternOfASmallEntryIsRefused) {
  ScratchDir dir;
  write_cache_entry(dir / "full", small_entry());
  const Bytes f = read_bytes(dir / "full");
  const std::string path = dir / "flip.dsv41kv";
  for (size_t i = 0; i < f.size(); ++i) {
    for (const uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xff}}) {
      Bytes g = f;
      g[i] ^= mask;
      write_bytes(path, g);
      EXPECT_FALSE(refusal(path).empty()) << "byte " << i << " mask " << int(mask);
    }
  }
}

TEST(DiskCacheCorruption, FlipsInEachRegionNameTheProblem) {
  ScratchDir dir;
  write_cache_entry(dir / "full", big_entry());
  const Bytes f = read_bytes(dir / "full");
  const Regions r = regions_of(f);
  const std::string path = dir / "flip.dsv41kv";
  const auto flipped = [&](size_t at, uint8_t mask) {
    Bytes g = f;
    g[at] ^= mask;
    write_bytes(path, g);
    return refusal(path);
  };
  // Low bits of token ids, section bytes, logits and the checksum itself: only the checksum sees them.
  for (const size_t at : {r.header_end, r.tokens_end - 4, r.tokens_end, r.body_end - 1, r.body_end, r.logits_end - 2,
                          r.logits_end, r.size - 1}) {
    EXPECT_NE(flipped(at, 0x01).find("checksum mismatch"), std::string::npos) << "byte " << at;
  }
  // The sign bit of a token id is caught before the checksum.
  EXPECT_NE(flipped(r.header_end + 3, 0x80).find("negative"), std::string::npos);
  // Header bytes: the opening brace, a digit of a count, a letter of the fingerprint.
  const std::string header(f.begin() + 16, f.begin() + static_cast<long>(r.header_end));
  EXPECT_NE(flipped(16, 0x01).find("not valid JSON"), std::string::npos);
  const size_t tokens_digit = 16 + header.find("\"tokens\":") + 9;
  EXPECT_NE(flipped(tokens_digit, 0x04).find("header describes"), std::string::npos);  // 3000 → 7000
  EXPECT_NE(flipped(tokens_digit, 0x01).find("trailing bytes"), std::string::npos);    // 3000 → 2000
  const size_t fp_letter = 16 + header.find(kFp);
  EXPECT_NE(flipped(fp_letter, 0x01).find("different model"), std::string::npos);
}

TEST(DiskCacheCorruption, WrongMagicAndWrongVersion) {
  ScratchDir dir;
  write_cache_entry(dir / "full", small_entry());
  const Bytes f = read_bytes(dir / "full");
  const std::string path = dir / "x.dsv41kv";
  Bytes g = f;
  g[3] = 'X';
  write_bytes(path, g);
  EXPECT_NE(refusal(path).find("bad magic"), std::string::npos);
  for (const uint8_t version : {uint8_t{0}, uint8_t{3}, uint8_t{0xff}}) {
    g = f;
    g[8] = version;  // nothing else fixed up: the version check must come first
    write_bytes(path, g);
    EXPECT_NE(refusal(path).find("format version " + std::to_string(version)), std::string::npos);
  }
  craft(path, good_header().dump(), kGoodPayload, 7);  // a correct checksum does not help
  EXPECT_NE(refusal(path).find("format version 7"), std::string::npos);
}

TEST(DiskCacheCorruption, EntryOfAnotherModel) {
  ScratchDir dir;
  write_cache_entry(dir / "a.dsv41kv", small_entry());
  const std::string why = refusal(dir / "a.dsv41kv", "some-other-model");
  EXPECT_NE(why.find("different model"), std::string::npos) << why;
  EXPECT_NE(why.find(kFp), std::string::npos) << why;
}

TEST(DiskCacheCorruption, InconsistentHeadersWithValidChecksums) {
  ScratchDir dir;
  const std::string path = dir / "c.dsv41kv";
  craft(path, good_header().dump(), kGoodPayload);  // the control: the hand-made file itself is fine
  std::string why;
  const auto control = read_cache_entry(path, kFp, &why);
  ASSERT_TRUE(control.has_value()) << why;
  EXPECT_EQ(control->sections[1].bytes.size(), 6u);

  struct Case {
    const char* expect;
    std::function<void(json&)> edit;
    Bytes payload = kGoodPayload;
  };
  const std::vector<Case> cases = {
      {"outside the body", [](json& h) { h["sections"][1]["offset"] = 400; }},
      {"overlaps", [](json& h) { h["sections"][1]["offset"] = 2; }},
      {"gap", [](json& h) { h["sections"][0]["size"] = 3; }},
      {"'size' = -4", [](json& h) { h["sections"][0]["size"] = -4; }},
      {"'offset' = 18446744073709551615", [](json& h) { h["sections"][1]["offset"] = UINT64_MAX; }},
      {"cover 10 of 12", [](json& h) { h["body_bytes"] = 12; }, Bytes(24, 0)},
      {"'tokens' = 1099511627776", [](json& h) { h["tokens"] = int64_t{1} << 40; }},
      {"'logits' = -1", [](json& h) { h["logits"] = -1; }},
      {"header describes", [](json& h) { h["tokens"] = 1250000; }},
      {"trailing bytes", [](json&) {}, Bytes(30, 0)},
      {"mode 'bogus'", [](json& h) { h["mode"] = "bogus"; }},
      {"no string 'fingerprint'", [](json& h) { h.erase("fingerprint"); }},
      {"no string 'fingerprint'", [](json& h) { h["fingerprint"] = 17; }},
      {"no integer 'layer'", [](json& h) { h["sections"][0]["layer"] = "2"; }},
      {"no integer 'size'", [](json& h) { h["sections"][0]["size"] = 4.0; }},
      {"'layer' = -2", [](json& h) { h["sections"][0]["layer"] = -2; }},
      {"empty name", [](json& h) { h["sections"][0]["name"] = ""; }},
      {"no 'sections' array", [](json& h) { h["sections"] = json::object(); }},
      {"section 1 is not a JSON object", [](json& h) { h["sections"][1] = 5; }},
      {"not a JSON object", [](json& h) { h = json::array({h}); }},
      {"negative", [](json&) {}, [] { Bytes p(22, 0); p[3] = 0x80; return p; }()},
  };
  for (const Case& c : cases) {
    json h = good_header();
    c.edit(h);
    craft(path, h.dump(), c.payload);
    EXPECT_NE(refusal(path).find(c.expect), std::string::npos) << c.expect << "\n" << refusal(path);
  }
  for (const auto& [text, expect] : std::vector<std::pair<std::string, std::string>>{
           {"{\"fingerprint\": ", "not valid JSON"},
           {"", "not valid JSON"},
           {std::string(100000, '['), "nests deeper"},
           {"{\"pad\": \"[[[[[[[[[[[[\\\"\", \"x\": 1}", "no string 'fingerprint'"}}) {  // brackets in strings don't count
    craft(path, text, kGoodPayload);
    EXPECT_NE(refusal(path).find(expect), std::string::npos) << expect << "\n" << refusal(path);
  }
  // A header length field beyond the cap is refused before anything is allocated or read.
  craft(path, good_header().dump(), kGoodPayload);
  Bytes f = read_bytes(path);
  const uint32_t huge = 0xfffffff0u;
  std::memcpy(f.data() + 12, &huge, 4);
  write_bytes(path, f);
  EXPECT_NE(refusal(path).find("exceeds the 16 MiB cap"), std::string::npos);
}

TEST(DiskCacheScan, FindsGoodEntriesAndSkipsBadOnesWithWarnings) {
  ScratchDir dir;
  const CacheEntry small = small_entry(), big = big_entry();
  const std::string small_name = cache_file_name(kFp, small.mode, small.tokens);
  const std::string big_name = cache_file_name(kFp, big.mode, big.tokens);
  write_cache_entry(dir / small_name, small);
  write_cache_entry(dir / big_name, big);
  const Bytes f = read_bytes(dir / big_name);
  write_bytes(dir / "cut.dsv41kv", f, f.size() / 2);
  write_bytes(dir / "junk.dsv41kv", Bytes(100, 'x'));
  CacheEntry other = small;
  other.model_fingerprint = "another-model";
  write_cache_entry(dir / "other.dsv41kv", other);
  fs::create_directory(dir / "folder.dsv41kv");
  write_bytes(dir / "notes.txt", Bytes(10, 'n'));             // not an entry: ignored silently
  write_bytes(dir / ".a.dsv41kv.tmp.1.0", Bytes(10, 't'));    // an unfinished write: ignored silently

  // the modification times come along, for an order of use across processes
  fs::last_write_time(dir / small_name, fs::last_write_time(dir / big_name) - std::chrono::minutes(5));

  std::vector<std::string> warnings;
  const auto items = scan_cache_dir(dir.path(), kFp, &warnings);
  ASSERT_EQ(items.size(), 2u);
  const bool small_first = small_name < big_name;
  const CacheIndexItem& s = items[small_first ? 0 : 1];
  const CacheIndexItem& b = items[small_first ? 1 : 0];
  EXPECT_EQ(s.path, dir / small_name);
  EXPECT_EQ(s.tokens, small.tokens);
  EXPECT_EQ(s.mode, "exact");
  EXPECT_EQ(s.file_bytes, fs::file_size(dir / small_name));
  EXPECT_EQ(b.tokens, big.tokens);
  EXPECT_EQ(b.mode, "replay");
  EXPECT_EQ(b.file_bytes, f.size());
  EXPECT_EQ(b.modified_ns - s.modified_ns, int64_t{300} * 1000000000);

  ASSERT_EQ(warnings.size(), 4u);
  std::string all;
  for (const std::string& w : warnings) all += w + "\n";
  for (const char* name : {"cut.dsv41kv", "junk.dsv41kv", "other.dsv41kv", "folder.dsv41kv"}) {
    EXPECT_NE(all.find(dir / name), std::string::npos) << all;
  }

  // Scanning does not verify the checksum (the full read does): a flipped body byte is found by
  // the scan and then refused by read_cache_entry.
  Bytes g = f;
  g[regions_of(f).body_end - 1] ^= 1;
  write_bytes(dir / big_name, g);
  warnings.clear();
  EXPECT_EQ(scan_cache_dir(dir.path(), kFp, &warnings).size(), 2u);
  EXPECT_NE(refusal(dir / big_name).find("checksum mismatch"), std::string::npos);

  warnings.clear();
  EXPECT_TRUE(scan_cache_dir(dir / "absent", kFp, &warnings).empty());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("absent"), std::string::npos);
}

// A crash between a write's temporary file and its rename leaves ".NAME.dsv41kv.tmp.XXXXXX" behind:
// such files are removed once they are old enough to belong to no live writer, and nothing else is.
TEST(DiskCacheTemporaries, OnlyStaleOnesAreRemoved) {
  ScratchDir dir;
  const std::string stale = ".0123456789abcdef.dsv41kv.tmp.Ab12Cd";
  const std::string fresh = ".fedcba9876543210.dsv41kv.tmp.Xy34Zw";  // a write under way, maybe in another process
  const std::vector<std::string> others = {"0123456789abcdef.dsv41kv", ".hidden", "a.dsv41kv.tmp.123456",
                                           ".dsv41kv.tmp.Ab12Cd", ".a.dsv41kv.tmp.", "notes.txt"};
  const auto hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const std::string& name : others) write_bytes(dir / name, Bytes(8, 'o'));
  write_bytes(dir / stale, Bytes(8, 's'));
  write_bytes(dir / fresh, Bytes(8, 'f'));
  fs::create_directory(dir / ".folder.dsv41kv.tmp.Qw12Er");
  for (const std::string& name : others) fs::last_write_time(dir / name, hour_ago);
  fs::last_write_time(dir / stale, hour_ago);
  fs::last_write_time(dir / ".folder.dsv41kv.tmp.Qw12Er", hour_ago);

  EXPECT_TRUE(is_cache_temporary_name(stale));
  EXPECT_TRUE(is_cache_temporary_name(fresh));
  for (const std::string& name : others) EXPECT_FALSE(is_cache_temporary_name(name)) << name;
  std::vector<std::string> warnings;
  EXPECT_EQ(remove_stale_cache_temporaries(dir.path(), std::chrono::seconds(60), &warnings),
            std::vector<std::string>{dir / stale});
  EXPECT_TRUE(warnings.empty());
  std::set<std::string> names;
  for (const auto& item : fs::directory_iterator(dir.path())) names.insert(item.path().filename().string());
  std::set<std::string> expected(others.begin(), others.end());
  expected.insert(fresh);
  expected.insert(".folder.dsv41kv.tmp.Qw12Er");
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(remove_stale_cache_temporaries(dir / "absent", std::chrono::seconds(60), &warnings).empty());
}

TEST(DiskCacheName, StableAndDistinct) {
  const std::vector<int32_t> tokens = {1, 2, 3};
  const std::string name = cache_file_name(kFp, "exact", tokens);
  EXPECT_TRUE(std::regex_match(name, std::regex("[0-9a-f]{16}\\.dsv41kv"))) << name;
  EXPECT_EQ(name, cache_file_name(kFp, "exact", {1, 2, 3}));
  // Pinned: names must stay the same across builds, or every existing cache folder goes cold.
  EXPECT_EQ(cache_file_name("fp", "exact", {1, 2, 3}), "d78fabf07b392c01.dsv41kv");
  std::set<std::string> names = {name,
                                 cache_file_name(kFp, "replay", tokens),
                                 cache_file_name(kFp + "x", "exact", tokens),
                                 cache_file_name(kFp, "exact", {1, 2}),
                                 cache_file_name(kFp, "exact", {1, 2, 3, 0}),
                                 cache_file_name(kFp, "exact", {3, 2, 1}),
                                 cache_file_name(kFp, "exact", {}),
                                 cache_file_name("ab", "c", tokens),
                                 cache_file_name("a", "bc", tokens),
                                 cache_file_name(kFp, "exact", tokens, cache_namespace_of_salt("a")),
                                 cache_file_name(kFp, "exact", tokens, cache_namespace_of_salt("b"))};
  EXPECT_EQ(names.size(), 11u);
  EXPECT_EQ(cache_file_name("fp", "exact", {1, 2, 3}, ""), "d78fabf07b392c01.dsv41kv");  // no salt: names as before
}

// ---- the folder on a full disk --------------------------------------------------------------------

// A file system of `capacity` bytes under the prompt-cache folder: a write that would take what the
// folder holds past it fails as a full disk does (ENOSPC) and leaves nothing behind.
CacheFolder::Writer small_disk(const std::string& dir, uint64_t capacity, int* writes) {
  return [dir, capacity, writes](const std::string& path, const std::vector<uint8_t>& bytes) {
    ++*writes;
    uint64_t used = 0;
    for (const auto& e : fs::directory_iterator(dir)) used += e.is_regular_file() && e.path() != path ? e.file_size() : 0;
    if (used + bytes.size() > capacity) throw FileWriteError(path, "cannot write its temporary file", ENOSPC);
    write_file_atomic(path, bytes.data(), bytes.size());
  };
}

CacheEntry entry_for(int32_t first_token) {
  CacheEntry e = small_entry();
  e.tokens[0] = first_token;
  return e;
}

std::string name_for(int32_t first_token) { return cache_file_name(kFp, "exact", entry_for(first_token).tokens); }

// A store that finds the disk full removes the least recently used entries (not the budget's doing:
// the budget is far away) and tries once more; the request that stored it never sees an error.
TEST(CacheFolderDiskFull, EvictsTheLeastRecentlyUsedAndRetriesOnce) {
  ScratchDir dir;
  std::vector<std::string> log;
  int writes = 0;
  const uint64_t one = encode_cache_entry(entry_for(1), "x").size();
  CacheFolder folder(dir.path(), kFp, "exact", uint64_t{1} << 30, [&](const std::string& l) { log.push_back(l); },
                     small_disk(dir.path(), 2 * one + one / 2, &writes));
  EXPECT_EQ(folder.store(entry_for(1)), one);
  EXPECT_EQ(folder.store(entry_for(2)), one);
  ASSERT_TRUE(folder.read(name_for(1)).has_value());  // 1 is now used more recently than 2
  writes = 0;
  EXPECT_EQ(folder.store(entry_for(3)), one);
  EXPECT_EQ(writes, 2);
  EXPECT_EQ(folder.items().count(name_for(1)), 1u);
  EXPECT_EQ(folder.items().count(name_for(2)), 0u);
  EXPECT_EQ(folder.items().count(name_for(3)), 1u);
  EXPECT_FALSE(fs::exists(dir / name_for(2)));
  const CacheFolder::Stats st = folder.stats();
  EXPECT_EQ(st.disk_full, 1u);
  EXPECT_EQ(st.evictions, 1u);
  EXPECT_EQ(st.write_failures, 0u);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find(dir.path() + ": the disk is full"), std::string::npos) << log[0];
  EXPECT_NE(log[0].find("removed 1 least recently used prompt-cache entries"), std::string::npos) << log[0];
}

// When the retry fails too, the entry is given up with one warning and counted; later stores that fit
// work again. Nothing is retried when there is nothing to evict.
TEST(CacheFolderDiskFull, AnEntryThatStillDoesNotFitIsSkippedNeverAnError) {
  ScratchDir dir;
  std::vector<std::string> log;
  int writes = 0;
  const uint64_t one = encode_cache_entry(entry_for(1), "x").size();
  CacheFolder folder(dir.path(), kFp, "exact", uint64_t{1} << 30, [&](const std::string& l) { log.push_back(l); },
                     small_disk(dir.path(), one + one / 2, &writes));
  EXPECT_EQ(folder.store(entry_for(1)), one);
  CacheEntry big = entry_for(9);
  big.sections[0].bytes = filled(2 * one, 3);
  writes = 0;
  EXPECT_EQ(folder.store(big), 0u);
  EXPECT_EQ(writes, 2);  // evicted entry 1, tried again, gave up
  EXPECT_TRUE(folder.items().empty());
  writes = 0;
  EXPECT_EQ(folder.store(big), 0u);
  EXPECT_EQ(writes, 1);  // nothing left to evict: no second try
  const CacheFolder::Stats st = folder.stats();
  EXPECT_EQ(st.disk_full, 2u);
  EXPECT_EQ(st.write_failures, 2u);
  std::string all;
  for (const std::string& l : log) all += l + "\n";
  EXPECT_NE(all.find("No space left on device"), std::string::npos) << all;
  EXPECT_NE(all.find(name_for(9).substr(0, 8)), std::string::npos) << all;  // the entry given up is named
  EXPECT_EQ(folder.store(entry_for(2)), one);
  EXPECT_NE(log.back().find("writes work again"), std::string::npos) << all;
}

}  // namespace
}  // namespace dsv41

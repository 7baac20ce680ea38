// Tests of the paged KV storage (PagePool, PagedRows) and the prefix-cache index (PrefixTree).
// The PagedRows stress test keeps a plain shadow copy of every sequence and checks, after random
// sharing, branching, writing, truncating and destroying, that each sequence reads exactly what it
// wrote and that every page's reference count equals the number of arrays holding it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/allocator.h"
#include "state/page_pool.h"
#include "state/paged_rows.h"
#include "state/prefix_tree.h"
#include "util/error.h"

namespace {

using namespace dsv41;

// Where the pools in these tests take their slabs from.
HostAllocator host_memory;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---------------------------------------------------------------------------------------------
// PagePool

TEST(PagePool, RefcountsAndAccounting) {
  PagePool pool(host_memory, "kv", 128, 0);
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_EQ(pool.pages_reserved(), 0u);  // lazy: nothing before the first allocate
  const int32_t a = pool.allocate();
  const int32_t b = pool.allocate();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.refcount(a), 1);
  EXPECT_EQ(pool.pages_in_use(), 2u);
  EXPECT_EQ(pool.bytes_in_use(), 256u);
  EXPECT_EQ(pool.page_bytes(), 128u);
  pool.retain(a);
  EXPECT_EQ(pool.refcount(a), 2);
  pool.release(a);
  EXPECT_EQ(pool.refcount(a), 1);
  EXPECT_EQ(pool.pages_in_use(), 2u);
  pool.release(a);
  EXPECT_EQ(pool.refcount(a), 0);
  EXPECT_EQ(pool.pages_in_use(), 1u);
  pool.release(b);
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
}

TEST(PagePool, FreeListReuse) {
  PagePool pool(host_memory, "kv", 64, 0);
  std::vector<int32_t> pages;
  for (int i = 0; i < 5; ++i) pages.push_back(pool.allocate());
  const size_t reserved = pool.pages_reserved();
  pool.release(pages[3]);
  pool.release(pages[1]);
  // Most recently freed first, and no new memory reserved for either.
  EXPECT_EQ(pool.allocate(), pages[1]);
  EXPECT_EQ(pool.allocate(), pages[3]);
  EXPECT_EQ(pool.pages_reserved(), reserved);
  EXPECT_EQ(pool.pages_in_use(), 5u);
  for (int32_t p : pages) pool.release(p);
}

TEST(PagePool, PagesAre64ByteAlignedAcrossSlabs) {
  // 100-byte pages: the stride is rounded up so every page, not just each slab, stays aligned.
  PagePool pool(host_memory, "kv", 100, 0);
  std::vector<int32_t> pages;
  for (int i = 0; i < 3000; ++i) {  // more than one slab
    pages.push_back(pool.allocate());
    uint8_t* p = pool.data(pages.back());
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << "page " << pages.back();
    std::memset(p, i & 0xFF, 100);
  }
  for (int i = 0; i < 3000; ++i) ASSERT_EQ(pool.data(pages[i])[99], static_cast<uint8_t>(i & 0xFF));
  for (int32_t p : pages) pool.release(p);
  EXPECT_EQ(pool.pages_in_use(), 0u);
}

TEST(PagePool, OutOfPagesNamesThePool) {
  PagePool pool(host_memory, "index_k.L20", 64, 2);
  EXPECT_TRUE(pool.can_allocate(2));
  EXPECT_FALSE(pool.can_allocate(3));
  const int32_t a = pool.allocate();
  const int32_t b = pool.allocate();
  EXPECT_FALSE(pool.can_allocate(1));
  EXPECT_TRUE(pool.can_allocate(0));
  EXPECT_EQ(error_of([&] { pool.allocate(); }), "index_k.L20: out of pages (2 in use)");
  EXPECT_EQ(pool.pages_in_use(), 2u);
  EXPECT_LE(pool.pages_reserved(), 2u);  // a bounded pool never reserves past its bound
  pool.release(a);
  EXPECT_TRUE(pool.can_allocate(1));
  EXPECT_EQ(pool.allocate(), a);
  pool.release(a);
  pool.release(b);
}

TEST(PagePool, DoubleReleaseThrowsWithoutCorrupting) {
  PagePool pool(host_memory, "kv", 64, 0);
  const int32_t a = pool.allocate();
  const int32_t b = pool.allocate();
  pool.release(a);
  EXPECT_THROW(pool.release(a), Error);
  EXPECT_THROW(pool.retain(a), Error);
  EXPECT_THROW(pool.data(a), Error);
  EXPECT_THROW(pool.make_writable(a), Error);
  EXPECT_THROW(pool.release(-1), Error);
  EXPECT_THROW(pool.release(1 << 20), Error);
  EXPECT_THROW(pool.refcount(1 << 20), Error);
  EXPECT_EQ(pool.pages_in_use(), 1u);
  EXPECT_EQ(pool.refcount(a), 0);
  EXPECT_EQ(pool.refcount(b), 1);
  // The free list holds `a` once: two allocations must give two different pages.
  const int32_t c = pool.allocate();
  const int32_t d = pool.allocate();
  EXPECT_NE(c, d);
  EXPECT_NE(c, b);
  EXPECT_NE(d, b);
  pool.release(d);
  EXPECT_EQ(error_of([&] { pool.release(d); }), "kv: release of free page " + std::to_string(d));
  pool.release(c);
  pool.release(b);
  EXPECT_EQ(pool.pages_in_use(), 0u);
}

TEST(PagePool, MakeWritableCopiesOnlyShared) {
  PagePool pool(host_memory, "kv", 64, 3);
  const int32_t a = pool.allocate();
  std::memset(pool.data(a), 7, 64);
  EXPECT_EQ(pool.make_writable(a), a);  // sole owner: no copy
  pool.retain(a);
  const int32_t copy = pool.make_writable(a);
  EXPECT_NE(copy, a);
  EXPECT_EQ(pool.refcount(a), 1);
  EXPECT_EQ(pool.refcount(copy), 1);
  EXPECT_EQ(std::memcmp(pool.data(a), pool.data(copy), 64), 0);
  pool.data(copy)[0] = 9;
  EXPECT_EQ(pool.data(a)[0], 7);
  // A full pool: the copy fails and the caller still holds its reference to the shared page.
  const int32_t filler = pool.allocate();
  pool.retain(a);
  EXPECT_THROW(pool.make_writable(a), Error);
  EXPECT_EQ(pool.refcount(a), 2);
  pool.release(a);
  pool.release(a);
  pool.release(copy);
  pool.release(filler);
  EXPECT_EQ(pool.pages_in_use(), 0u);
}

TEST(PagePool, RejectsZeroPageBytes) { EXPECT_THROW(PagePool(host_memory, "kv", 0, 0), Error); }

TEST(PagePool, TakesItsSlabsFromItsAllocator) {
  HostAllocator mine;
  {
    PagePool pool(mine, "kv", 64, 0);
    EXPECT_EQ(mine.bytes_in_use(), 0u) << "nothing is reserved before the first page";
    pool.allocate();
    EXPECT_GE(mine.bytes_in_use(), 64u);
    EXPECT_EQ(pool.pages_reserved() * 64, mine.bytes_in_use()) << "one slab of 64-byte pages";
  }
  EXPECT_EQ(mine.bytes_in_use(), 0u) << "the slabs go back when the pool does";
}

// ---------------------------------------------------------------------------------------------
// PagedRows

void fill(uint8_t* row, size_t n, uint8_t v) { std::memset(row, v, n); }
bool all_equal(const uint8_t* row, size_t n, uint8_t v) {
  return std::all_of(row, row + n, [v](uint8_t x) { return x == v; });
}

TEST(PagedRows, AppendAcrossPageBoundaries) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows rows(pool, 24);  // 2 rows per page, 16 bytes of each page unused
  EXPECT_EQ(rows.rows_per_page(), 2u);
  for (int i = 0; i < 5; ++i) {
    uint8_t* r = rows.append();
    EXPECT_TRUE(all_equal(r, 24, 0));
    fill(r, 24, static_cast<uint8_t>(i + 1));
  }
  EXPECT_EQ(rows.size(), 5);
  EXPECT_EQ(rows.pages().size(), 3u);
  EXPECT_EQ(pool.pages_in_use(), 3u);
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(all_equal(rows.row(i), 24, static_cast<uint8_t>(i + 1))) << i;
  // Rows 0 and 1 share page 0; row 2 starts page 1.
  EXPECT_EQ(rows.row(1), rows.row(0) + 24);
  EXPECT_EQ(rows.row(2), pool.data(rows.pages()[1]));
}

TEST(PagedRows, RowAddressesAreTheRowsAPageAtATime) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows rows(pool, 24);
  for (int i = 0; i < 5; ++i) rows.append();
  for (int64_t n = 0; n <= 5; ++n) {
    std::vector<const uint8_t*> at(static_cast<size_t>(n));
    rows.row_addresses(n, at.data());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(at[static_cast<size_t>(i)], rows.row(i)) << n << " " << i;
  }
  const uint8_t* six[6];
  EXPECT_NE(error_of([&] { rows.row_addresses(6, six); }).find("have 5"), std::string::npos);
}

TEST(PagedRows, RowMustFitAPage) {
  PagePool pool(host_memory, "kv", 64, 0);
  EXPECT_NE(error_of([&] { PagedRows r(pool, 65); }).find("does not fit"), std::string::npos);
  EXPECT_THROW(PagedRows(pool, 0), Error);
  PagedRows exact(pool, 64);
  EXPECT_EQ(exact.rows_per_page(), 1u);
}

TEST(PagedRows, RowBoundsErrors) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows rows(pool, 16);
  EXPECT_THROW(rows.row(0), Error);
  rows.append();
  rows.append();
  EXPECT_NO_THROW(rows.row(1));
  EXPECT_EQ(error_of([&] { rows.row(2); }), "kv: row: row 2 out of range [0, 2)");
  EXPECT_THROW(rows.row(-1), Error);
  EXPECT_THROW(rows.mutable_row(2), Error);
  EXPECT_THROW(rows.mutable_row(-1), Error);
  EXPECT_THROW(rows.share(3), Error);
  EXPECT_THROW(rows.truncate(3), Error);
  EXPECT_THROW(rows.truncate(-1), Error);
}

TEST(PagedRows, TruncateReleasesWholePages) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows rows(pool, 16);  // 4 rows per page
  for (int i = 0; i < 10; ++i) fill(rows.append(), 16, static_cast<uint8_t>(i + 1));
  EXPECT_EQ(pool.pages_in_use(), 3u);
  rows.truncate(9);  // still needs 3 pages
  EXPECT_EQ(pool.pages_in_use(), 3u);
  rows.truncate(8);  // exactly 2 full pages
  EXPECT_EQ(pool.pages_in_use(), 2u);
  EXPECT_EQ(rows.pages().size(), 2u);
  rows.truncate(5);
  EXPECT_EQ(pool.pages_in_use(), 2u);
  EXPECT_TRUE(all_equal(rows.row(4), 16, 5));
  // Re-appending over a rolled-back slot hands out a cleared row, not the stale one.
  EXPECT_TRUE(all_equal(rows.append(), 16, 0));
  rows.truncate(0);
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_TRUE(rows.pages().empty());
  EXPECT_TRUE(all_equal(rows.append(), 16, 0));
  EXPECT_EQ(pool.pages_in_use(), 1u);
}

TEST(PagedRows, DestructorAndMoveRelease) {
  PagePool pool(host_memory, "kv", 64, 0);
  {
    PagedRows a(pool, 16);
    for (int i = 0; i < 6; ++i) a.append();
    PagedRows b = std::move(a);
    EXPECT_EQ(a.size(), 0);  // a moved-from array is specified as empty
    EXPECT_EQ(b.size(), 6);
    EXPECT_EQ(pool.pages_in_use(), 2u);
    PagedRows c(pool, 16);
    c.append();
    EXPECT_EQ(pool.pages_in_use(), 3u);
    c = std::move(b);  // c's old page goes back
    EXPECT_EQ(pool.pages_in_use(), 2u);
    a.append();  // the moved-from array is still usable
    EXPECT_EQ(pool.pages_in_use(), 3u);
  }
  EXPECT_EQ(pool.pages_in_use(), 0u);
}

TEST(PagedRows, CopyOnWriteBranchesNeverSeeEachOther) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows prefix(pool, 16);  // 4 rows per page; 10 rows = 2 full pages + a half page
  for (int i = 0; i < 10; ++i) fill(prefix.append(), 16, static_cast<uint8_t>(10 + i));
  const std::vector<int32_t> prefix_pages = prefix.pages();

  PagedRows a = prefix.share(10);
  PagedRows b = prefix.share(10);
  EXPECT_EQ(a.pages(), prefix_pages);  // sharing copies nothing
  EXPECT_EQ(pool.pages_in_use(), 3u);
  EXPECT_EQ(pool.refcount(prefix_pages[0]), 3);

  fill(a.append(), 16, 0xA0);
  fill(b.append(), 16, 0xB0);
  fill(b.append(), 16, 0xB1);
  fill(a.mutable_row(8), 16, 0xA8);  // inside the shared partial page
  fill(b.mutable_row(9), 16, 0xB9);

  // The full pages stay shared by all three; the partial page was copied by each writer.
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(a.pages()[p], prefix_pages[p]);
    EXPECT_EQ(b.pages()[p], prefix_pages[p]);
    EXPECT_EQ(pool.refcount(prefix_pages[p]), 3);
  }
  EXPECT_NE(a.pages()[2], prefix_pages[2]);
  EXPECT_NE(b.pages()[2], prefix_pages[2]);
  EXPECT_NE(a.pages()[2], b.pages()[2]);
  EXPECT_EQ(pool.refcount(prefix_pages[2]), 1);
  EXPECT_EQ(pool.pages_in_use(), 5u);

  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(all_equal(a.row(i), 16, static_cast<uint8_t>(10 + i)));
    EXPECT_TRUE(all_equal(b.row(i), 16, static_cast<uint8_t>(10 + i)));
  }
  EXPECT_TRUE(all_equal(prefix.row(8), 16, 18));
  EXPECT_TRUE(all_equal(prefix.row(9), 16, 19));
  EXPECT_TRUE(all_equal(a.row(8), 16, 0xA8));
  EXPECT_TRUE(all_equal(a.row(9), 16, 19));
  EXPECT_TRUE(all_equal(a.row(10), 16, 0xA0));
  EXPECT_TRUE(all_equal(b.row(8), 16, 18));
  EXPECT_TRUE(all_equal(b.row(9), 16, 0xB9));
  EXPECT_TRUE(all_equal(b.row(10), 16, 0xB0));
  EXPECT_TRUE(all_equal(b.row(11), 16, 0xB1));
  EXPECT_EQ(prefix.size(), 10);
  EXPECT_EQ(a.size(), 11);
  EXPECT_EQ(b.size(), 12);

  // A write to a full shared page (not the usual case, but allowed) copies just that page.
  fill(a.mutable_row(1), 16, 0xA1);
  EXPECT_NE(a.pages()[0], prefix_pages[0]);
  EXPECT_EQ(a.pages()[1], prefix_pages[1]);
  EXPECT_TRUE(all_equal(b.row(1), 16, 11));
  EXPECT_TRUE(all_equal(a.row(0), 16, 10));
}

TEST(PagedRows, ShareMidPageKeepsParentRowsPastTheCut) {
  PagePool pool(host_memory, "kv", 64, 0);
  PagedRows parent(pool, 16);
  for (int i = 0; i < 7; ++i) fill(parent.append(), 16, static_cast<uint8_t>(i + 1));
  PagedRows child = parent.share(5);  // page 1 holds rows 4..6 of the parent; the child sees row 4
  EXPECT_EQ(child.pages().size(), 2u);
  EXPECT_EQ(child.pages()[1], parent.pages()[1]);
  EXPECT_THROW(child.row(5), Error);
  EXPECT_TRUE(all_equal(child.append(), 16, 0));  // its own row 5, cleared, on a private copy
  EXPECT_NE(child.pages()[1], parent.pages()[1]);
  EXPECT_TRUE(all_equal(parent.row(5), 16, 6));
  EXPECT_TRUE(all_equal(parent.row(6), 16, 7));
  EXPECT_EQ(parent.share(0).pages().size(), 0u);
}

TEST(PagedRows, FullPoolLeavesTheArrayUnchanged) {
  PagePool pool(host_memory, "kv", 64, 2);
  PagedRows a(pool, 32);  // 2 rows per page
  for (int i = 0; i < 3; ++i) fill(a.append(), 32, static_cast<uint8_t>(i + 1));
  const std::vector<int32_t> pages = a.pages();
  {
    PagedRows b = a.share(3);
    // Appending needs a private copy of the shared half page, and the pool is full.
    EXPECT_NE(error_of([&] { a.append(); }).find("out of pages"), std::string::npos);
    EXPECT_THROW(a.mutable_row(0), Error);
    EXPECT_EQ(a.size(), 3);
    EXPECT_EQ(a.pages(), pages);
    EXPECT_EQ(pool.refcount(pages[1]), 2);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_equal(b.row(i), 32, static_cast<uint8_t>(i + 1)));
  }
  fill(a.append(), 32, 4);  // sole owner again: written in place
  EXPECT_EQ(a.pages(), pages);
  EXPECT_THROW(a.append(), Error);  // a third page is needed
  EXPECT_EQ(a.size(), 4);
  EXPECT_EQ(a.pages().size(), 2u);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_equal(a.row(i), 32, static_cast<uint8_t>(i + 1)));
}

TEST(PagedRows, AdoptTakesCountedReferences) {
  PagePool pool(host_memory, "kv", 64, 0);
  std::vector<int32_t> pages;
  {
    PagedRows rows(pool, 16);
    for (int i = 0; i < 6; ++i) fill(rows.append(), 16, static_cast<uint8_t>(i + 1));
    // A cache keeps its own references, as a prefix-cache entry would.
    for (int32_t p : rows.pages()) pool.retain(p);
    pages = rows.pages();
  }
  EXPECT_EQ(pool.pages_in_use(), 2u);
  EXPECT_THROW(PagedRows::adopt(pool, 16, pages, 9), Error);  // 9 rows need 3 pages
  EXPECT_THROW(PagedRows::adopt(pool, 16, pages, -1), Error);
  EXPECT_EQ(pool.refcount(pages[0]), 1);  // failed adopts took nothing
  {
    PagedRows restored = PagedRows::adopt(pool, 16, pages, 6);
    EXPECT_EQ(restored.size(), 6);
    for (int i = 0; i < 6; ++i) EXPECT_TRUE(all_equal(restored.row(i), 16, static_cast<uint8_t>(i + 1)));
    EXPECT_EQ(pool.refcount(pages[0]), 1);
  }
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_THROW(PagedRows::adopt(pool, 16, pages, 6), Error);  // those pages are free now
}

// Many sequences sharing, branching, writing, rolling back and dying in random order.
TEST(PagedRows, RandomizedSharingStressHasNoLeaksOrCrosstalk) {
  constexpr size_t kRow = 40;  // 6 rows per 256-byte page, 16 bytes of slack
  PagePool pool(host_memory, "stress", 256, 0);
  struct Seq {
    PagedRows rows;
    std::vector<std::vector<uint8_t>> shadow;
  };
  std::vector<Seq> seqs;
  std::mt19937_64 rng(1234);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  auto random_row = [&] {
    std::vector<uint8_t> r(kRow);
    for (uint8_t& x : r) x = static_cast<uint8_t>(rng());
    return r;
  };
  auto check_seq = [&](const Seq& s) {
    ASSERT_EQ(s.rows.size(), static_cast<int64_t>(s.shadow.size()));
    for (size_t i = 0; i < s.shadow.size(); ++i)
      ASSERT_EQ(std::memcmp(s.rows.row(static_cast<int64_t>(i)), s.shadow[i].data(), kRow), 0) << "row " << i;
  };
  auto check_refcounts = [&] {
    std::map<int32_t, int> holders;
    for (const Seq& s : seqs)
      for (int32_t p : s.rows.pages()) ++holders[p];
    ASSERT_EQ(pool.pages_in_use(), holders.size());
    for (const auto& [page, n] : holders) ASSERT_EQ(pool.refcount(page), n) << "page " << page;
  };

  for (int step = 0; step < 20000; ++step) {
    const size_t op = seqs.empty() ? 0 : pick(100);
    if (op < 2) {  // new empty sequence
      seqs.push_back({PagedRows(pool, kRow), {}});
    } else if (op < 10) {  // branch from a random prefix of another sequence
      const Seq& from = seqs[pick(seqs.size())];
      const int64_t n = static_cast<int64_t>(pick(from.shadow.size() + 1));
      Seq s{from.rows.share(n), {from.shadow.begin(), from.shadow.begin() + n}};
      seqs.push_back(std::move(s));
    } else if (op < 67) {  // append a burst of rows (a prefill chunk or a few decode steps)
      Seq& s = seqs[pick(seqs.size())];
      for (size_t k = 1 + pick(8); k > 0 && s.shadow.size() < 400; --k) {
        std::vector<uint8_t> r = random_row();
        uint8_t* dst = s.rows.append();
        ASSERT_TRUE(all_equal(dst, kRow, 0));
        std::memcpy(dst, r.data(), kRow);
        s.shadow.push_back(std::move(r));
      }
    } else if (op < 72) {  // overwrite one row
      Seq& s = seqs[pick(seqs.size())];
      if (s.shadow.empty()) continue;
      const size_t i = pick(s.shadow.size());
      std::vector<uint8_t> r = random_row();
      std::memcpy(s.rows.mutable_row(static_cast<int64_t>(i)), r.data(), kRow);
      s.shadow[i] = std::move(r);
    } else if (op < 82) {  // roll back: usually a few rejected draft rows, sometimes far
      Seq& s = seqs[pick(seqs.size())];
      const size_t drop = pick(10) == 0 ? pick(s.shadow.size() + 1) : std::min(s.shadow.size(), pick(9));
      const size_t n = s.shadow.size() - drop;
      s.rows.truncate(static_cast<int64_t>(n));
      s.shadow.resize(n);
    } else if (op < 85 || seqs.size() > 16) {  // destroy
      const size_t i = pick(seqs.size());
      std::swap(seqs[i], seqs.back());
      seqs.pop_back();
    } else {  // read back
      check_seq(seqs[pick(seqs.size())]);
    }
    if (step % 500 == 0) {
      for (const Seq& s : seqs) check_seq(s);
      check_refcounts();
    }
  }
  for (const Seq& s : seqs) check_seq(s);
  check_refcounts();
  seqs.clear();
  EXPECT_EQ(pool.pages_in_use(), 0u);
  EXPECT_EQ(pool.bytes_in_use(), 0u);
}

// ---------------------------------------------------------------------------------------------
// PrefixTree

std::vector<int32_t> seq(std::initializer_list<int32_t> t) { return t; }

// Entries numbered in creation order, each `bytes_each` bytes unless overridden.
struct Entries {
  PrefixTree::EntryId next = 100;
  std::map<PrefixTree::EntryId, size_t> size;
  size_t bytes_each = 10;
  std::vector<int64_t> made_for_blocks;
  std::function<PrefixTree::EntryId(int64_t)> make() {
    return [this](int64_t block) {
      made_for_blocks.push_back(block);
      size[next] = bytes_each;
      return next++;
    };
  }
  std::function<size_t(PrefixTree::EntryId)> bytes() {
    return [this](PrefixTree::EntryId e) { return size.at(e); };
  }
};

const auto kAll = [](PrefixTree::EntryId) { return true; };

TEST(PrefixTree, MatchesWholeBlocksOnly) {
  PrefixTree tree(4);
  Entries e;
  const auto prompt = seq({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  tree.insert(prompt, 2, e.make(), e.bytes());
  EXPECT_EQ(e.made_for_blocks, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(tree.nodes(), 2u);

  PrefixTree::Match m = tree.match(prompt);
  EXPECT_EQ(m.tokens, 8);
  EXPECT_EQ(m.path, (std::vector<PrefixTree::EntryId>{100, 101}));
  EXPECT_EQ(tree.match(seq({1, 2, 3, 4, 5, 6, 7})).tokens, 4);  // second block incomplete
  EXPECT_EQ(tree.match(seq({1, 2, 3})).tokens, 0);
  EXPECT_TRUE(tree.match(seq({1, 2, 3})).path.empty());
  EXPECT_EQ(tree.match(seq({1, 2, 3, 4, 5, 6, 0, 8})).tokens, 4);  // differs inside block 1
  EXPECT_EQ(tree.match(seq({9, 2, 3, 4, 5, 6, 7, 8})).tokens, 0);
  EXPECT_EQ(tree.match({}).tokens, 0);

  // Inserting blocks that exist creates nothing.
  tree.insert(prompt, 2, e.make(), e.bytes());
  EXPECT_EQ(e.made_for_blocks.size(), 2u);
  EXPECT_THROW(tree.insert(prompt, 3, e.make(), e.bytes()), Error);  // only 2 full blocks
  EXPECT_THROW(tree.insert(prompt, -1, e.make(), e.bytes()), Error);
  EXPECT_THROW(PrefixTree(0), Error);
}

TEST(PrefixTree, BranchingPrompts) {
  PrefixTree tree(2);
  Entries e;
  const auto a = seq({1, 1, 2, 2, 3, 3});
  const auto b = seq({1, 1, 2, 2, 4, 4, 5, 5});
  tree.insert(a, 3, e.make(), e.bytes());
  tree.insert(b, 4, e.make(), e.bytes());
  EXPECT_EQ(e.made_for_blocks, (std::vector<int64_t>{0, 1, 2, 2, 3}));  // b reuses blocks 0 and 1
  EXPECT_EQ(tree.nodes(), 5u);
  EXPECT_EQ(tree.match(a).path, (std::vector<PrefixTree::EntryId>{100, 101, 102}));
  EXPECT_EQ(tree.match(b).path, (std::vector<PrefixTree::EntryId>{100, 101, 103, 104}));
  const auto c = seq({1, 1, 2, 2, 9, 9});
  EXPECT_EQ(tree.match(c).tokens, 4);
  EXPECT_EQ(tree.bytes(), 50u);
}

// A salted namespace (vLLM's cache_salt) shares nothing with the unsalted one or with another salt,
// and its root goes with its last block.
TEST(PrefixTree, NamespacesNeverShareBlocks) {
  PrefixTree tree(2);
  Entries e;
  const auto prompt = seq({1, 1, 2, 2, 3});
  tree.insert(prompt, 2, e.make(), e.bytes());                      // 100, 101: no salt
  tree.insert(prompt, 1, e.make(), e.bytes(), "tenant-a");          // 102
  EXPECT_EQ(e.made_for_blocks, (std::vector<int64_t>{0, 1, 0}));  // the same tokens, made again
  EXPECT_EQ(tree.match(prompt).path, (std::vector<PrefixTree::EntryId>{100, 101}));
  EXPECT_EQ(tree.match(prompt, "tenant-a").path, (std::vector<PrefixTree::EntryId>{102}));
  EXPECT_EQ(tree.match(prompt, "tenant-b").tokens, 0);
  EXPECT_EQ(tree.nodes(), 3u);
  EXPECT_EQ(tree.namespaces(), 1u);
  tree.insert(prompt, 0, e.make(), e.bytes(), "tenant-b");  // nothing to hold: no namespace made
  EXPECT_EQ(tree.namespaces(), 1u);

  // A namespace whose first block cannot be made is not left behind.
  const auto refuse = [](int64_t) -> PrefixTree::EntryId { throw Error("no memory"); };
  EXPECT_THROW(tree.insert(prompt, 1, refuse, e.bytes(), "tenant-c"), Error);
  EXPECT_EQ(tree.namespaces(), 1u);

  // Eviction competes across namespaces by last use, and the salted root goes with its last block.
  tree.touch(tree.match(prompt), 5);
  tree.touch(tree.match(prompt, "tenant-a"), 1);
  EXPECT_EQ(tree.evict_until(20, kAll), (std::vector<PrefixTree::EntryId>{102}));
  EXPECT_EQ(tree.namespaces(), 0u);
  EXPECT_EQ(tree.nodes(), 2u);
  EXPECT_EQ(tree.match(prompt, "tenant-a").tokens, 0);
  tree.insert(prompt, 1, e.make(), e.bytes(), "tenant-a");  // and comes back with the next
  EXPECT_EQ(tree.match(prompt, "tenant-a").tokens, 2);
  tree.clear();
  EXPECT_EQ(tree.namespaces(), 0u);
  EXPECT_EQ(tree.nodes(), 0u);
}

TEST(PrefixTree, EvictsLeastRecentlyUsedFirst) {
  PrefixTree tree(2);
  Entries e;
  const auto a = seq({1, 1}), b = seq({2, 2}), c = seq({3, 3});
  tree.insert(a, 1, e.make(), e.bytes());  // 100
  tree.insert(b, 1, e.make(), e.bytes());  // 101
  tree.insert(c, 1, e.make(), e.bytes());  // 102
  tree.touch(tree.match(a), 3);
  tree.touch(tree.match(b), 1);
  tree.touch(tree.match(c), 2);
  EXPECT_TRUE(tree.evict_until(30, kAll).empty());  // already within budget
  EXPECT_EQ(tree.evict_until(10, kAll), (std::vector<PrefixTree::EntryId>{101, 102}));
  EXPECT_EQ(tree.bytes(), 10u);
  EXPECT_EQ(tree.nodes(), 1u);
  EXPECT_EQ(tree.match(a).tokens, 2);
  EXPECT_EQ(tree.match(b).tokens, 0);
}

TEST(PrefixTree, NewNodesTakeTheLatestClock) {
  PrefixTree tree(1);
  Entries e;
  tree.insert(seq({1}), 1, e.make(), e.bytes());  // 100
  tree.touch(tree.match(seq({1})), 5);
  tree.insert(seq({2}), 1, e.make(), e.bytes());  // 101, last use 5 without a touch
  tree.touch(tree.match(seq({1})), 6);
  EXPECT_EQ(tree.evict_until(10, kAll), (std::vector<PrefixTree::EntryId>{101}));
}

TEST(PrefixTree, EvictsLeavesOnly) {
  PrefixTree tree(1);
  Entries e;
  const auto chain = seq({1, 2, 3});
  tree.insert(chain, 3, e.make(), e.bytes());  // 100 -> 101 -> 102
  tree.insert(seq({7}), 1, e.make(), e.bytes());  // 103, a separate leaf
  tree.touch(tree.match(chain), 1);
  tree.touch(tree.match(seq({7})), 2);
  // The chain's ancestors are as old as its leaf, but only the leaf may go; each removal exposes
  // the next one up before the newer separate leaf is reached.
  EXPECT_EQ(tree.evict_until(0, kAll), (std::vector<PrefixTree::EntryId>{102, 101, 100, 103}));
  EXPECT_EQ(tree.nodes(), 0u);
  EXPECT_EQ(tree.bytes(), 0u);

  // Even an ancestor strictly older than its leaf waits for the leaf.
  tree.insert(chain, 3, e.make(), e.bytes());  // 104 -> 105 -> 106
  tree.insert(seq({8}), 1, e.make(), e.bytes());  // 107
  tree.touch(tree.match(chain), 10);
  tree.touch(tree.match(seq({8})), 20);
  PrefixTree::Match leaf_only = tree.match(chain);
  leaf_only.nodes.erase(leaf_only.nodes.begin(), leaf_only.nodes.end() - 1);
  tree.touch(leaf_only, 30);  // 104 and 105 at 10, 106 at 30, 107 at 20
  EXPECT_EQ(tree.evict_until(30, kAll), (std::vector<PrefixTree::EntryId>{107}));
  EXPECT_EQ(tree.evict_until(0, kAll), (std::vector<PrefixTree::EntryId>{106, 105, 104}));
}

TEST(PrefixTree, RespectsEvictable) {
  PrefixTree tree(1);
  Entries e;
  tree.insert(seq({1, 2}), 2, e.make(), e.bytes());  // 100 -> 101
  tree.insert(seq({5}), 1, e.make(), e.bytes());     // 102
  tree.touch(tree.match(seq({1, 2})), 1);
  tree.touch(tree.match(seq({5})), 2);
  PrefixTree::EntryId pinned = 101;
  auto not_pinned = [&](PrefixTree::EntryId id) { return id != pinned; };
  // 101 is pinned, so its parent 100 never becomes a leaf; only 102 can go.
  EXPECT_EQ(tree.evict_until(0, not_pinned), (std::vector<PrefixTree::EntryId>{102}));
  EXPECT_EQ(tree.bytes(), 20u);
  EXPECT_EQ(tree.match(seq({1, 2})).tokens, 2);
  pinned = -100;
  EXPECT_EQ(tree.evict_until(0, not_pinned), (std::vector<PrefixTree::EntryId>{101, 100}));
}

TEST(PrefixTree, BytesAccountingAndClear) {
  PrefixTree tree(2);
  Entries e;
  e.bytes_each = 7;
  tree.insert(seq({1, 1, 2, 2}), 2, e.make(), e.bytes());  // 100, 101: 7 each
  e.bytes_each = 100;
  tree.insert(seq({1, 1, 3, 3}), 2, e.make(), e.bytes());  // 102: 100
  EXPECT_EQ(tree.bytes(), 114u);
  // Nodes without an entry cost nothing and are removed silently.
  tree.insert(seq({1, 1, 3, 3, 4, 4}), 3, [](int64_t) { return PrefixTree::kNoEntry; }, e.bytes());
  EXPECT_EQ(tree.nodes(), 4u);
  EXPECT_EQ(tree.bytes(), 114u);
  EXPECT_EQ(tree.match(seq({1, 1, 3, 3, 4, 4})).path, (std::vector<PrefixTree::EntryId>{100, 102, -1}));
  tree.touch(tree.match(seq({1, 1, 2, 2})), 1);
  tree.touch(tree.match(seq({1, 1, 3, 3, 4, 4})), 2);
  // Budget 20: 101 goes (oldest leaf) but 114 - 7 > 20, then the entry-less leaf and 102.
  EXPECT_EQ(tree.evict_until(20, kAll), (std::vector<PrefixTree::EntryId>{101, 102}));
  EXPECT_EQ(tree.bytes(), 7u);
  EXPECT_EQ(tree.nodes(), 1u);
  PrefixTree::Match stale = tree.match(seq({1, 1}));
  tree.clear();
  EXPECT_EQ(tree.bytes(), 0u);
  EXPECT_EQ(tree.nodes(), 0u);
  EXPECT_EQ(tree.match(seq({1, 1})).tokens, 0);
  tree.touch(stale, 5);  // ids of removed nodes are ignored
  tree.insert(seq({1, 1}), 1, e.make(), e.bytes());
  EXPECT_EQ(tree.bytes(), 100u);
}

TEST(PrefixTree, LongChainsNeedNoRecursion) {
  // A 1M-token prompt in 64-token blocks is a 16K-node chain; build a longer one of 1-token blocks.
  PrefixTree tree(1);
  std::vector<int32_t> prompt(50000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i % 7);
  Entries e;
  e.bytes_each = 1;
  tree.insert(prompt, static_cast<int64_t>(prompt.size()), e.make(), e.bytes());
  EXPECT_EQ(tree.match(prompt).tokens, 50000);
  EXPECT_EQ(tree.evict_until(49990, kAll).size(), 10u);
  EXPECT_EQ(tree.match(prompt).tokens, 49990);
  tree.clear();
  EXPECT_EQ(tree.nodes(), 0u);
}

}  // namespace

#include "data/mo_catalog.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "data/mo_test_util.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

using testing::find_system_catalog;
using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;
using testing::write_mo;

std::vector<MoEntry> sample_entries() {
  return {
      {"", "Open", "", {"Öffnen"}},
      {"menu", "File", "", {"Datei"}},  // with msgctxt
      {"", "%d file", "%d files", {"%d Datei", "%d Dateien"}},  // plural
      {"", "Empty translation", "", {""}},
      {"verb", "Save", "", {"Speichern"}},
  };
}

std::vector<MoEntry> sorted(std::vector<MoEntry> v) {
  std::sort(v.begin(), v.end(), [](const MoEntry& a, const MoEntry& b) {
    return std::tie(a.context, a.msgid, a.msgid_plural) < std::tie(b.context, b.msgid, b.msgid_plural);
  });
  return v;
}

// Expects parse_mo(bytes) to throw a DataError whose message names `name` and contains `reason`.
void expect_data_error(const std::string& bytes, const std::string& name, const std::string& reason) {
  try {
    parse_mo(bytes, name);
    ADD_FAILURE() << "no DataError for " << name << " (expected: " << reason << ")";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

void set_word(std::string& bytes, size_t offset, uint32_t v, bool big_endian) {
  for (int i = 0; i < 4; ++i) {
    int shift = big_endian ? 8 * (3 - i) : 8 * i;
    bytes[offset + i] = static_cast<char>((v >> shift) & 0xff);
  }
}

uint32_t get_word(const std::string& bytes, size_t offset, bool big_endian) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    int shift = big_endian ? 8 * (3 - i) : 8 * i;
    v |= uint32_t{static_cast<unsigned char>(bytes[offset + i])} << shift;
  }
  return v;
}

bool is_big_endian_mo(const std::string& bytes) { return static_cast<unsigned char>(bytes[0]) == 0x95; }

TEST(MoCatalog, HandBuiltCatalogBothByteOrders) {
  const auto entries = sample_entries();
  const std::string le = write_mo(entries, /*big_endian=*/false);
  const std::string be = write_mo(entries, /*big_endian=*/true);
  ASSERT_NE(le, be);
  ASSERT_EQ(static_cast<unsigned char>(le[0]), 0xde);
  ASSERT_EQ(static_cast<unsigned char>(be[0]), 0x95);

  const auto from_le = parse_mo(le, "le.mo");
  const auto from_be = parse_mo(be, "be.mo");
  EXPECT_EQ(from_le, from_be);
  // The header entry is skipped; everything else comes back exactly.
  EXPECT_EQ(sorted(from_le), sorted(entries));

  bool saw_context = false, saw_plural = false;
  for (const MoEntry& e : from_le) {
    if (e.context == "menu") {
      saw_context = true;
      EXPECT_EQ(e.msgid, "File");
      EXPECT_EQ(e.translations, std::vector<std::string>{"Datei"});
    }
    if (!e.msgid_plural.empty()) {
      saw_plural = true;
      EXPECT_EQ(e.msgid, "%d file");
      EXPECT_EQ(e.msgid_plural, "%d files");
      EXPECT_EQ(e.translations, (std::vector<std::string>{"%d Datei", "%d Dateien"}));
    }
  }
  EXPECT_TRUE(saw_context);
  EXPECT_TRUE(saw_plural);
}

TEST(MoCatalog, ConvertsDeclaredCharsetToUtf8) {
  const std::string latin1 = write_mo({{"", "Open", "", {"\xd6" "ffnen"}}}, false,
                                      "Content-Type: text/plain; charset=ISO-8859-1\n");
  const auto entries = parse_mo(latin1, "latin1.mo");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].translations[0], "\xc3\x96" "ffnen");  // "Öffnen" in UTF-8

  // No conversion for UTF-8 (any spelling) or a missing charset.
  for (const char* header : {"Content-Type: text/plain; charset=utf-8\n", "Project-Id-Version: x\n"}) {
    EXPECT_EQ(parse_mo(write_mo({{"", "Open", "", {"\xd6"}}}, false, header), "u.mo")[0].translations[0], "\xd6");
  }
  expect_data_error(write_mo({{"", "Open", "", {"x"}}}, false, "Content-Type: text/plain; charset=NO-SUCH-SET\n"),
                    "badcs.mo", "unsupported charset \"NO-SUCH-SET\"");
  expect_data_error(write_mo({{"", "Open", "", {"\xff\xfe\xff"}}}, false, "Content-Type: text/plain; charset=EUC-JP\n"),
                    "euc.mo", "is not valid EUC-JP");
}

TEST(MoCatalog, ReadsFileAndReportsUnreadableFile) {
  TempDir dir("mo");
  write_bytes(dir.file("x.mo"), write_mo(sample_entries(), false));
  EXPECT_EQ(read_mo_file(dir.file("x.mo")).size(), sample_entries().size());

  const std::string missing = dir.file("missing.mo");
  try {
    read_mo_file(missing);
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOENT)), std::string::npos) << e.what();
  }
  // A directory is not a catalog either.
  EXPECT_THROW(read_mo_file(dir.path()), DataError);
}

TEST(MoCatalog, ParsesRealSystemCatalog) {
  const std::string path = find_system_catalog("de");
  if (path.empty()) GTEST_SKIP() << "no German catalog in /usr/share/locale";
  const auto entries = read_mo_file(path);
  EXPECT_GT(entries.size(), 10u) << path;
  for (const MoEntry& e : entries) {
    EXPECT_FALSE(e.msgid.empty()) << path;
    ASSERT_FALSE(e.translations.empty()) << path << ": " << e.msgid;
    if (e.msgid_plural.empty()) {
      EXPECT_EQ(e.translations.size(), 1u) << e.msgid;
    }
  }
}

TEST(MoCatalog, CorruptCopiesOfRealCatalogThrowNamingTheFile) {
  const std::string path = find_system_catalog("de");
  if (path.empty()) GTEST_SKIP() << "no German catalog in /usr/share/locale";
  const std::string good = read_bytes(path);
  ASSERT_GT(good.size(), 100u);
  ASSERT_NO_THROW(parse_mo(good, path));
  const bool be = is_big_endian_mo(good);
  const std::string name = "/corrupt/" + path;

  for (size_t len : {size_t{0}, size_t{3}, size_t{20}}) {
    expect_data_error(good.substr(0, len), name, "file too short");
  }
  expect_data_error(good.substr(0, good.size() / 2), name, "past end of file");
  expect_data_error(good.substr(0, good.size() - 1), name, "");  // last string loses its NUL

  std::string bad_magic = good;
  set_word(bad_magic, 0, 0x12345678, false);
  expect_data_error(bad_magic, name, "bad magic");

  std::string bad_revision = good;
  set_word(bad_revision, 4, 2u << 16, be);
  expect_data_error(bad_revision, name, "revision");

  // First original-string entry points past the end.
  std::string bad_offset = good;
  const uint32_t orig_table = get_word(good, 12, be);
  set_word(bad_offset, orig_table + 4, static_cast<uint32_t>(good.size() + 100), be);
  expect_data_error(bad_offset, name, "original string table entry 0 points past end of file");

  std::string huge_n = good;
  set_word(huge_n, 8, 0x7fffffff, be);
  expect_data_error(huge_n, name, "entry count 2147483647");

  std::string bad_table = good;
  set_word(bad_table, 16, 0xfffffff0u, be);
  expect_data_error(bad_table, name, "translation table");
}

TEST(MoCatalog, StringWithoutNulIsRejected) {
  std::string bytes = write_mo({{"", "Open", "", {"Öffnen"}}}, false);
  // Overwrite the NUL after the last string (the last translation) with a letter.
  bytes.back() = 'x';
  expect_data_error(bytes, "nonul.mo", "not NUL-terminated");
}

TEST(MoCatalog, RandomMutationsNeverCrash) {
  const std::string good = write_mo(sample_entries(), false);
  std::mt19937 rng(12345);
  int parsed = 0, rejected = 0;
  for (int round = 0; round < 600; ++round) {
    std::string bytes = good;
    const int kind = round % 4;
    if (kind == 0) {  // flip a few random bytes
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    } else if (kind == 1) {  // truncate
      bytes.resize(rng() % bytes.size());
    } else if (kind == 2) {  // a random word in the header or tables
      const size_t word = rng() % ((28 + 16 * (sample_entries().size() + 1)) / 4);
      set_word(bytes, word * 4, static_cast<uint32_t>(rng()), rng() % 2);
    } else {  // a small change to a length or offset
      const size_t word = 7 + rng() % (4 * (sample_entries().size() + 1));
      uint32_t v;
      std::memcpy(&v, bytes.data() + word * 4, 4);
      set_word(bytes, word * 4, v + static_cast<uint32_t>(rng() % 9) - 4, false);
    }
    try {
      auto entries = parse_mo(bytes, "fuzz.mo");
      for (const MoEntry& e : entries) {
        EXPECT_FALSE(e.msgid.empty());
        EXPECT_FALSE(e.translations.empty());
      }
      ++parsed;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("fuzz.mo"), std::string::npos);
      ++rejected;
    }
  }
  // Both outcomes must occur, or the mutations are not testing anything.
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace nebula::data

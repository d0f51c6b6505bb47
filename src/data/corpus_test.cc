#include "data/corpus.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "data/mo_test_util.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

using testing::TempDir;
using testing::write_bytes;
using testing::write_mo;

// --- clean_message -------------------------------------------------------------------

TEST(CleanMessage, FormatSpecifiers) {
  EXPECT_EQ(clean_message("Cannot open %s now"), "Cannot open now");
  EXPECT_EQ(clean_message("%d files copied"), "files copied");
  EXPECT_EQ(clean_message("value %-5.2f here"), "value here");
  EXPECT_EQ(clean_message("move %1$s to %2$s"), "move to");
  EXPECT_EQ(clean_message("%lu bytes, %zu items, %'d total"), "bytes, items, total");
  EXPECT_EQ(clean_message("width %*d end"), "width end");
  EXPECT_EQ(clean_message("Hello %(name)s there"), "Hello there");
  EXPECT_EQ(clean_message("Copy %1 to %2"), "Copy to");
  EXPECT_EQ(clean_message("100%% done"), "100% done");
  EXPECT_EQ(clean_message("first%%0Asecond"), "first second");
  EXPECT_EQ(clean_message("Applying patch %%s with reject"), "Applying patch with reject");
  EXPECT_EQ(clean_message("50 % of all"), "50 % of all");
  EXPECT_EQ(clean_message("100% done"), "100% done");
  EXPECT_EQ(clean_message("%B %-d, %Y at %H:%M"), "at");  // strftime
  EXPECT_EQ(clean_message("No URLs found in %s."), "No URLs found in.");
  EXPECT_EQ(clean_message("Failed to rename %s to %s: %s"), "Failed to rename to");
  EXPECT_EQ(clean_message("Failed to rename %s to %s: failed"), "Failed to rename to: failed");
  EXPECT_EQ(clean_message("Size%sMB"), "SizeMB");
}

TEST(CleanMessage, BracePlaceholders) {
  EXPECT_EQ(clean_message("Delete {0} items"), "Delete items");
  EXPECT_EQ(clean_message("Hello {name}, welcome"), "Hello, welcome");
  EXPECT_EQ(clean_message("Path ${var} missing"), "Path missing");
  EXPECT_EQ(clean_message("Size {0:>8} here {}"), "Size here");
  EXPECT_EQ(clean_message("a { b } c"), "a { b } c");  // not a placeholder
}

TEST(CleanMessage, MarkupTags) {
  EXPECT_EQ(clean_message("<b>Bold</b> text"), "Bold text");
  EXPECT_EQ(clean_message("Click <a href=\"x\">here</a>"), "Click here");
  EXPECT_EQ(clean_message("<span weight=\"bold\">Warning</span>"), "Warning");
  EXPECT_EQ(clean_message("line<br/>break"), "line break");
  EXPECT_EQ(clean_message("Click <b>here</b>."), "Click here.");
  EXPECT_EQ(clean_message("if a < b and c > d"), "if a < b and c > d");
  EXPECT_EQ(clean_message("x <= y"), "x <= y");
}

TEST(CleanMessage, Mnemonics) {
  EXPECT_EQ(clean_message("_File"), "File");
  EXPECT_EQ(clean_message("&Open"), "Open");
  EXPECT_EQ(clean_message("Save _As"), "Save As");
  EXPECT_EQ(clean_message("a & b"), "a & b");
  EXPECT_EQ(clean_message("AT&T"), "AT&T");
  EXPECT_EQ(clean_message("set max_connections"), "set max_connections");
  EXPECT_EQ(clean_message("Fish &amp; Chips"), "Fish & Chips");
  EXPECT_EQ(clean_message("\xe6\x89\x93\xe5\xbc\x80(_O)"), "\xe6\x89\x93\xe5\xbc\x80");  // 打开(_O)
}

TEST(CleanMessage, TrailingEllipsisColonAndWhitespace) {
  EXPECT_EQ(clean_message("Open File..."), "Open File");
  EXPECT_EQ(clean_message("Open File\xe2\x80\xa6"), "Open File");  // …
  EXPECT_EQ(clean_message("Name:"), "Name");
  EXPECT_EQ(clean_message("Nom\xc2\xa0:"), "Nom");  // French no-break space before ':'
  EXPECT_EQ(clean_message("Options...:  "), "Options");
  EXPECT_EQ(clean_message("first line\nsecond\tline"), "first line second line");
  EXPECT_EQ(clean_message("  many    spaces  "), "many spaces");
  EXPECT_EQ(clean_message("%s: invalid option -- '%c'\n"), "invalid option --");
  EXPECT_EQ(clean_message("cannot open '%s'"), "cannot open");
  EXPECT_EQ(clean_message("'a' 'b'"), "'a' 'b'");
  EXPECT_EQ(clean_message("Nom\xc2\xa0: valeur"), "Nom : valeur");  // French spacing kept
  EXPECT_EQ(clean_message("bell\x01\x07 here"), "bell here");
  EXPECT_EQ(clean_message("\xc2\xab %s \xc2\xbb introuvable"), "introuvable");  // « %s »
  EXPECT_EQ(clean_message("%s"), "");
  EXPECT_EQ(clean_message(""), "");
}

TEST(CleanMessage, GnupgArgumentNames) {
  EXPECT_EQ(clean_message("|FD|write status info to this FD"), "write status info to this FD");
  EXPECT_EQ(clean_message("|N|Please enter a new PIN"), "Please enter a new PIN");
  EXPECT_EQ(clean_message("||Please enter the PIN"), "Please enter the PIN");
  EXPECT_EQ(clean_message("|| means or"), "|| means or");
  EXPECT_EQ(clean_message("a|b|c"), "a|b|c");
  EXPECT_EQ(clean_message("|not a name|x"), "|not a name|x");
}

TEST(CleanMessage, NoSpaceLeftInsideQuotes) {
  EXPECT_EQ(clean_message("Server did not accept the 'PROT %s' command."), "Server did not accept the 'PROT' command.");
  EXPECT_EQ(clean_message("Run '%s --help' to see more"), "Run '--help' to see more");
  EXPECT_EQ(clean_message("Kommando \xc2\xbbPROT %s\xc2\xab nicht"), "Kommando \xc2\xbbPROT\xc2\xab nicht");
  EXPECT_EQ(clean_message("Use \xe2\x80\x9c%s help COMMAND\xe2\x80\x9d now"),
            "Use \xe2\x80\x9chelp COMMAND\xe2\x80\x9d now");
  EXPECT_EQ(clean_message("failed to run command: \"%s -c %s\""), "failed to run command: \"-c\"");
  // Quotes that neither open nor close next to the removed text keep their space.
  EXPECT_EQ(clean_message("cannot open %s 'file'"), "cannot open 'file'");
  EXPECT_EQ(clean_message("the students' %s files"), "the students' files");
  EXPECT_EQ(clean_message("'a' %s 'b'"), "'a' 'b'");
}

// --- package messages (zero-shot transfer) --------------------------------------------

// Messages are labelled by their package; one in two packages is dropped (ambiguous); each
// keeps the translations of every language that has a usable one; a package missing in a
// language names the file.
TEST(PackageMessages, LabelledByPackageWithTheirTranslations) {
  TempDir dir{"packages"};
  write_bytes(dir.file("de/LC_MESSAGES/git.mo"), write_mo({{"", "Commit changes", "", {"Änderungen committen"}},
                                                          {"", "Cancel", "", {"Abbrechen"}},
                                                          {"", "Untranslated", "", {""}}},
                                                         false));
  write_bytes(dir.file("fr/LC_MESSAGES/git.mo"), write_mo({{"", "Commit changes", "", {"Valider les modifications"}},
                                                          {"", "Cancel", "", {"Annuler"}}},
                                                         false));
  write_bytes(dir.file("de/LC_MESSAGES/tar.mo"), write_mo({{"", "Extract files", "", {"Dateien entpacken"}},
                                                          {"", "Cancel", "", {"Abbrechen"}}},
                                                         true));
  write_bytes(dir.file("fr/LC_MESSAGES/tar.mo"), write_mo({{"", "Extract files", "", {"Extraire les fichiers"}},
                                                          {"", "Only in French", "", {"Seulement en français"}}},
                                                         false));
  const auto m = read_package_messages(dir.path(), {"git", "tar"}, {"de", "fr"});
  ASSERT_EQ(m.size(), 3u);  // "Cancel" is in both packages: dropped
  EXPECT_EQ(m[0].en, "Commit changes");
  EXPECT_EQ(m[0].label, 0);
  EXPECT_EQ(m[0].translations, (std::map<std::string, std::string>{{"de", "Änderungen committen"},
                                                                   {"fr", "Valider les modifications"}}));
  EXPECT_EQ(m[1].en, "Extract files");
  EXPECT_EQ(m[1].label, 1);
  EXPECT_EQ(m[2].en, "Only in French");
  EXPECT_EQ(m[2].translations.size(), 1u);
  try {
    read_package_messages(dir.path(), {"git", "dpkg"}, {"de"});
    ADD_FAILURE() << "a package without catalogs was read";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("dpkg.mo"), std::string::npos) << e.what();
  }
}

// --- gettext corpus on a hand-built locale directory ----------------------------------

struct FakeLocale {
  TempDir dir{"locale"};
  FakeLocale() {
    // de: two catalogs that share one pair, plus a corrupt one.
    write_bytes(dir.file("de/LC_MESSAGES/a.mo"),
                write_mo({{"", "_Open", "", {"_Öffnen"}},
                          {"", "Save file...", "", {"Datei speichern …"}},
                          {"", "OK", "", {"OK"}},                  // same text: dropped
                          {"", "Untranslated", "", {""}},          // empty: dropped
                          {"", "X", "", {"Y"}},                    // too short: dropped
                          {"", std::string(300, 'a'), "", {"b"}},  // too long: dropped
                          {"", "%d file", "%d files", {"%d Datei", "%d Dateien"}}},
                         false));
    write_bytes(dir.file("de/LC_MESSAGES/b.mo"),
                write_mo({{"", "Open", "", {"Öffnen"}},  // duplicate of a.mo after cleaning
                          {"ctx", "Close", "", {"Schließen"}}},
                         true));
    write_bytes(dir.file("de/LC_MESSAGES/corrupt.mo"), "this is not a catalog at all, just text");
    write_bytes(dir.file("fr/LC_MESSAGES/a.mo"), write_mo({{"", "Close", "", {"Fermer"}}}, false));
    std::filesystem::create_directories(dir.file("xx/LC_MESSAGES"));  // no catalogs
    write_bytes(dir.file("yy/README"), "not a language");
  }
};

TEST(GettextCorpus, ListsLanguagesWithCatalogs) {
  FakeLocale loc;
  EXPECT_EQ(list_gettext_languages(loc.dir.path()), (std::vector<std::string>{"de", "fr"}));
  EXPECT_THROW(list_gettext_languages(loc.dir.file("nonexistent")), DataError);
}

TEST(GettextCorpus, BuildsCleanSortedDedupedPairsAndSkipsCorruptCatalog) {
  FakeLocale loc;
  CorpusOptions opt;
  opt.locale_dir = loc.dir.path();
  CorpusStats stats;
  const auto pairs = build_gettext_corpus(opt, &stats);
  const std::vector<SentencePair> expected = {
      {"de", "Close", "Schließen"},
      {"de", "Open", "Öffnen"},
      {"de", "Save file", "Datei speichern"},
      {"de", "file", "Datei"},
      {"fr", "Close", "Fermer"},
  };
  EXPECT_EQ(pairs, expected);
  EXPECT_TRUE(std::is_sorted(pairs.begin(), pairs.end()));
  EXPECT_EQ(stats.files_read, 3u);
  EXPECT_EQ(stats.files_skipped, 1u);
  EXPECT_EQ(stats.entries_seen, 10u);
  EXPECT_EQ(stats.duplicates_dropped, 1u);
  EXPECT_EQ(stats.pairs_kept, 5u);
  EXPECT_EQ(stats.pairs_per_language, (std::map<std::string, size_t>{{"de", 4}, {"fr", 1}}));

  // Deterministic, and selecting one language gives the same pairs for it.
  EXPECT_EQ(build_gettext_corpus(opt), pairs);
  opt.languages = {"fr"};
  EXPECT_EQ(build_gettext_corpus(opt), (std::vector<SentencePair>{{"fr", "Close", "Fermer"}}));
}

TEST(GettextCorpus, MissingLanguageIsAnError) {
  FakeLocale loc;
  CorpusOptions opt;
  opt.locale_dir = loc.dir.path();
  opt.languages = {"de", "xx"};
  try {
    build_gettext_corpus(opt);
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("'xx'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(loc.dir.path()), std::string::npos) << e.what();
  }
  opt.languages = {"zz"};
  EXPECT_THROW(build_gettext_corpus(opt), DataError);
}

TEST(GettextCorpus, MaxPairsKeepsADeterministicHashChosenSubset) {
  TempDir dir("locale_many");
  std::vector<MoEntry> entries;
  for (int i = 0; i < 300; ++i) {
    entries.push_back({"", "message number " + std::to_string(1000 + i), "", {"Nachricht " + std::to_string(i)}});
  }
  write_bytes(dir.file("de/LC_MESSAGES/m.mo"), write_mo(entries, false));
  CorpusOptions opt;
  opt.locale_dir = dir.path();
  const auto all = build_gettext_corpus(opt);
  ASSERT_EQ(all.size(), 300u);
  opt.max_pairs_per_language = 50;
  CorpusStats stats;
  const auto subset = build_gettext_corpus(opt, &stats);
  ASSERT_EQ(subset.size(), 50u);
  EXPECT_EQ(stats.pairs_kept, 50u);
  EXPECT_TRUE(std::is_sorted(subset.begin(), subset.end()));
  EXPECT_TRUE(std::includes(all.begin(), all.end(), subset.begin(), subset.end()));
  // Not simply the alphabetically first 50, and spread over the whole range.
  EXPECT_NE(subset, std::vector<SentencePair>(all.begin(), all.begin() + 50));
  EXPECT_GT(subset.back(), all[200]);
  EXPECT_EQ(build_gettext_corpus(opt), subset);
}

// "%s" as a whole token ("%sp", an x86 register in binutils' help, is text).
bool has_bare_percent_s(const std::string& s) {
  for (size_t pos = s.find("%s"); pos != std::string::npos; pos = s.find("%s", pos + 1)) {
    if (pos + 2 == s.size() || !std::isalnum(static_cast<unsigned char>(s[pos + 2]))) return true;
  }
  return false;
}

TEST(GettextCorpus, RealSystemCatalogsGermanAndFrench) {
  for (const char* lang : {"de", "fr"}) {
    if (!std::filesystem::exists(std::string("/usr/share/locale/") + lang + "/LC_MESSAGES")) {
      GTEST_SKIP() << "no " << lang << " catalogs on this machine";
    }
  }
  CorpusOptions opt;
  opt.languages = {"de", "fr"};
  CorpusStats stats;
  const auto pairs = build_gettext_corpus(opt, &stats);
  EXPECT_GT(stats.pairs_per_language["de"], 1000u);
  EXPECT_GT(stats.pairs_per_language["fr"], 1000u);
  EXPECT_EQ(stats.pairs_per_language.size(), 2u);
  EXPECT_EQ(pairs.size(), stats.pairs_kept);
  EXPECT_TRUE(std::is_sorted(pairs.begin(), pairs.end()));
  for (const auto& p : pairs) {
    ASSERT_TRUE(p.lang == "de" || p.lang == "fr");
    ASSERT_GE(p.en.size(), opt.min_chars);
    ASSERT_GE(p.other.size(), opt.min_chars);
    ASSERT_LE(p.en.size(), opt.max_chars);
    ASSERT_NE(p.en, p.other);
    ASSERT_EQ(p.en.find('\n'), std::string::npos);
    ASSERT_EQ(p.en.find("  "), std::string::npos) << p.en;
    ASSERT_NE(p.en.back(), ' ') << p.en;
    ASSERT_NE(p.other.front(), ' ') << p.other;
    ASSERT_FALSE(has_bare_percent_s(p.en)) << p.en;
    ASSERT_FALSE(has_bare_percent_s(p.other)) << p.other;
  }
}

TEST(GettextCorpus, CountsEveryEntryOnce) {
  FakeLocale loc;
  CorpusOptions opt;
  opt.locale_dir = loc.dir.path();
  CorpusStats stats;
  build_gettext_corpus(opt, &stats);
  EXPECT_EQ(stats.entries_dropped, 4u);  // OK (unchanged), Untranslated, X (short), a*300 (long)
  EXPECT_EQ(stats.entries_seen,
            stats.entries_dropped + stats.duplicates_dropped + stats.pairs_over_cap + stats.pairs_kept);
  EXPECT_EQ(stats.skipped_files, (std::vector<std::string>{loc.dir.file("de/LC_MESSAGES/corrupt.mo")}));
  opt.max_pairs_per_language = 2;
  build_gettext_corpus(opt, &stats);
  EXPECT_EQ(stats.pairs_over_cap, 2u);  // de: 4 -> 2
  EXPECT_EQ(stats.pairs_kept, 3u);
}

// --- nebula corpus build ----------------------------------------------------------------

std::vector<SentencePair> all_splits(const Corpus& c) {
  std::vector<SentencePair> all = c.train;
  all.insert(all.end(), c.valid.begin(), c.valid.end());
  all.insert(all.end(), c.test.begin(), c.test.end());
  std::sort(all.begin(), all.end());
  return all;
}

TEST(BuildCorpus, GettextSplitsAreDisjointCompleteAndCounted) {
  FakeLocale loc;
  CorpusBuildOptions opt;
  opt.path = loc.dir.path();
  opt.valid_fraction = 0.3;
  opt.test_fraction = 0.3;
  const Corpus c = build_corpus(opt);
  CorpusOptions g;
  g.locale_dir = loc.dir.path();
  EXPECT_EQ(all_splits(c), build_gettext_corpus(g));  // every pair in exactly one split
  EXPECT_EQ(c.stats.files_skipped, 1u);
  for (const auto* split : {&c.train, &c.valid, &c.test}) {
    EXPECT_TRUE(std::is_sorted(split->begin(), split->end()));
    for (const auto& p : *split) {
      const Split expected = split == &c.train ? Split::kTrain : split == &c.valid ? Split::kValid : Split::kTest;
      EXPECT_EQ(split_of_sentence(p.en, 0.3, 0.3), expected) << p.en;
    }
  }
  // "Close" is in de (b.mo) and fr (a.mo): one split for both.
  EXPECT_EQ(c.stats.split_conflicts_dropped, 0u);
  EXPECT_EQ(c.overlap.en_sentences, 0u);
  // Per-language statistics add up; characters are code points ("Öffnen" is 6).
  size_t pairs = 0;
  for (const auto& [lang, splits] : c.split_stats)
    for (const SplitStats& s : splits) pairs += s.pairs;
  EXPECT_EQ(pairs, c.stats.pairs_kept);
  const auto& fr = c.split_stats.at("fr")[static_cast<size_t>(split_of_sentence("Close", 0.3, 0.3))];
  EXPECT_EQ(fr.pairs, 1u);
  EXPECT_EQ(fr.en_chars, 5u);
  EXPECT_EQ(fr.other_chars, 6u);
  size_t de_other = 0;
  for (const SplitStats& s : c.split_stats.at("de")) de_other += s.other_chars;
  EXPECT_EQ(de_other, 9u + 6u + 15u + 5u);  // Schließen, Öffnen, Datei speichern, Datei
}

TEST(BuildCorpus, WritesByteIdenticalFilesThatReadBack) {
  FakeLocale loc;
  CorpusBuildOptions opt;
  opt.path = loc.dir.path();
  opt.valid_fraction = 0.25;
  opt.test_fraction = 0.25;
  TempDir out("corpus_out");
  const Corpus c = build_corpus(opt);
  write_corpus(out.file("a"), c, opt);
  write_corpus(out.file("b"), build_corpus(opt), opt);
  for (const char* f : {"train.tsv", "valid.tsv", "test.tsv", "stats.json"}) {
    EXPECT_EQ(testing::read_bytes(out.file(std::string("a/") + f)),
              testing::read_bytes(out.file(std::string("b/") + f)))
        << f;
  }
  EXPECT_EQ(read_tsv_file(out.file("a/train.tsv"), "unused"), c.train);
  EXPECT_EQ(read_tsv_file(out.file("a/test.tsv"), "unused"), c.test);
  const std::string json = testing::read_bytes(out.file("a/stats.json"));
  EXPECT_NE(json.find("\"duplicates_removed\": 1"), std::string::npos) << json;
  EXPECT_NE(json.find("corrupt.mo"), std::string::npos) << json;
  EXPECT_NE(json.find("\"overlap\": {\n  \"en_sentences\": 0,\n  \"other_sentences\": 0,"), std::string::npos) << json;
  const std::string table = format_corpus_stats(c, opt);
  EXPECT_NE(table.find("1 skipped"), std::string::npos) << table;
  EXPECT_NE(table.find("\nde "), std::string::npos) << table;
  EXPECT_NE(table.find("\ntotal "), std::string::npos) << table;
  EXPECT_THROW(write_corpus("/proc/no/such/dir", c, opt), DataError);
}

TEST(BuildCorpus, TsvIsDeduplicatedSelectedAndCappedPerLanguage) {
  TempDir dir("corpus_tsv");
  std::string text = "# lang, en, other\nHello\tHallo\nde\tOpen\tÖffnen\nde\tOpen\tÖffnen\n";
  for (int i = 0; i < 100; ++i) text += "fr\tline " + std::to_string(i) + "\tligne " + std::to_string(i) + "\n";
  write_bytes(dir.file("p.tsv"), text);
  CorpusBuildOptions opt;
  opt.source = "tsv";
  opt.path = dir.file("p.tsv");
  opt.valid_fraction = 0.1;
  opt.test_fraction = 0.1;
  opt.max_pairs_per_language = 30;
  Corpus c = build_corpus(opt);
  EXPECT_EQ(c.stats.entries_seen, 103u);
  EXPECT_EQ(c.stats.duplicates_dropped, 1u);
  EXPECT_EQ(c.stats.pairs_over_cap, 70u);
  EXPECT_EQ(c.stats.pairs_per_language, (std::map<std::string, size_t>{{"de", 1}, {"fr", 30}, {"xx", 1}}));
  EXPECT_EQ(all_splits(c).size(), 32u);
  EXPECT_EQ(all_splits(build_corpus(opt)), all_splits(c));

  opt.languages = {"de"};
  c = build_corpus(opt);
  EXPECT_EQ(all_splits(c), (std::vector<SentencePair>{{"de", "Open", "Öffnen"}}));
  opt.languages = {"de", "es"};
  try {
    build_corpus(opt);
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("'es'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(opt.path), std::string::npos) << e.what();
  }
}

TEST(BuildCorpus, TextLinesAreMonolingualPairs) {
  TempDir dir("corpus_text");
  write_bytes(dir.file("t.txt"), "one line\nanother line\none line\n");
  CorpusBuildOptions opt;
  opt.source = "text";
  opt.path = dir.file("t.txt");
  opt.valid_fraction = 0;
  opt.test_fraction = 0;
  const Corpus c = build_corpus(opt);
  EXPECT_EQ(c.train, (std::vector<SentencePair>{{"text", "another line", ""}, {"text", "one line", ""}}));
  EXPECT_EQ(c.stats.duplicates_dropped, 1u);
  opt.languages = {"de"};
  EXPECT_THROW(build_corpus(opt), nebula::Error);
}

TEST(BuildCorpus, BadOptionsAreErrors) {
  CorpusBuildOptions opt;
  opt.valid_fraction = 0.5;
  opt.test_fraction = 0.5;  // nothing left for train
  EXPECT_THROW(build_corpus(opt), nebula::Error);
  opt.valid_fraction = 2;
  opt.test_fraction = 0;
  EXPECT_THROW(build_corpus(opt), nebula::Error);
  opt = CorpusBuildOptions{};
  opt.source = "csv";
  EXPECT_THROW(build_corpus(opt), nebula::Error);
  opt.source = "tsv";  // no path
  EXPECT_THROW(build_corpus(opt), nebula::Error);
}

// --- text and TSV files ----------------------------------------------------------------

TEST(TextFiles, ReadTextFile) {
  TempDir dir("text");
  write_bytes(dir.file("t.txt"), "first line\r\n\n   \nsecond line\nlast without newline");
  EXPECT_EQ(read_text_file(dir.file("t.txt")),
            (std::vector<std::string>{"first line", "second line", "last without newline"}));
  try {
    read_text_file(dir.file("missing.txt"));
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("missing.txt")), std::string::npos) << e.what();
  }
}

TEST(TextFiles, ReadLinesKeepsEmptyLines) {
  TempDir dir("lines");
  write_bytes(dir.file("h.txt"), "first\r\n\n  \nlast\n");
  EXPECT_EQ(read_lines(dir.file("h.txt")), (std::vector<std::string>{"first", "", "  ", "last"}));
  write_bytes(dir.file("n.txt"), "no final newline");
  EXPECT_EQ(read_lines(dir.file("n.txt")), (std::vector<std::string>{"no final newline"}));
  write_bytes(dir.file("e.txt"), "");
  EXPECT_TRUE(read_lines(dir.file("e.txt")).empty());
  EXPECT_THROW(read_lines(dir.file("missing.txt")), DataError);
}

TEST(TextFiles, TsvRoundTrip) {
  TempDir dir("tsv");
  const std::vector<SentencePair> pairs = {
      {"de", "Open", "Öffnen"},
      {"fr", "with\ttab", "with\nnewline"},
      {"pt_BR", "Close", "Fechar"},
  };
  write_tsv_file(dir.file("p.tsv"), pairs);
  const auto back = read_tsv_file(dir.file("p.tsv"), "unused");
  const std::vector<SentencePair> expected = {
      {"de", "Open", "Öffnen"},
      {"fr", "with tab", "with newline"},
      {"pt_BR", "Close", "Fechar"},
  };
  EXPECT_EQ(back, expected);
  EXPECT_FALSE(std::filesystem::exists(dir.file("p.tsv.tmp")));
}

TEST(TextFiles, TsvTwoColumnsCommentsAndBlankLines) {
  TempDir dir("tsv2");
  write_bytes(dir.file("p.tsv"), "# comment\nHello\tHallo\r\n\nes\tHello\tHola\n");
  EXPECT_EQ(read_tsv_file(dir.file("p.tsv"), "de"),
            (std::vector<SentencePair>{{"de", "Hello", "Hallo"}, {"es", "Hello", "Hola"}}));
}

TEST(TextFiles, TsvBadColumnCountNamesFileAndLine) {
  TempDir dir("tsv3");
  const std::string path = dir.file("bad.tsv");
  write_bytes(path, "# header\nHello\tHallo\njust one column\n");
  try {
    read_tsv_file(path, "de");
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path + ":3: expected 2 or 3 tab-separated columns, got 1 (", 0), 0u)
        << e.what();
  }
  write_bytes(path, "a\tb\tc\td\n");
  EXPECT_THROW(read_tsv_file(path, "de"), DataError);
  EXPECT_THROW(read_tsv_file(dir.file("missing.tsv"), "de"), DataError);
}

// [6/7] hostile input: a file in another encoding, a binary file, a directory or a missing
// file is a DataError naming the file (and the line and column where one applies); a BOM is
// not part of the first field.
TEST(TextFiles, InvalidUtf8BinaryAndNonFilesNameFileLineAndColumn) {
  TempDir dir("enc");
  const std::string tsv = dir.file("latin1.tsv"), txt = dir.file("latin1.txt");
  write_bytes(tsv, "de\tHello\tHallo\nde\tOpen\t\xd6" "ffnen\n");  // ISO-8859-1 "Öffnen"
  write_bytes(txt, "fine\nstill fine \xc3\xa9\nbad \xe9t\xe9\n");
  auto expect_error = [](auto read, const std::string& prefix, const std::string& says) {
    try {
      read();
      ADD_FAILURE() << "no DataError, expected " << prefix;
    } catch (const DataError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  expect_error([&] { read_tsv_file(tsv, "xx"); }, tsv + ":2:9: not valid UTF-8 (byte 0xD6)", "iconv");
  expect_error([&] { read_text_file(txt); }, txt + ":3:5: not valid UTF-8 (byte 0xE9)", "convert the file to UTF-8");
  // Overlong, surrogate, above U+10FFFF and cut-off sequences are not UTF-8 either.
  for (const char* bad : {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "ok \xe2\x82"}) {
    write_bytes(txt, std::string("a\n") + bad + "\n");
    EXPECT_THROW(read_text_file(txt), DataError) << bad;
  }
  // A gzip'd file given as text: NUL bytes.
  write_bytes(tsv, std::string("\x1f\x8b\x08\x00\x00\x00", 6));
  expect_error([&] { read_tsv_file(tsv, "xx"); }, tsv + ":1:", "not valid UTF-8");
  write_bytes(tsv, std::string("abc\0def\n", 8));
  expect_error([&] { read_tsv_file(tsv, "xx"); }, tsv + ":1:4: a NUL byte", "not a text file");
  // A directory where a file is expected, and a missing file.
  expect_error([&] { read_tsv_file(dir.path(), "xx"); }, dir.path() + ": cannot read", "directory");
  expect_error([&] { read_text_file(dir.file("missing.txt")); }, dir.file("missing.txt") + ": cannot open", "No such");
  // Valid UTF-8 (4-byte sequences included) and a byte-order mark are fine.
  write_bytes(tsv, "\xef\xbb\xbf" "de\tHello \xf0\x9f\x98\x80\tHallo \xc3\x96\n");
  EXPECT_EQ(read_tsv_file(tsv, "xx"), (std::vector<SentencePair>{{"de", "Hello \xf0\x9f\x98\x80", "Hallo \xc3\x96"}}));
}

// --- splits and slices ------------------------------------------------------------------

std::vector<SentencePair> synthetic_pairs(size_t n) {
  std::vector<SentencePair> pairs;
  for (size_t i = 0; i < n; ++i) {
    pairs.push_back({i % 3 == 0 ? "de" : "fr", "sentence " + std::to_string(i), "phrase " + std::to_string(i)});
  }
  return pairs;
}

TEST(Splits, HashIsStableAcrossMachines) {
  // Golden values: if these change, every existing split and slice changes.
  EXPECT_EQ(pair_hash({"de", "Open", "Öffnen"}, 0), 0x02dc2b1956c86ea0ULL);
  EXPECT_EQ(pair_hash({"", "", ""}, 1), 0xad34411371cbdd66ULL);
  EXPECT_NE(pair_hash({"de", "ab", "c"}, 0), pair_hash({"de", "a", "bc"}, 0));
}

TEST(Splits, DeterministicWithRequestedFractions) {
  const auto pairs = synthetic_pairs(10000);
  size_t counts[3] = {0, 0, 0};
  for (const auto& p : pairs) {
    const Split s = split_of_sentence(p.en, 0.1, 0.05);
    EXPECT_EQ(split_of_sentence(p.en, 0.1, 0.05), s);
    ++counts[static_cast<int>(s)];
  }
  EXPECT_GT(counts[1], 800u);  // valid ~ 0.10
  EXPECT_LT(counts[1], 1200u);
  EXPECT_GT(counts[2], 350u);  // test ~ 0.05
  EXPECT_LT(counts[2], 650u);
  const auto train = filter_split(pairs, Split::kTrain, 0.1, 0.05);
  const auto valid = filter_split(pairs, Split::kValid, 0.1, 0.05);
  const auto test = filter_split(pairs, Split::kTest, 0.1, 0.05);
  EXPECT_EQ(train.size(), counts[0]);
  EXPECT_EQ(valid.size(), counts[1]);
  EXPECT_EQ(test.size(), counts[2]);
  EXPECT_EQ(filter_split(pairs, Split::kTrain, 0, 0).size(), pairs.size());
  EXPECT_THROW(split_of_sentence(pairs[0].en, 0.7, 0.5), nebula::Error);
  EXPECT_THROW(split_of_sentence(pairs[0].en, -0.1, 0), nebula::Error);
  EXPECT_THROW(assign_splits(pairs, -0.1, 0), nebula::Error);
}

// English sentences with the given split under (valid, test) = (0.2, 0.2), found by search.
std::vector<std::string> sentences_in(Split which, size_t n) {
  std::vector<std::string> out;
  for (int i = 0; out.size() < n; ++i) {
    std::string en = "message " + std::to_string(i);
    if (split_of_sentence(en, 0.2, 0.2) == which) out.push_back(std::move(en));
  }
  return out;
}

// gettext repeats one msgid in many catalogs and languages. Keyed by the whole pair (the old
// rule), 300 English sentences in 4 languages each would land in several splits many times
// over; keyed by the English sentence, each is in one split in every language.
TEST(Splits, OneEnglishSentenceInManyLanguagesIsInOneSplit) {
  std::vector<SentencePair> pairs;
  for (int i = 0; i < 300; ++i)
    for (const char* lang : {"de", "es", "fr", "it"})
      pairs.push_back({lang, "Open the file " + std::to_string(i), std::string(lang) + " " + std::to_string(i)});
  const auto splits = assign_splits(pairs, 0.1, 0.1);
  std::map<std::string, std::set<Split>> of_en;
  size_t held_out = 0;
  for (size_t i = 0; i < pairs.size(); ++i) {
    ASSERT_TRUE(splits[i].has_value()) << pairs[i].en;  // no translation is shared: nothing left out
    of_en[pairs[i].en].insert(*splits[i]);
    held_out += *splits[i] != Split::kTrain;
  }
  for (const auto& [en, in] : of_en) EXPECT_EQ(in.size(), 1u) << en;
  EXPECT_GT(held_out, 100u);  // ~20% of 1200: the property is not met by putting all in train
  std::vector<SentencePair> by_split[3];
  for (size_t i = 0; i < pairs.size(); ++i) by_split[static_cast<int>(*splits[i])].push_back(pairs[i]);
  EXPECT_EQ(measure_split_overlap(by_split[0], by_split[1], by_split[2]).en_sentences, 0u);
}

// One translation of several msgids: it goes to the first of train, valid, test among its
// English sentences' splits, and its pairs in the other splits are left out.
TEST(Splits, ASharedTranslationIsInOneSplitAndTrainComesFirst) {
  const auto train = sentences_in(Split::kTrain, 2), valid = sentences_in(Split::kValid, 2),
             test = sentences_in(Split::kTest, 2);
  const std::vector<SentencePair> pairs = {
      {"de", test[0], "Datei"},     {"de", train[0], "Datei"},    // -> train; the test pair out
      {"de", valid[0], "Fenster"},  {"de", test[1], "Fenster"},   // -> valid; the test pair out
      {"fr", test[0], "Fichier"},                                  // alone: its English's split
      {"fr", valid[1], "Datei"},                                   // another language: its own sentence
      {"de", train[1], "Ende"},     {"de", train[1], "Schluss"},  // two translations of one msgid
  };
  const auto s = assign_splits(pairs, 0.2, 0.2);
  const std::vector<std::optional<Split>> expected = {
      std::nullopt, Split::kTrain, Split::kValid, std::nullopt, Split::kTest, Split::kValid, Split::kTrain, Split::kTrain};
  EXPECT_EQ(s, expected);
  EXPECT_EQ(filter_split(pairs, Split::kTest, 0.2, 0.2), (std::vector<SentencePair>{pairs[4]}));
  // The rule looks only at the translation's own language: the de decisions do not change
  // when fr is left out (as on a site that holds de only).
  std::vector<SentencePair> de;
  for (const auto& p : pairs)
    if (p.lang == "de") de.push_back(p);
  for (const Split w : {Split::kTrain, Split::kValid, Split::kTest})
    EXPECT_EQ(filter_split(de, w, 0.2, 0.2), select_languages(filter_split(pairs, w, 0.2, 0.2), {"de"}));
}

// The overlap is counted from the pairs, so a leaky split shows up (stats.json reports it).
TEST(Splits, OverlapIsMeasuredNotAssumed) {
  const std::vector<SentencePair> train = {{"de", "Open", "Öffnen"}, {"fr", "Name", "Nom"}};
  const std::vector<SentencePair> valid = {{"fr", "Open", "Ouvrir"}, {"de", "Close", "Öffnen"}};
  const std::vector<SentencePair> test = {{"de", "Nom", "Vorname"}, {"it", "Save", "Öffnen"}};
  const SplitOverlap o = measure_split_overlap(train, valid, test);
  EXPECT_EQ(o.en_sentences, 1u);     // Open
  EXPECT_EQ(o.other_sentences, 1u);  // (de, Öffnen); (it, Öffnen) is another language's sentence
  EXPECT_EQ(o.texts, 3u);            // Open, Öffnen, Nom (a translation in train, English in test)
  EXPECT_EQ(measure_split_overlap(train, {}, {}).texts, 0u);
}

// The property on the real catalogs: many msgids recur across catalogs and languages there,
// and no sentence of either language is in two splits.
TEST(Splits, RealCatalogsNoSentenceInTwoSplits) {
  for (const char* lang : {"de", "fr"})
    if (!std::filesystem::exists(std::string("/usr/share/locale/") + lang + "/LC_MESSAGES"))
      GTEST_SKIP() << "no " << lang << " catalogs on this machine";
  CorpusBuildOptions opt;
  opt.languages = {"de", "fr"};  // every pair: a cap would pick different msgids per language
  const Corpus c = build_corpus(opt);
  // The data makes the property non-trivial: English sentences shared by languages, and
  // translations shared by msgids.
  std::map<std::string, std::set<std::string>> langs_of_en;
  std::map<std::pair<std::string, std::string>, size_t> uses_of_other;
  for (const auto* split : {&c.train, &c.valid, &c.test})
    for (const auto& p : *split) {
      langs_of_en[p.en].insert(p.lang);
      ++uses_of_other[{p.lang, p.other}];
    }
  size_t shared_en = 0, shared_other = 0;
  for (const auto& [en, ls] : langs_of_en) shared_en += ls.size() > 1;
  for (const auto& [o, n] : uses_of_other) shared_other += n > 1;
  // (here: 38237 English sentences in both languages, 1316 translations kept for several msgids)
  EXPECT_GT(shared_en, 10000u);
  EXPECT_GT(shared_other, 100u);
  EXPECT_GT(c.stats.split_conflicts_dropped, 0u);
  // Checked here directly, independently of measure_split_overlap.
  std::map<std::string, std::set<int>> en_in;
  std::map<std::pair<std::string, std::string>, std::set<int>> other_in;
  int i = 0;
  for (const auto* split : {&c.train, &c.valid, &c.test}) {
    ASSERT_GT(split->size(), 300u);
    for (const auto& p : *split) {
      en_in[p.en].insert(i);
      other_in[{p.lang, p.other}].insert(i);
    }
    ++i;
  }
  for (const auto& [en, in] : en_in) ASSERT_EQ(in.size(), 1u) << en;
  for (const auto& [o, in] : other_in) ASSERT_EQ(in.size(), 1u) << o.first << " " << o.second;
  EXPECT_EQ(c.overlap.en_sentences, 0u);
  EXPECT_EQ(c.overlap.other_sentences, 0u);
}

TEST(Splits, TakeSliceIsDisjointAndComplete) {
  const auto pairs = synthetic_pairs(3000);
  std::multiset<SentencePair> seen;
  for (size_t i = 0; i < 3; ++i) {
    const auto slice = take_slice(pairs, i, 3);
    EXPECT_GT(slice.size(), 850u);
    EXPECT_LT(slice.size(), 1150u);
    EXPECT_EQ(take_slice(pairs, i, 3), slice);
    seen.insert(slice.begin(), slice.end());
  }
  EXPECT_EQ(seen.size(), pairs.size());  // multiset: a pair in two slices would count twice
  EXPECT_EQ(std::set<SentencePair>(seen.begin(), seen.end()), std::set<SentencePair>(pairs.begin(), pairs.end()));
  EXPECT_EQ(take_slice(pairs, 0, 1), pairs);
  EXPECT_THROW(take_slice(pairs, 3, 3), nebula::Error);
  EXPECT_THROW(take_slice(pairs, 0, 0), nebula::Error);
}

TEST(Splits, SelectLanguages) {
  const auto pairs = synthetic_pairs(30);
  const auto de = select_languages(pairs, {"de"});
  EXPECT_EQ(de.size(), 10u);
  for (const auto& p : de) EXPECT_EQ(p.lang, "de");
  EXPECT_EQ(select_languages(pairs, {"de", "fr"}), pairs);
  EXPECT_EQ(select_languages(pairs, {}), pairs);
  EXPECT_TRUE(select_languages(pairs, {"es"}).empty());
}

}  // namespace
}  // namespace nebula::data

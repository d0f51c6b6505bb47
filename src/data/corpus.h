// Parallel corpora (English -> another language) for the multilingual and translation
// models: built from the gettext catalogs installed on a machine, or read from text/TSV
// files; plus deterministic train/valid/test splits and per-site slices.
//
// Determinism: every choice here (subsets, splits, slices) depends only on the bytes of
// a pair (for splits: of its sentences, and of the other pairs of its language), through a
// 64-bit FNV-1a hash implemented locally, so every machine and every run makes the same choice. Nothing depends on std::hash, iteration order of unordered
// containers, locale or time.
//
// Thread safety: free functions without shared state; safe to call concurrently.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace nebula::data {

// One sentence pair. `lang` is the language of `other` as named by the source, e.g.
// the gettext locale directory name ("de", "pt_BR", "sr@latin").
struct SentencePair {
  std::string lang;
  std::string en;
  std::string other;

  auto operator<=>(const SentencePair&) const = default;
  bool operator==(const SentencePair&) const = default;
};

// Turns a UI message into plain sentence text. Rules, applied in this order:
//  1. control characters (\n, \t, \r, ...) and no-break spaces (U+00A0, U+202F)
//     become spaces; a leading argument name between bars, as GnuPG's option help has
//     it, is removed ("|FD|write status info to this FD" -> "write status info to this FD",
//     "||Please enter the PIN" -> "Please enter the PIN"; no spaces inside, at most 39
//     bytes, text right after the second bar);
//  2. markup tags are removed: '<' [/] letter [name chars] ( '>' | '/>' | space attrs '>' ),
//     e.g. <b>, </a>, <br/>, <span weight="bold">, and also CLI placeholders like <file>;
//     "a < b" and "<=" are kept;
//  3. format specifiers are removed: printf-style (%s, %d, %-5.2f, %1$s, %lu, %'d, %*d),
//     Python %(name)s, strftime (%B, %-d, %Ey), Qt %1..%99, and specifiers escaped
//     for a second formatting pass ("%%s"); otherwise "%%" becomes "%" ("%%0A", GnuPG's
//     encoded newline, becomes a space); a '%' not starting a specifier is kept
//     ("50 %", "100%"); the space flag is not recognised ("100% done" stays);
//  4. brace placeholders are removed: {0}, {}, {name}, {0:>8}, {x!r}, and ${var} with its '$';
//  5. menu mnemonics are removed: '_' or '&' that starts a word (preceded by the start
//     or a non-alphanumeric ASCII character) and is followed by a letter or digit
//     ("_File" -> "File", "&Open" -> "Open", "Save _As" -> "Save As"); "a & b",
//     "AT&T", "file_name" and HTML entities are kept; East Asian "(_O)"/"(&O)" groups
//     are removed whole ("打开(_O)" -> "打开");
//  6. the entities &amp; &lt; &gt; &quot; &apos; &nbsp; are decoded;
//  7. empty quote/bracket pairs left by removed placeholders are removed: '' "" `' ``
//     () [] <> «» »« „“ “” ‘’ ‚‘ 「」 (spaces inside allowed only for `' () [] <> «» 「」,
//     so the gap in "'a' 'b'" is kept), e.g. "cannot open '%s'" -> "cannot open";
//  8. whitespace runs collapse to one space, and vanish where something was removed
//     right before closing punctuation ("in %s." -> "in.", "file %s: x" -> "file: x")
//     or right inside quotes ("the 'PROT %s' command" -> "the 'PROT' command",
//     "Run '%s --help'" -> "Run '--help'"; a quote, ASCII or typographic, opens after the
//     start, a space or '(' and closes before the end, a space or punctuation);
//     the result is trimmed; then, repeatedly,
//     a trailing "...", "…" or ":" and a leading ":", "," or ";" are removed and the
//     result trimmed
//     ("Open File..." -> "Open File", "%s: invalid option" -> "invalid option").
// Mid-word mnemonics ("Ö_ffnen") are kept, because "max_connections" must be.
std::string clean_message(std::string_view s);

struct CorpusOptions {
  std::string locale_dir = "/usr/share/locale";
  std::vector<std::string> languages;  // empty = every language found in locale_dir
  size_t max_pairs_per_language = 0;   // 0 = no limit; else a hash-chosen subset
  size_t min_chars = 2;                // bounds on each cleaned side, in bytes
  size_t max_chars = 200;
};

struct CorpusStats {
  size_t files_read = 0;     // catalogs parsed (or the one TSV/text file read)
  size_t files_skipped = 0;  // unreadable or corrupt catalogs (each logged)
  std::vector<std::string> skipped_files;  // their paths, in the order they were tried
  size_t entries_seen = 0;     // catalog entries with a non-empty msgid (TSV/text: lines read)
  size_t entries_dropped = 0;  // untranslated, or a side empty/too short/too long after
                               // clean-up, or the translation equal to the English text
  size_t duplicates_dropped = 0;
  size_t pairs_over_cap = 0;  // deduplicated pairs left out by max_pairs_per_language
  size_t pairs_kept = 0;  // pairs gathered (before the split)
  size_t split_conflicts_dropped = 0;  // build_corpus: pairs assign_splits left out
  std::map<std::string, size_t> pairs_per_language;
};

// Sorted names of the subdirectories of `locale_dir` that hold at least one
// LC_MESSAGES/*.mo file. Throws DataError if `locale_dir` cannot be listed.
std::vector<std::string> list_gettext_languages(const std::string& locale_dir);

// Builds English -> X pairs from <locale_dir>/<lang>/LC_MESSAGES/*.mo (files in sorted
// order): msgid and translations[0] (the singular form), both cleaned by clean_message.
// A pair is dropped if either side is empty, shorter than min_chars or longer than
// max_chars (bytes), or if the translation equals the English text. Exact duplicates of
// (lang, en, other) are dropped. The result is sorted by (lang, en, other). If
// max_pairs_per_language > 0, each language keeps the pairs with the smallest hash
// (a fixed pseudo-random subset that does not favour the start of the alphabet and is
// independent of the splits and take_slice). A corrupt or unreadable catalog is skipped with
// a warning and counted in stats->files_skipped. A requested language without catalogs
// throws DataError naming the language and the directory.
std::vector<SentencePair> build_gettext_corpus(const CorpusOptions& options, CorpusStats* stats = nullptr);

// Zero-shot cross-lingual transfer (train/classifier_task.cc): which software package a
// message belongs to. The messages of the gettext domains `packages` (package "git" is
// <locale_dir>/<lang>/LC_MESSAGES/git.mo), labelled by the package's index in `packages`.
struct PackageMessage {
  std::string en;                                    // the English message (msgid), cleaned
  int label = 0;                                     // its package's index
  std::map<std::string, std::string> translations;  // language -> translation (cleaned)
};

// Every English message of the packages with a usable translation (cleaned as
// build_gettext_corpus cleans, within min_chars..max_chars, not equal to the English) in at
// least one of `languages`, with those translations (the first entry of a message wins). A
// message found in two or more of the packages is dropped: its label would be ambiguous.
// Sorted by (label, en). DataError naming the file for a package without a catalog in one of
// the languages, and naming the package for one left without messages.
std::vector<PackageMessage> read_package_messages(const std::string& locale_dir, const std::vector<std::string>& packages,
                                                  const std::vector<std::string>& languages, size_t min_chars = 2,
                                                  size_t max_chars = 200);

// One segment per line, empty lines kept (for files that must stay aligned line by line,
// such as translations and their references: an empty hypothesis is still a segment).
// A trailing '\r' is stripped; a final newline does not add an empty line. Unreadable ->
// DataError naming the path.
std::vector<std::string> read_lines(const std::string& path);

// One sentence per line. A leading UTF-8 byte-order mark and a trailing '\r' are stripped;
// lines that are empty or only spaces are skipped. The file must be UTF-8 without NUL bytes
// (a file in another encoding would train on <unk>s): else DataError("path:LINE:COL: not
// valid UTF-8 (byte 0xNN): convert ..."). Unreadable -> DataError naming the path.
std::vector<std::string> read_text_file(const std::string& path);

// Lines "en<TAB>other" (lang = default_lang) or "lang<TAB>en<TAB>other". A leading UTF-8
// byte-order mark and a trailing '\r' are stripped; lines that are empty or only spaces, and
// lines starting with '#', are skipped; fields are otherwise taken verbatim. Invalid UTF-8 is
// a DataError as in read_text_file; any other column count throws
// DataError("path:LINE: expected 2 or 3 tab-separated columns, got N (...)").
std::vector<SentencePair> read_tsv_file(const std::string& path, const std::string& default_lang);

// Writes "lang\ten\tother" lines (atomically: temp file + rename) that read_tsv_file
// reads back. Tabs, '\r' and '\n' inside fields become spaces.
void write_tsv_file(const std::string& path, const std::vector<SentencePair>& pairs);

enum class Split { kTrain, kValid, kTest };

// The split of an English sentence, from a stable 64-bit hash of its text alone
// (sentence_hash): kTest with probability test_fraction, kValid with valid_fraction, else
// kTrain. Fractions must be in [0, 1] with a sum <= 1 (else nebula::Error).
Split split_of_sentence(std::string_view en, double valid_fraction, double test_fraction);

// The split of each pair of `pairs`, or nullopt for a pair left out. Held-out sentences must
// not be trained on, and gettext catalogs repeat one English msgid in many catalogs and
// languages (and one translation for several msgids), so splits are keyed by sentence, not
// by pair:
//  1. a pair goes to the split of its English sentence (split_of_sentence), so an English
//     sentence is in one split in every catalog, language, site and job;
//  2. a translation (lang, other) that several pairs share goes to the first of train, valid,
//     test (Split's order) that one of its pairs' English sentences is in; its pairs whose
//     English sentence is in another split are left out (nullopt).
// So no English sentence and no (lang, other) sentence is in two splits. Rule 2 looks only at
// the pairs of the translation's own language, so a site reading only its own languages
// decides exactly as the whole job does, and a larger subset of a language (a higher cap)
// never moves a translation out of train. Pairs with an empty other side (text sources) are
// keyed by their English side only. Fractions as in split_of_sentence.
std::vector<std::optional<Split>> assign_splits(const std::vector<SentencePair>& pairs, double valid_fraction,
                                                double test_fraction);

// The pairs of `pairs` that assign_splits puts in split `which`, in their original order.
std::vector<SentencePair> filter_split(const std::vector<SentencePair>& pairs, Split which, double valid_fraction,
                                       double test_fraction);

// Sentences that occur in more than one of the three splits, counted from the pairs (not
// assumed from the rule): English sentences, (lang, other) sentences, and texts of either
// side regardless of language (a string that is English in one split and a translation in
// another, such as a product name, counts here only).
struct SplitOverlap {
  size_t en_sentences = 0;
  size_t other_sentences = 0;
  size_t texts = 0;
};
SplitOverlap measure_split_overlap(const std::vector<SentencePair>& train, const std::vector<SentencePair>& valid,
                                   const std::vector<SentencePair>& test);

// The pairs whose lang is in `langs`, in their original order; empty `langs` = all
// (as in CorpusOptions::languages).
std::vector<SentencePair> select_languages(const std::vector<SentencePair>& pairs,
                                           const std::vector<std::string>& langs);

// Slice `index` of `count` disjoint slices, assigned by hash (so each site gets its
// own data, independent of order and of the train/valid/test split); the union of the
// slices 0..count-1 is `pairs`. Order is kept. Requires count > 0 and index < count.
std::vector<SentencePair> take_slice(const std::vector<SentencePair>& pairs, size_t index, size_t count);

// Keeps at most `max` pairs of each language (the same hash-chosen subset as
// max_pairs_per_language: the pairs with the smallest subset hash), in their original
// order; 0 = all. Returns how many were left out.
size_t cap_per_language(std::vector<SentencePair>& pairs, size_t max);

// --- nebula corpus build: any source -> deduplicated, split, counted --------------------

struct CorpusBuildOptions {
  std::string source = "gettext";      // gettext | tsv | text
  std::string path;                    // gettext: the locale directory ("" = /usr/share/locale);
                                       // tsv, text: the file
  std::vector<std::string> languages;  // empty = every language found; not allowed for text
  size_t max_pairs_per_language = 0;   // 0 = all; else a hash-chosen subset per language
  double valid_fraction = 0.05;        // each in [0, 1], their sum < 1 (the rest is train)
  double test_fraction = 0.05;
};

// Size of one language's share of one split. Characters are Unicode code points (bytes
// that do not continue a UTF-8 sequence), so "Öffnen" counts 6.
struct SplitStats {
  size_t pairs = 0;
  size_t en_chars = 0;
  size_t other_chars = 0;
};

struct Corpus {
  // Disjoint by sentence (assign_splits), each sorted by (lang, en, other).
  std::vector<SentencePair> train, valid, test;
  SplitOverlap overlap;  // measured on train, valid, test
  CorpusStats stats;  // how the pairs were gathered
  // Per language: [0] train, [1] valid, [2] test (the order of Split).
  std::map<std::string, std::array<SplitStats, 3>> split_stats;
};

// Gathers the pairs of `options.source`, deduplicates them, keeps at most
// max_pairs_per_language per language and splits them with assign_splits (the pairs it leaves
// out are counted in stats.split_conflicts_dropped).
//  * gettext: build_gettext_corpus (clean_message on both sides; corrupt catalogs skipped
//    with a warning naming the file and listed in stats.skipped_files);
//  * tsv: read_tsv_file, fields verbatim (a user's own text is not "cleaned"); 2-column
//    lines get the language "xx", as in training; `languages` selects;
//  * text: read_text_file, each line a pair {"text", line, ""} (monolingual, as in training).
// For tsv and text, exact duplicates are dropped and the per-language subset is chosen as
// for gettext. The same input always gives the same Corpus. Throws DataError for
// unreadable input or a requested language without pairs, nebula::Error for bad options.
Corpus build_corpus(const CorpusBuildOptions& options);

// Writes dir/train.tsv, dir/valid.tsv, dir/test.tsv (write_tsv_file: "lang<TAB>en<TAB>other",
// read back by read_tsv_file) and dir/stats.json (corpus_stats_json), creating dir.
// Byte-identical for the same Corpus and options. Throws DataError naming the file.
void write_corpus(const std::string& dir, const Corpus& corpus, const CorpusBuildOptions& options);

// stats.json: the options, the gathering counts, the pairs the split left out, the measured
// overlap between splits (Corpus::overlap), and per language and split the pairs and
// characters of each side. Keys sorted; no times or output paths, so reruns are identical.
std::string corpus_stats_json(const Corpus& corpus, const CorpusBuildOptions& options);

// The table `nebula corpus build` prints: a summary line, then per language the pairs in each
// split and the average length of each side in characters, then the totals.
std::string format_corpus_stats(const Corpus& corpus, const CorpusBuildOptions& options);

// The stable hash used above: FNV-1a 64 over lang, '\0', en, '\0', other, '\0', salt,
// followed by a 64-bit finalizer so that all bits are well mixed. Exposed for tests and
// for callers that need their own stable choices (use a new salt).
uint64_t pair_hash(const SentencePair& p, uint64_t salt);
// The same over one sentence: FNV-1a 64 over text, '\0', salt, then the finalizer.
uint64_t sentence_hash(std::string_view text, uint64_t salt);

}  // namespace nebula::data

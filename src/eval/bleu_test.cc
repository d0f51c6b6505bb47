#include "eval/bleu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::eval {
namespace {

// --- 13a tokenization -------------------------------------------------------------------

TEST(Tokenize13a, Punctuation) {
  EXPECT_EQ(tokenize_13a("Hello, world!"), "Hello , world !");
  EXPECT_EQ(tokenize_13a("Is it (really) 50%?"), "Is it ( really ) 50 % ?");
  EXPECT_EQ(tokenize_13a("a/b;c:d"), "a / b ; c : d");
  EXPECT_EQ(tokenize_13a("snake_case [x] {y} a|b ~ ^"), "snake _ case [ x ] { y } a | b ~ ^");
  EXPECT_EQ(tokenize_13a("The end."), "The end .");
  EXPECT_EQ(tokenize_13a("U.S.A."), "U . S . A .");
  EXPECT_EQ(tokenize_13a("a,b"), "a , b");
  EXPECT_EQ(tokenize_13a("Wait..."), "Wait . . .");
}

TEST(Tokenize13a, NumbersKeepInnerCommasAndPeriods) {
  EXPECT_EQ(tokenize_13a("1,000.5"), "1,000.5");
  EXPECT_EQ(tokenize_13a("It costs $1,000.50."), "It costs $ 1,000.50 .");
  EXPECT_EQ(tokenize_13a("pi is 3.14, not 3."), "pi is 3.14 , not 3 .");
  EXPECT_EQ(tokenize_13a("version .5 and 5."), "version . 5 and 5 .");
  // Regex semantics: "a." is one match, so the ',' after it is judged only by what follows.
  EXPECT_EQ(tokenize_13a("a.,5"), "a . ,5");
}

TEST(Tokenize13a, Dashes) {
  EXPECT_EQ(tokenize_13a("well-known"), "well-known");
  EXPECT_EQ(tokenize_13a("pages 10-20"), "pages 10 - 20");
  EXPECT_EQ(tokenize_13a("x-2 and 2-x"), "x-2 and 2 - x");
  EXPECT_EQ(tokenize_13a("a - b"), "a - b");
  EXPECT_EQ(tokenize_13a("line-\nbreak"), "linebreak");  // a hyphenated line break is joined
  EXPECT_EQ(tokenize_13a("two\nlines"), "two lines");
}

TEST(Tokenize13a, QuotesEntitiesAndSkippedTags) {
  EXPECT_EQ(tokenize_13a("He said \"hi\""), "He said \" hi \"");
  EXPECT_EQ(tokenize_13a("don't 'quote' me"), "don't 'quote' me");  // the apostrophe is not split
  EXPECT_EQ(tokenize_13a("&quot;Hi&quot;"), "\" Hi \"");
  EXPECT_EQ(tokenize_13a("Fish&amp;Chips"), "Fish & Chips");
  EXPECT_EQ(tokenize_13a("&lt;b&gt;"), "< b >");
  EXPECT_EQ(tokenize_13a("&amp;quot;"), "& quot ;");  // decoded once, in order: not twice
  EXPECT_EQ(tokenize_13a("a <skipped> b"), "a b");
}

TEST(Tokenize13a, WhitespaceAndNonAscii) {
  EXPECT_EQ(tokenize_13a(""), "");
  EXPECT_EQ(tokenize_13a("   "), "");
  EXPECT_EQ(tokenize_13a("  many \t  spaces \r\n"), "many spaces");
  EXPECT_EQ(tokenize_13a("Öffnen, schließen."), "Öffnen , schließen .");
  EXPECT_EQ(tokenize_13a("a\xc2\xa0" "b\xe3\x80\x80" "c"), "a b c");  // U+00A0, U+3000 separate
  EXPECT_EQ(tokenize_13a("«Bonjour»"), "«Bonjour»");                 // non-ASCII symbols stay
}

// The mteval-v13a rules are published as four regular expressions (in mteval-v13a.pl, and
// so in sacreBLEU). This states them in Python's regex syntax and checks our hand-written
// scanner against Python's regex engine on generated text full of the corner cases
// (digits next to '.', ',', '-'; entities; non-ASCII and Unicode spaces).
TEST(Tokenize13a, MatchesTheRegexRulesOnGeneratedText) {
  if (std::system("python3 -c 'import re' > /dev/null 2>&1") != 0) GTEST_SKIP() << "python3 is not installed";
  nebula::testing::TempDir dir("tok13a");
  const std::string script = R"(import re, sys
rules = [(r'([\{-\~\[-\` -\&\(-\+\:-\@\/])', r' \1 '), (r'([^0-9])([\.,])', r'\1 \2 '),
         (r'([\.,])([^0-9])', r' \1 \2'), (r'([0-9])(-)', r'\1 \2 ')]
lines = open(sys.argv[1], encoding='utf-8', newline='').read().split('\n')[:-1]
with open(sys.argv[2], 'w', encoding='utf-8', newline='') as out:
    for line in lines:
        line = line.rstrip()
        for a, b in (('<skipped>', ''), ('-\n', ''), ('\n', ' '), ('&quot;', '"'), ('&amp;', '&'),
                     ('&lt;', '<'), ('&gt;', '>')):
            line = line.replace(a, b)
        line = ' ' + line + ' '
        for pattern, repl in rules:
            line = re.sub(pattern, repl, line)
        out.write(' '.join(line.split()) + '\n')
)";
  std::ofstream(dir.file("rules.py")) << script;
  const std::vector<std::string> atoms = {
      "a",  "Z",  "0",  "1",  "9",  ".",  ",",   "-",      "'",     "\"",    "&",        "&quot;", "&amp;", "&lt;",
      "&gt;", "<skipped>", " ", "  ", "\t", "\r", "$",  "%", "(", ")", "/", ":", "_", "@", "[", "~", "{", "|",
      "\xc3\xa9" /* é */, "\xe4\xb8\xad" /* 中 */, "\xc2\xa0" /* U+00A0 */, "\xe3\x80\x80" /* U+3000 */,
      "\xe2\x80\x89" /* U+2009 */, "\xc2\xab" /* « */, "word", "12,5", "3.14"};
  std::mt19937 rng(13);
  std::vector<std::string> inputs;
  for (int i = 0; i < 3000; ++i) {
    std::string s;
    const size_t len = rng() % 12;
    for (size_t k = 0; k < len; ++k) s += atoms[rng() % atoms.size()];
    inputs.push_back(s);
  }
  {
    std::ofstream in(dir.file("in.txt"), std::ios::binary);
    for (const auto& s : inputs) in << s << '\n';
  }
  const std::string cmd = "python3 " + dir.file("rules.py") + " " + dir.file("in.txt") + " " + dir.file("out.txt");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream out(dir.file("out.txt"), std::ios::binary);
  std::string expected;
  for (const auto& s : inputs) {
    ASSERT_TRUE(std::getline(out, expected));
    ASSERT_EQ(tokenize_13a(s), expected) << "input: [" << s << "]";
  }
}

// --- BLEU -------------------------------------------------------------------------------

TEST(Bleu, IdenticalIs100) {
  const BleuScore s =
      corpus_bleu({"the cat sat on the mat", "Hello, world!"}, {"the cat sat on the mat", "Hello, world!"});
  EXPECT_DOUBLE_EQ(s.score, 100.0);
  EXPECT_EQ(s.counts, (std::array<size_t, 4>{10, 8, 6, 4}));  // 6 + 4 tokens ("Hello , world !")
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{10, 8, 6, 4}));
  EXPECT_EQ(s.bp, 1.0);
  EXPECT_EQ(s.sys_len, 10u);
  EXPECT_EQ(s.ref_len, 10u);
}

TEST(Bleu, EmptyHypothesesAndEmptyCorpusScoreZero) {
  BleuScore s = corpus_bleu({""}, {"the cat"});
  EXPECT_EQ(s.score, 0.0);
  EXPECT_EQ(s.sys_len, 0u);
  EXPECT_EQ(s.ref_len, 2u);
  EXPECT_EQ(s.bp, 0.0);
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{0, 0, 0, 0}));
  s = corpus_bleu({"", "  "}, {"a b", "c"}, {BleuSmoothing::kExp});
  EXPECT_EQ(s.score, 0.0);

  s = corpus_bleu(std::vector<std::string>{}, std::vector<std::string>{});
  EXPECT_EQ(s.score, 0.0);
  EXPECT_EQ(s.sys_len, 0u);
  EXPECT_EQ(s.ref_len, 0u);
  EXPECT_EQ(s.ratio(), 0.0);
  EXPECT_EQ(s.format(),
            "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:none|version:nebula = 0.00 0.0/0.0/0.0/0.0 "
            "(BP = 1.000 ratio = 0.000 hyp_len = 0 ref_len = 0)");
}

TEST(Bleu, HandComputedScore) {
  // hyp "the cat sat on a mat" vs ref "the cat sat on the mat", 6 tokens each:
  //   1-grams: the cat sat on mat match, "a" does not            5/6
  //   2-grams: the cat, cat sat, sat on (not "on a", "a mat")    3/5
  //   3-grams: the cat sat, cat sat on                           2/4
  //   4-grams: the cat sat on                                    1/3
  //   BP = 1 (6 = 6); BLEU = (5/6 * 3/5 * 1/2 * 1/3)^(1/4) = (1/12)^(1/4) = 0.537284966
  const BleuScore s = corpus_bleu({"the cat sat on a mat"}, {"the cat sat on the mat"});
  EXPECT_EQ(s.counts, (std::array<size_t, 4>{5, 3, 2, 1}));
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{6, 5, 4, 3}));
  EXPECT_NEAR(s.precisions[0], 100.0 * 5 / 6, 1e-12);
  EXPECT_NEAR(s.precisions[3], 100.0 / 3, 1e-12);
  EXPECT_NEAR(s.score, 100.0 * std::pow(1.0 / 12, 0.25), 1e-10);
  EXPECT_NEAR(s.score, 53.7284966, 1e-6);
  EXPECT_EQ(s.format(),
            "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:none|version:nebula = 53.73 83.3/60.0/50.0/33.3 "
            "(BP = 1.000 ratio = 1.000 hyp_len = 6 ref_len = 6)");
}

TEST(Bleu, BrevityPenalty) {
  // hyp "the cat sat on" (c = 4) is all correct, ref has r = 6 tokens:
  //   precisions 4/4, 3/3, 2/2, 1/1; BP = exp(1 - 6/4) = exp(-0.5) = 0.6065307
  const BleuScore s = corpus_bleu({"the cat sat on"}, {"the cat sat on the mat"});
  EXPECT_NEAR(s.bp, std::exp(-0.5), 1e-15);
  EXPECT_NEAR(s.score, 100 * std::exp(-0.5), 1e-10);
  EXPECT_NEAR(s.ratio(), 4.0 / 6, 1e-15);
  // A longer hypothesis is not penalised for length (only through precision).
  EXPECT_EQ(corpus_bleu({"the cat sat on the mat today"}, {"the cat sat on the mat"}).bp, 1.0);
}

TEST(Bleu, ClippingAndSmoothing) {
  // Papineni's example: "the" x7 against a reference with two "the": unigram precision 2/7;
  // no bigram matches (6 bigrams "the the"), nor trigrams (5), nor 4-grams (4).
  const std::vector<std::string> hyp = {"the the the the the the the"};
  const std::vector<std::string> ref = {"the cat is on the mat"};
  BleuScore s = corpus_bleu(hyp, ref);
  EXPECT_EQ(s.counts, (std::array<size_t, 4>{2, 0, 0, 0}));
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{7, 6, 5, 4}));
  EXPECT_NEAR(s.precisions[0], 100.0 * 2 / 7, 1e-12);
  EXPECT_EQ(s.score, 0.0);  // no smoothing: an order without matches gives 0
  // exp: the k-th order without matches counts 1 / (2^k total): 1/12, 1/20, 1/32.
  s = corpus_bleu(hyp, ref, {BleuSmoothing::kExp});
  EXPECT_NEAR(s.precisions[1], 100.0 / 12, 1e-12);
  EXPECT_NEAR(s.score, 100 * std::pow(2.0 / 7 / 12 / 20 / 32, 0.25), 1e-10);  // 7.8098
  // floor 0.1: 0.1/6, 0.1/5, 0.1/4.
  s = corpus_bleu(hyp, ref, {BleuSmoothing::kFloor, 0.1});
  EXPECT_NEAR(s.score, 100 * std::pow(2.0 / 7 * (0.1 / 6) * (0.1 / 5) * (0.1 / 4), 0.25), 1e-10);  // 3.9281
  EXPECT_NE(s.format().find("smooth:floor[0.10]"), std::string::npos) << s.format();
  // Nothing matches at all: 0 whatever the smoothing (sacreBLEU 2.x).
  EXPECT_EQ(corpus_bleu({"x y z w"}, {"a b c d"}, {BleuSmoothing::kExp}).score, 0.0);
  // Every hypothesis shorter than 4 tokens: no 4-grams at all, 0 even with smoothing.
  EXPECT_EQ(corpus_bleu({"a b c"}, {"a b c"}, {BleuSmoothing::kExp}).score, 0.0);
}

TEST(Bleu, CountsAreSummedOverTheCorpusNotAveraged) {
  // Segment 1 alone would score 0 (no 4-gram), but corpus BLEU pools the counts.
  const BleuScore s = corpus_bleu({"a b c", "d e f g h"}, {"a b c", "d e f g h"});
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{8, 6, 4, 2}));
  EXPECT_DOUBLE_EQ(s.score, 100.0);
}

// Values published with sacreBLEU's own tests.
TEST(Bleu, AgreesWithSacreBleuReferenceValues) {
  // Its test_statistics case.
  BleuScore s = corpus_bleu({"am I am a character sequence"}, {"I am a symbol string sequence a a"});
  EXPECT_EQ(s.counts, (std::array<size_t, 4>{4, 2, 1, 0}));
  EXPECT_EQ(s.totals, (std::array<size_t, 4>{6, 5, 4, 3}));
  // Its test_scoring case: compute_bleu([9,7,5,3], [10,8,6,4], 11, 11) = 0.8375922397.
  EXPECT_NEAR(compute_bleu({9, 7, 5, 3}, {10, 8, 6, 4}, 11, 11).score, 83.75922397, 1e-8);
  // Its README example: two reference sets, one hypothesis with an apostrophe; 13a and
  // no tokenization (a different score, because "man." stays one token).
  const std::vector<std::string> hyps = {"The dog bit the man.", "It wasn't surprising.",
                                         "The man had just bitten him."};
  const std::vector<std::vector<std::string>> refs = {
      {"The dog bit the man.", "It was not unexpected.", "The man bit him first."},
      {"The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."}};
  s = corpus_bleu_multi(hyps, refs);
  EXPECT_NEAR(s.score, 48.530827, 1e-6);
  EXPECT_EQ(s.num_refs, 2u);
  EXPECT_NEAR(corpus_bleu_multi(hyps, refs, {BleuSmoothing::kExp}).score, 48.530827, 1e-6);
  EXPECT_NEAR(corpus_bleu_multi(hyps, refs, {BleuSmoothing::kNone, 0.1, false}).score, 49.1919566, 1e-6);
  EXPECT_EQ(corpus_bleu_multi({"", "", ""}, refs).score, 0.0);
  // Its raw_corpus_bleu case: no tokenization, floor smoothing 0.01.
  EXPECT_NEAR(corpus_bleu({"this is a fest"}, {"this is a test"}, {BleuSmoothing::kFloor, 0.01, false}).score,
              22.3606797749979, 1e-9);
}

TEST(Bleu, SeveralReferencesClipByTheMaximumAndTakeTheClosestLength) {
  // "the the" is allowed twice by the second reference; lengths 3 and 5 are equally close
  // to 4: the shorter one counts.
  const BleuScore s =
      corpus_bleu_multi({"the the cat sat"}, {{"the cat sat"}, {"the the big cat sat"}}, {BleuSmoothing::kExp});
  EXPECT_EQ(s.counts[0], 4u);
  EXPECT_EQ(s.ref_len, 3u);
  // An empty reference in one set: that segment has one reference, so "nrefs:var".
  const BleuScore v = corpus_bleu_multi({"a b c d", "e f g h"}, {{"a b c d", "e f g h"}, {"a b c d", ""}});
  EXPECT_NEAR(v.score, 100.0, 1e-9);
  EXPECT_NE(v.format().find("nrefs:var"), std::string::npos) << v.format();
}

TEST(Bleu, MisalignedInputIsAnErrorNamingTheSegment) {
  EXPECT_THROW(corpus_bleu({"a", "b"}, {"a"}), nebula::Error);
  try {
    corpus_bleu({"a", "b"}, {"a", ""});
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("segment 2"), std::string::npos) << e.what();
  }
}

TEST(Bleu, PretokenizedTextSplitsOnWhitespaceOnly) {
  const BleuScore s = corpus_bleu({"Hello, world!"}, {"Hello , world !"}, {BleuSmoothing::kNone, 0.1, false});
  EXPECT_EQ(s.sys_len, 2u);
  EXPECT_EQ(s.ref_len, 4u);
  EXPECT_NE(s.format().find("tok:none"), std::string::npos);
}


TEST(Bleu, SegmentStatsSumToCorpusBleu) {
  const std::vector<std::string> h = {"the cat sat on the mat", "a dog", "open the file now please"};
  const std::vector<std::string> r = {"the cat sat on a mat", "the dog", "open the file please"};
  SegmentStats sum;
  for (const auto& s : segment_stats(h, r)) {
    for (size_t n = 0; n < 4; ++n) {
      sum.counts[n] += s.counts[n];
      sum.totals[n] += s.totals[n];
    }
    sum.sys_len += s.sys_len;
    sum.ref_len += s.ref_len;
  }
  const BleuScore whole = corpus_bleu(h, r);
  EXPECT_EQ(sum.counts, whole.counts);
  EXPECT_EQ(sum.totals, whole.totals);
  EXPECT_EQ(sum.sys_len, whole.sys_len);
  EXPECT_EQ(sum.ref_len, whole.ref_len);
}

// 200 segments; the system is the reference on the first k of them and the baseline's
// (poor) output elsewhere, so the true difference grows with k.
std::vector<std::string> mixed(const std::vector<std::string>& good, const std::vector<std::string>& bad, size_t k) {
  std::vector<std::string> out = bad;
  for (size_t i = 0; i < k; ++i) out[i] = good[i];
  return out;
}

TEST(Bleu, PairedBootstrapBracketsTheDifferenceAndExcludesZeroOnlyWhenItShould) {
  std::vector<std::string> refs, bad;
  for (int i = 0; i < 200; ++i) {
    refs.push_back("message number " + std::to_string(i) + " could not be opened for reading");
    bad.push_back("the file " + std::to_string(i % 7) + " is not opened");
  }
  // Identical systems: the difference is exactly 0 in every resample.
  PairedBootstrap same = paired_bootstrap(bad, bad, refs);
  EXPECT_EQ(same.delta, 0);
  EXPECT_EQ(same.low, 0);
  EXPECT_EQ(same.high, 0);
  EXPECT_EQ(same.segments, 200u);
  // Much better on every segment: a large positive difference, the interval far from 0.
  PairedBootstrap big = paired_bootstrap(bad, refs, refs);
  EXPECT_NEAR(big.system, 100, 1e-9);
  EXPECT_GT(big.low, 50);
  EXPECT_GE(big.high, big.delta);
  EXPECT_LE(big.low, big.delta);
  EXPECT_EQ(big.system_better, 1.0);
  // Better on 2 segments of 200: a small difference whose interval includes 0 ...
  const auto slightly = mixed(refs, bad, 2);
  PairedBootstrap small = paired_bootstrap(bad, slightly, refs);
  EXPECT_GT(small.delta, 0);
  EXPECT_LE(small.low, 0);
  // ... and the same seed gives the same interval; the systems swapped give its mirror.
  PairedBootstrap again = paired_bootstrap(bad, slightly, refs);
  EXPECT_EQ(again.low, small.low);
  EXPECT_EQ(again.high, small.high);
  PairedBootstrap swapped = paired_bootstrap(slightly, bad, refs);
  EXPECT_NEAR(swapped.delta, -small.delta, 1e-12);
  EXPECT_NEAR(swapped.low, -small.high, 1e-9);
  EXPECT_NEAR(swapped.high, -small.low, 1e-9);
  EXPECT_THROW(paired_bootstrap(bad, {"x"}, refs), nebula::Error);
}

}  // namespace
}  // namespace nebula::eval

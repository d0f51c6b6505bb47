// Corpus BLEU (Papineni et al., 2002) as sacreBLEU computes it, so that our numbers can be
// compared with published ones: mteval-v13a tokenization, n-grams of order 1..4 clipped by
// the reference counts and summed over the whole corpus, and the brevity penalty.
//
//   p_n = sum over segments of clipped matching n-grams / sum of hypothesis n-grams
//   BP  = 1 if c >= r, else exp(1 - r / c)   (c = hypothesis tokens, r = reference tokens;
//                                             BP = 0 when c = 0)
//   BLEU = 100 * BP * exp((log p_1 + ... + log p_4) / 4)
//
// With several references, an n-gram is clipped by its largest count in any of them, and
// r adds, per segment, the reference length closest to the hypothesis length (the shorter
// one on a tie), as sacreBLEU does.
//
// Degenerate cases follow sacreBLEU 2.x exactly: no matching n-gram of any order gives 0
// whatever the smoothing; an order with no hypothesis n-grams at all (every hypothesis
// shorter than n tokens) gives 0; without smoothing, one order with no match gives 0.
//
// Not implemented: lowercasing (case:lc), the intl/zh/ja tokenizers, effective order
// (sentence BLEU), add-k smoothing.
//
// Thread safety: free functions without shared state; safe to call concurrently.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace nebula::eval {

// mteval-v13a tokenization (sacreBLEU's "13a"), applied to one segment:
//  1. trailing whitespace is removed; "<skipped>" and "-\n" are deleted, other newlines
//     become spaces, and &quot; &amp; &lt; &gt; are decoded (in that order, once each);
//  2. every ASCII symbol except ' , - . is split off as its own token:
//     ! " # $ % & ( ) * + / : ; < = > ? @ [ \ ] ^ _ ` { | } ~;
//  3. '.' and ',' are split off unless they sit between two digits ("1,000.5" stays one
//     token, "end." and "a,b" are split);
//  4. '-' is split off after a digit ("2-3" -> "2 - 3"; "well-known" stays);
//  5. tokens are separated by single spaces; whitespace is what Python's str.split() takes
//     (ASCII, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000).
// Rules 3 and 4 behave as the reference regular expressions do, including their
// left-to-right, non-overlapping matching: "a.,5" -> "a . ,5" (the ',' is not split: the
// match "a." consumed what precedes it, and a digit follows it). Non-ASCII text passes
// through unchanged.
std::string tokenize_13a(std::string_view segment);

enum class BleuSmoothing {
  kNone,   // an order with no match makes BLEU 0
  kExp,    // mteval's: the k-th order without matches counts 1 / (2^k * total_n) (sacreBLEU's default)
  kFloor,  // an order without matches counts floor_value / total_n
};

struct BleuOptions {
  BleuSmoothing smoothing = BleuSmoothing::kNone;
  double floor_value = 0.1;  // kFloor only (sacreBLEU's default)
  bool tokenize = true;      // 13a; false = the text is already tokenized: split on whitespace
};

struct BleuScore {
  double score = 0;                     // 0..100
  std::array<double, 4> precisions{};   // p_1..p_4 in percent (after smoothing)
  std::array<size_t, 4> counts{};       // clipped matching n-grams, n = 1..4
  std::array<size_t, 4> totals{};       // hypothesis n-grams, n = 1..4
  double bp = 0;                        // brevity penalty
  size_t sys_len = 0;                   // hypothesis tokens
  size_t ref_len = 0;                   // (closest) reference tokens
  size_t num_refs = 1;                  // references per segment (0 = it varies)
  BleuOptions options;

  double ratio() const { return ref_len ? static_cast<double>(sys_len) / static_cast<double>(ref_len) : 0.0; }
  // sacreBLEU's signature: "nrefs:1|case:mixed|eff:no|tok:13a|smooth:none|version:nebula".
  std::string signature() const;
  // sacreBLEU's score line, e.g.
  // "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:none|version:nebula = 48.53 82.4/50.0/38.9/28.6
  //  (BP = 1.000 ratio = 1.000 hyp_len = 17 ref_len = 17)" (one line).
  std::string format() const;
};

// BLEU from the corpus statistics (sacreBLEU's compute_bleu).
BleuScore compute_bleu(const std::array<size_t, 4>& counts, const std::array<size_t, 4>& totals, size_t sys_len,
                       size_t ref_len, const BleuOptions& options = {});

// Corpus BLEU of `hypotheses` against one reference per segment. Sizes must match (else
// nebula::Error with both sizes). An empty hypothesis is a segment with no tokens; an empty
// reference is refused (DataError naming the segment, 1-based), as sacreBLEU does: it
// usually means the files are misaligned. An empty corpus scores 0.
BleuScore corpus_bleu(const std::vector<std::string>& hypotheses, const std::vector<std::string>& references,
                      const BleuOptions& options = {});

// Several references per segment: reference_sets[k][i] is the k-th reference of segment i,
// each set as long as `hypotheses`. Empty strings are left out (segments may have fewer
// references); a segment whose references are all empty is a DataError.
// (A separate name: with one overload, corpus_bleu(h, {"a", "b"}) would be ambiguous.)
BleuScore corpus_bleu_multi(const std::vector<std::string>& hypotheses,
                            const std::vector<std::vector<std::string>>& reference_sets,
                            const BleuOptions& options = {});

// One segment's sufficient statistics: summing them over segments and calling compute_bleu
// gives corpus BLEU (what resampling needs).
struct SegmentStats {
  std::array<size_t, 4> counts{};
  std::array<size_t, 4> totals{};
  size_t sys_len = 0;
  size_t ref_len = 0;
};
// Per segment, one reference each (the same checks as corpus_bleu).
std::vector<SegmentStats> segment_stats(const std::vector<std::string>& hypotheses,
                                        const std::vector<std::string>& references, const BleuOptions& options = {});

// Paired bootstrap resampling (Koehn, 2004; sacreBLEU's --paired-bs): two systems' translations
// of the same segments, resampled together `samples` times with replacement.
struct BootstrapOptions {
  size_t samples = 1000;
  uint64_t seed = 12345;  // the same seed gives the same interval
  BleuOptions bleu;
};
struct PairedBootstrap {
  double baseline = 0, system = 0;  // corpus BLEU of each on the whole test set
  double delta = 0;                 // system − baseline
  double low = 0, high = 0;         // 95% interval of the difference (2.5th and 97.5th percentiles)
  double system_better = 0;         // fraction of resamples in which the system scores higher
  size_t segments = 0, samples = 0;
};
PairedBootstrap paired_bootstrap(const std::vector<std::string>& baseline, const std::vector<std::string>& system,
                                 const std::vector<std::string>& references, const BootstrapOptions& options = {});

}  // namespace nebula::eval

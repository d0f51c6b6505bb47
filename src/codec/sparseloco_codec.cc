#include "codec/sparseloco_codec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>

#include "codec/payload.h"

namespace nebula::codec {

namespace {

using detail::fail;
using Kind = CodecError::Kind;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The chunk field's bits 24-31: bit 24 how the indices are sent (0: fixed width, 1: Rice),
// bit 25 the values' bits (0: 2, 1: 1; codec.h).
constexpr uint32_t kRiceIndices = uint32_t{1} << 24;
constexpr uint32_t kOneBitValues = uint32_t{1} << 25;
constexpr uint32_t kChunkMask = (uint32_t{1} << 24) - 1;

// Chunks per parallel work item. Every chunk but the last keeps k values, so 8 chunks take
// 8 k bits per index bit and 16 k bits of codes: whole bytes, so each work item writes
// bytes of its own in both bit streams and no two threads share one.
constexpr int64_t kGroup = 8;
constexpr int64_t kGrainValues = int64_t{1} << 16;  // values per parallel task, at least

// The order of |x| as an integer: the float's bits without the sign. NaN sorts above +inf,
// so non-finite values are always kept first.
inline uint32_t magnitude_key(float v) { return std::bit_cast<uint32_t>(v) & 0x7FFFFFFFu; }
constexpr uint32_t kInfKey = 0x7F800000u;  // keys >= this are +-inf and NaN
// Above every key: as a chunk's split, no kept value takes the high level.
constexpr uint32_t kNoSplit = 0x80000000u;

inline float key_float(uint32_t key) { return std::bit_cast<float>(key); }

// Bits per in-chunk index: ceil(log2(chunk)), 1 (chunk 2) to 16 (chunk 65536).
int index_bits(int64_t chunk) { return std::bit_width(static_cast<uint64_t>(chunk - 1)); }

// Where everything lives in a payload of `numel` values in chunks of `chunk`.
struct Layout {
  int64_t numel = 0, chunk = 2, k = 1, k_last = 0, nchunks = 0, nfull = 0;
  int bits = 1;        // per index (fixed width)
  int value_bits = 2;  // per code: 2 (sign, level) or 1 (sign; one level per chunk)
  Layout(int64_t numel_, int64_t chunk_, int64_t k_, int64_t k_last_, int value_bits_)
      : numel(numel_),
        chunk(chunk_),
        k(k_),
        k_last(k_last_),
        nchunks((numel_ + chunk_ - 1) / chunk_),
        nfull(numel_ / chunk_),
        bits(index_bits(chunk_)),
        value_bits(value_bits_) {}
  int64_t chunk_len(int64_t c) const { return std::min(chunk, numel - c * chunk); }
  int64_t chunk_k(int64_t c) const { return c < nfull ? k : k_last; }
  // Values kept in chunks before c (c < nchunks; only the last chunk may keep fewer).
  int64_t kept_before(int64_t c) const { return c * k; }
  int64_t kept() const { return nfull * k + k_last; }
  int64_t index_bytes() const { return (kept() * bits + 7) / 8; }
  int64_t code_bytes() const { return (kept() * value_bits + 7) / 8; }
  int64_t level_bytes() const { return 4 * value_bits * nchunks; }  // two levels a chunk, or one
  int64_t data_bytes() const { return level_bytes() + index_bytes() + code_bytes(); }
};

// LSB-first bit packing into a zero-padded byte stream. Writes whole 32-bit words while it
// can and the final partial bytes on flush(), so a writer owns exactly the bytes its bits
// cover.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  void put(uint32_t v, int n) {  // v < 2^n, n <= 16
    acc_ |= uint64_t{v} << fill_;
    fill_ += n;
    if (fill_ >= 32) {
      const auto word = static_cast<uint32_t>(acc_);
      std::memcpy(out_, &word, 4);
      out_ += 4;
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  void flush() {
    for (; fill_ > 0; fill_ -= 8, acc_ >>= 8) *out_++ = static_cast<uint8_t>(acc_);
    fill_ = 0;
  }
  // n one-bits (any n).
  void ones(int64_t n) {
    for (; n >= 16; n -= 16) put(0xFFFFu, 16);
    if (n > 0) put((1u << n) - 1, static_cast<int>(n));
  }
  uint8_t* end() const { return out_; }  // after flush(): one past the last byte written

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Reads what BitWriter wrote, a byte at a time and only when needed, so it never reads past
// the bytes the bits it returned cover. Given an end (a Rice stream, whose length the header
// does not fix), reading past it is kTruncated; without one the caller has checked the length.
class BitReader {
 public:
  explicit BitReader(const uint8_t* in, const uint8_t* end = nullptr) : in_(in), end_(end) {}
  uint32_t get(int n) {  // n <= 16
    while (fill_ < n) {
      if (in_ == end_) fail(Kind::kTruncated, "sparseloco payload: the Rice-coded indices end inside a value");
      acc_ |= uint64_t{*in_++} << fill_;
      fill_ += 8;
    }
    const auto v = static_cast<uint32_t>(acc_ & ((uint64_t{1} << n) - 1));
    acc_ >>= n;
    fill_ -= n;
    return v;
  }
  // After the last get: whether the rest of the last byte read (the padding) is zero.
  bool padding_zero() const { return acc_ == 0; }
  size_t left() const { return static_cast<size_t>(end_ - in_); }  // with an end: whole bytes not read

 private:
  const uint8_t* in_;
  const uint8_t* end_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// The Rice parameter of a chunk of `len` values keeping k: floor(log2(len / k)), the gaps'
// typical size (0 to 16).
int rice_param(int64_t len, int64_t k) { return std::bit_width(static_cast<uint64_t>(len / k)) - 1; }

// The most bytes a chunk's Rice-coded indices can take: the gaps sum to at most len - k, so
// the unary parts to at most (len - k) >> r bits beside k stop bits and k r-bit remainders.
int64_t rice_bits_bound(int64_t len, int64_t k) {
  const int r = rice_param(len, k);
  return k * (1 + r) + ((len - k) >> r);
}

// Selection works on runs of 16 values: a run's max is a lower bound on its values' ranks.
constexpr int64_t kRun = 16;

// Working memory for one parallel task, sized for one chunk, so no chunk allocates. It also
// carries the selection's guess from one chunk to the next.
struct Scratch {
  explicit Scratch(int64_t len)
      : run_max(new uint32_t[static_cast<size_t>(len)]),
        cand_index(new uint32_t[static_cast<size_t>(len)]),
        cand_key(new uint32_t[static_cast<size_t>(len)]),
        mags(new uint32_t[static_cast<size_t>(len)]),
        kept(new uint32_t[static_cast<size_t>(len)]) {}
  std::unique_ptr<uint32_t[]> run_max;     // the largest magnitude key of each run
  std::unique_ptr<uint32_t[]> cand_index;  // the candidates (key >= g), in index order
  std::unique_ptr<uint32_t[]> cand_key;
  std::unique_ptr<uint32_t[]> mags;  // the kept magnitude keys, sorted
  std::unique_ptr<uint32_t[]> kept;  // in-chunk indices of the kept values, increasing
  uint32_t guess = 0;                // a key a little below the last chunk's threshold
};

// The largest magnitude key of x[0, n) (a max reduction the compiler vectorises).
inline uint32_t run_max_key(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, magnitude_key(x[j]));
  return m;
}

// How many of keys[0, n) are >= g. Keys fit in 31 bits, so a signed compare does, and the
// loop vectorises.
int64_t count_at_least(const uint32_t* keys, int64_t n, uint32_t g) {
  const auto gs = static_cast<int32_t>(g);
  int32_t c = 0;  // n <= 65536
  for (int64_t i = 0; i < n; ++i) c += static_cast<int32_t>(keys[i]) >= gs;
  return c;
}

constexpr uint32_t kExponent = uint32_t{1} << 23;  // adding it to a key doubles the magnitude

// A key g with count_at_least(keys, n, g) >= k, and at most `enough` if a few bisection
// steps find one (else the best found; never fewer than k). Brackets the answer between a
// key with at least k keys at or above it (`below`) and one with fewer (`above`), starting
// from `guess`, and bisects the keys (about geometrically in |x|). Precondition: k <= n.
uint32_t bracket(const uint32_t* keys, int64_t n, int64_t k, int64_t enough, uint32_t guess) {
  uint32_t below = 0, above = kNoSplit;  // count(0) = n >= k; count(kNoSplit) = 0 < k
  uint32_t g = guess;
  for (int tries = 0; tries < 12; ++tries) {
    const int64_t c = count_at_least(keys, n, g);
    if (c >= k) {
      below = g;
      if (c <= enough) break;
    } else {
      above = g;
    }
    if (above == kNoSplit)
      g = std::min(below + kExponent, kInfKey);  // x 2
    else if (below == 0)
      g = above > 2 * kExponent ? above - 2 * kExponent : 0;  // / 4
    else
      g = below + (above - below) / 2;
    if (g == below || g == above) break;
  }
  return below;
}

// The guess for the next chunk: 0.85 of this chunk's threshold. Chunks of one tensor look
// alike, so the first count is usually within the band.
inline uint32_t next_guess(uint32_t threshold) {
  const float t = key_float(std::min(threshold, kInfKey - 1));
  return magnitude_key(t * 0.85f);
}

// How one chunk is sent: its kept values (s.kept[0, k)) and two magnitude levels. A kept
// value takes `hi` when its magnitude key is >= split, else `lo`; each level is the mean of
// its group, and spread is its group's max - min magnitude (the error bound).
struct ChunkCode {
  float lo = 0, hi = 0, lo_spread = 0, hi_spread = 0;
  uint32_t split = kNoSplit;
  bool finite = true;
};

// The mean of the magnitudes keys[0, n), kept within [min, max] of them against rounding.
float group_mean(const uint32_t* keys, int64_t n) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += key_float(keys[j]);
  return std::clamp(static_cast<float>(sum / static_cast<double>(n)), key_float(keys[0]), key_float(keys[n - 1]));
}

// Selects the k largest magnitudes of x[0, n) (ties to lower indices) into s.kept and
// chooses the levels (one, the mean of the kept magnitudes, unless `two_levels`).
// Precondition: 1 <= k <= n.
//
// Selection without sorting or histograms: if g is a key with at least k run maxima at or
// above it, at least k values are (one per such run), so the threshold (the k-th largest
// key) is >= g and every kept value is among the values >= g, which lie in those runs. A
// vectorised pass takes the run maxima (1/16 of the chunk); a bisection over them, from a
// guess left by the previous chunk, finds a g with about k to 2k runs above it; the values
// >= g in those runs are gathered in index order, nth_element on their keys gives the
// threshold, and the candidates, walked in order, the kept indices. The guess only affects
// speed: the result is the exact top k whatever it is. When k is more than half the runs
// (density above 1/32), each value is its own run.
ChunkCode code_chunk(const float* x, int64_t n, int64_t k, Scratch& s, bool two_levels) {
  uint32_t* run_max = s.run_max.get();
  const int64_t run = 2 * k <= (n + kRun - 1) / kRun ? kRun : 1;
  const int64_t nruns = (n + run - 1) / run;
  if (run == kRun) {
    for (int64_t j = 0; j < n / kRun; ++j) run_max[j] = run_max_key(x + j * kRun, kRun);
    if (n % kRun) run_max[nruns - 1] = run_max_key(x + (nruns - 1) * kRun, n % kRun);
  } else {
    for (int64_t i = 0; i < n; ++i) run_max[i] = magnitude_key(x[i]);
  }
  uint32_t guess = s.guess;
  if (guess == 0) {  // no previous chunk (or an all-zero one): start at half the largest |x|
    const uint32_t mx = *std::max_element(run_max, run_max + nruns);
    guess = mx > kExponent ? mx - kExponent : 0;
  }
  const uint32_t g = bracket(run_max, nruns, k, 2 * k + 2, guess);
  uint32_t* cand_index = s.cand_index.get();
  uint32_t* cand_key = s.cand_key.get();
  int64_t m = 0;
  for (int64_t j = 0; j < nruns; ++j) {
    if (run_max[j] < g) continue;
    const int64_t end = std::min(n, (j + 1) * run);
    for (int64_t i = j * run; i < end; ++i) {  // branch-free: write always, keep if >= g
      const uint32_t key = magnitude_key(x[i]);
      cand_index[m] = static_cast<uint32_t>(i);
      cand_key[m] = key;
      m += key >= g;
    }
  }
  NEBULA_CHECK(m >= k, "sparseloco gathered ", m, " candidates for k = ", k);
  // The k largest candidate keys end up in mags[0, k): exactly the kept magnitudes.
  uint32_t* mags = s.mags.get();
  std::copy(cand_key, cand_key + m, mags);
  std::nth_element(mags, mags + (k - 1), mags + m, std::greater<uint32_t>());
  const uint32_t threshold = mags[k - 1];
  int64_t greater = 0;  // nth_element leaves only keys >= the threshold before it
  for (int64_t j = 0; j < k - 1; ++j) greater += mags[j] > threshold;
  int64_t equal_left = k - greater, kept = 0;
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t key = cand_key[j];
    bool take = key > threshold;
    if (key == threshold && equal_left > 0) {
      take = true;
      --equal_left;
    }
    if (take) s.kept[kept++] = cand_index[j];
  }
  NEBULA_CHECK(kept == k, "sparseloco selected ", kept, " values in a chunk, expected ", k);
  s.guess = next_guess(threshold);

  ChunkCode cc;
  std::sort(mags, mags + k);
  // Non-finite keys rank highest, so the largest kept one says whether the chunk holds one.
  if (mags[k - 1] >= kInfKey) {
    cc.finite = false;
    cc.lo = cc.hi = kNaN;
    return cc;
  }
  // The best two-level quantiser of sorted values cuts them into a low and a high run, each
  // sent as its mean: the cut j maximises S_lo^2 / j + S_hi^2 / (k - j) (the squared error
  // is sum v^2 minus that). Equal magnitudes never straddle the cut, so the split key alone
  // tells a value's level. No cut (k = 1, or all equal): one level, sent exactly.
  double total = 0;
  for (int64_t j = 0; j < k; ++j) total += key_float(mags[j]);
  double best = -1, prefix = 0;
  int64_t cut = 0;
  for (int64_t j = 1; two_levels && j < k; ++j) {
    prefix += key_float(mags[j - 1]);
    if (mags[j - 1] == mags[j]) continue;
    const double rest = total - prefix;
    const double gain = prefix * prefix / static_cast<double>(j) + rest * rest / static_cast<double>(k - j);
    if (gain > best) {
      best = gain;
      cut = j;
    }
  }
  if (cut == 0) {
    cc.lo = cc.hi = group_mean(mags, k);
    cc.lo_spread = cc.hi_spread = key_float(mags[k - 1]) - key_float(mags[0]);
    return cc;
  }
  // Each mean recomputed from its own values: from total - prefix, a small high group
  // under a large low one could lose float precision to cancellation.
  cc.lo = group_mean(mags, cut);
  cc.hi = group_mean(mags + cut, k - cut);
  cc.lo_spread = key_float(mags[cut - 1]) - key_float(mags[0]);
  cc.hi_spread = key_float(mags[k - 1]) - key_float(mags[cut]);
  cc.split = mags[cut];
  return cc;
}

// Encodes chunks [c0, c1) (c0 a multiple of kGroup) from x (the error-feedback residual,
// updated in place, when `residual`). The kept indices go to the fixed-width stream
// `indices`, or, when that is null, to kept_out[K] (for the Rice stream, written after).
void encode_chunks(const Layout& L, int64_t c0, int64_t c1, const float* t, float* residual, uint8_t* los,
                   uint8_t* his, uint8_t* indices, uint8_t* codes, uint16_t* kept_out) {
  Scratch s(std::min(L.chunk, L.numel));
  BitWriter iw(indices ? indices + L.kept_before(c0) * L.bits / 8 : nullptr);
  BitWriter cw(codes + L.kept_before(c0) * L.value_bits / 8);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t start = c * L.chunk, n = L.chunk_len(c), k = L.chunk_k(c);
    const float* x = t + start;
    float* r = residual ? residual + start : nullptr;
    if (r) {
      detail::add(x, r, r, n);  // the residual now holds x = t + residual
      x = r;
    }
    const ChunkCode cc = code_chunk(x, n, k, s, L.value_bits == 2);
    std::memcpy(los + 4 * c, &cc.lo, 4);
    std::memcpy(his + 4 * c, &cc.hi, 4);
    const uint32_t* kept = s.kept.get();
    for (int64_t j = 0; j < k; ++j) {
      const uint32_t i = kept[j];
      const float v = x[i];
      const uint32_t sign = std::bit_cast<uint32_t>(v) >> 31;
      const uint32_t high = magnitude_key(v) >= cc.split ? 1u : 0u;
      if (kept_out)
        kept_out[L.kept_before(c) + j] = static_cast<uint16_t>(i);
      else
        iw.put(i, L.bits);
      cw.put(sign | (high << 1), L.value_bits);  // one bit: the sign (high is 0)
      if (r) {
        // (A non-finite chunk decodes to NaN: then nothing of it is kept.)
        const float dec = std::bit_cast<float>(std::bit_cast<uint32_t>(high ? cc.hi : cc.lo) | (sign << 31));
        r[i] = detail::finite_or_zero(v - dec);
      }
    }
    // What was not sent stays in the residual; non-finite values never do (a finite chunk
    // has none: they would have been kept).
    if (r && !cc.finite)
      for (int64_t i = 0; i < n; ++i) r[i] = detail::finite_or_zero(r[i]);
  }
  if (!kept_out) iw.flush();
  cw.flush();
}

}  // namespace

int64_t sparseloco_count(int64_t len, double density) {
  if (len <= 0) return 0;
  const double k = std::round(density * static_cast<double>(len));
  if (!(k >= 1.0)) return 1;
  return k >= static_cast<double>(len) ? len : static_cast<int64_t>(k);
}

SparseLocoCodec::SparseLocoCodec(const CodecOptions& options) : options_(options) {
  NEBULA_CHECK(options.block >= 2 && options.block <= kMaxSparseLocoChunk, "sparseloco chunk ", options.block);
  NEBULA_CHECK(options.density > 0.0 && options.density <= 1.0, "sparseloco density ", options.density);
  NEBULA_CHECK(options.indices == "fixed" || options.indices == "rice", "sparseloco indices ", options.indices);
  NEBULA_CHECK(options.value_bits == 1 || options.value_bits == 2, "sparseloco value bits ", options.value_bits);
}

std::vector<uint8_t> SparseLocoCodec::encode(const at::Tensor& t_in, CodecState& state) const {
  at::Tensor t = detail::check_input(t_in, "sparseloco");
  const int64_t n = t.numel(), chunk = options_.block;
  const Layout L(n, chunk, sparseloco_count(chunk, options_.density), sparseloco_count(n % chunk, options_.density),
                 options_.value_bits);
  float* residual = options_.error_feedback ? detail::residual_for(state, t, "sparseloco", options_.error_decay).data_ptr<float>() : nullptr;

  const bool rice = options_.indices == "rice";
  wire::ByteWriter w;
  detail::write_header(w, CodecId::kSparseLoco, t.sizes());
  w.put_u32(static_cast<uint32_t>(L.chunk) | (rice ? kRiceIndices : 0u) | (L.value_bits == 1 ? kOneBitValues : 0u));
  w.put_u32(static_cast<uint32_t>(L.k));
  w.put_u32(static_cast<uint32_t>(L.k_last));
  std::vector<uint8_t> out = w.take();
  // Fixed: levels, indices, codes. Rice: levels, codes, then the Rice stream (written below
  // from the kept indices, once every chunk has chosen its own).
  const int64_t fixed_bytes = rice ? L.level_bytes() + L.code_bytes() : L.data_bytes();
  uint8_t* los = detail::append(out, static_cast<size_t>(fixed_bytes));
  uint8_t* his = L.value_bits == 2 ? los + 4 * L.nchunks : los;  // one level: lo = hi, written once
  uint8_t* indices = rice ? nullptr : los + L.level_bytes();
  uint8_t* codes = rice ? los + L.level_bytes() : indices + L.index_bytes();
  std::vector<uint16_t> kept(rice ? static_cast<size_t>(L.kept()) : 0);
  const float* x = t.data_ptr<float>();
  const int64_t ngroups = (L.nchunks + kGroup - 1) / kGroup;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / (kGroup * L.chunk));
  at::parallel_for(0, ngroups, grain, [&](int64_t g0, int64_t g1) {
    encode_chunks(L, g0 * kGroup, std::min(L.nchunks, g1 * kGroup), x, residual, los, his, indices, codes,
                  rice ? kept.data() : nullptr);
  });
  if (rice) {
    int64_t bound = 0;
    for (int64_t c = 0; c < L.nchunks; ++c) bound += rice_bits_bound(L.chunk_len(c), L.chunk_k(c));
    const size_t start = out.size();
    uint8_t* stream = detail::append(out, static_cast<size_t>((bound + 7) / 8 + 8));  // + a word's slack
    BitWriter bw(stream);
    for (int64_t c = 0; c < L.nchunks; ++c) {
      const int64_t k = L.chunk_k(c);
      const int r = rice_param(L.chunk_len(c), k);
      int64_t prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t idx = kept[static_cast<size_t>(L.kept_before(c) + j)];
        const auto gap = static_cast<uint32_t>(idx - prev - 1);
        bw.ones(gap >> r);
        bw.put(0, 1);
        if (r > 0) bw.put(gap & ((1u << r) - 1), r);
        prev = idx;
      }
    }
    bw.flush();
    out.resize(start + static_cast<size_t>(bw.end() - stream));
  }
  ++state.steps;
  return out;
}

at::Tensor SparseLocoCodec::decode(std::span<const uint8_t> payload, int64_t expected_numel) const {
  return detail::guarded([&] {
    wire::ByteReader r(payload, "sparseloco payload");
    detail::PayloadHeader h = detail::read_header(r, CodecId::kSparseLoco, false, expected_numel);
    const uint32_t chunk_field = r.u32();
    const uint32_t k = r.u32();
    const uint32_t k_last = r.u32();
    const uint32_t coding = chunk_field >> 24, chunk = chunk_field & kChunkMask;
    if (coding > 3)
      fail(Kind::kBadHeader, str_cat("sparseloco payload: coding ", coding, " (the chunk field's bits 24-31) has bits "
                                     "other than 0 (rice indices) and 1 (1-bit values)"));
    const bool rice = (chunk_field & kRiceIndices) != 0;
    const int value_bits = (chunk_field & kOneBitValues) != 0 ? 1 : 2;
    if (chunk < 2 || chunk > kMaxSparseLocoChunk)
      fail(Kind::kBadHeader,
           str_cat("sparseloco payload: chunk = ", chunk, " is not in [2, ", kMaxSparseLocoChunk, "]"));
    if (k < 1 || k > chunk)
      fail(Kind::kBadHeader, str_cat("sparseloco payload: k = ", k, " is not in [1, ", chunk, "] (the chunk)"));
    const int64_t tail = h.numel % chunk;
    if (tail == 0 && k_last != 0)
      fail(Kind::kBadHeader, str_cat("sparseloco payload: k_last = ", k_last, " but ", h.numel,
                                     " elements leave no partial chunk of ", chunk, " (must be 0)"));
    if (tail > 0 && (k_last < 1 || k_last > tail))
      fail(Kind::kBadHeader, str_cat("sparseloco payload: k_last = ", k_last, " is not in [1, ", tail,
                                     "] (the last chunk's length)"));
    const Layout L(h.numel, chunk, k, k_last, value_bits);
    // Rice: the levels and codes, and at least a bit per index after them.
    const int64_t fixed_bytes = rice ? L.level_bytes() + L.code_bytes() : L.data_bytes();
    const int64_t rice_min = rice ? (L.kept() + 7) / 8 : 0;
    if (rice) {
      if (r.remaining() < static_cast<uint64_t>(fixed_bytes + rice_min))
        fail(Kind::kTruncated, str_cat("sparseloco payload: ", r.remaining(), " bytes left for levels, codes and Rice-coded "
                                       "indices, at least ", fixed_bytes + rice_min, " needed"));
    } else {
      detail::expect_remaining(r, static_cast<uint64_t>(L.data_bytes()), "sparseloco", "levels, indices and codes");
    }
    const uint8_t* los = r.bytes(static_cast<size_t>(fixed_bytes)).data();
    const uint8_t* his = value_bits == 2 ? los + 4 * L.nchunks : los;  // one level: hi = lo
    BitReader ir(los + L.level_bytes());  // fixed only
    BitReader cr(rice ? los + L.level_bytes() : los + L.level_bytes() + L.index_bytes());
    const size_t stream_bytes = rice ? r.remaining() : 0;
    const uint8_t* stream = rice ? r.bytes(stream_bytes).data() : los;
    BitReader rr(stream, stream + stream_bytes);
    at::Tensor y = at::zeros(h.shape, at::TensorOptions().dtype(at::kFloat));
    float* out = y.data_ptr<float>();
    for (int64_t c = 0; c < L.nchunks; ++c) {
      float lo, hi;
      std::memcpy(&lo, los + 4 * c, 4);
      std::memcpy(&hi, his + 4 * c, 4);
      // What the encoder sends: both NaN (a non-finite chunk), or means of magnitudes in
      // order. Anything else would decode to values no encode produces (+-inf among them).
      if (!(std::isnan(lo) && std::isnan(hi)) && !(lo >= 0.0f && lo <= hi && hi < kInf))
        fail(Kind::kMismatch, str_cat("sparseloco payload: chunk ", c, " levels (", lo, ", ", hi,
                                      ") are not 0 <= lo <= hi < inf (nor both NaN)"));
      const uint32_t lo_bits = std::bit_cast<uint32_t>(lo), hi_bits = std::bit_cast<uint32_t>(hi);
      const int64_t n = L.chunk_len(c), kc = L.chunk_k(c);
      const int rp = rice ? rice_param(n, kc) : 0;
      const int64_t max_q = (n - 1) >> rp;
      float* y_c = out + c * L.chunk;
      int64_t prev = -1;
      for (int64_t j = 0; j < kc; ++j) {
        uint32_t idx;
        if (rice) {
          int64_t q = 0;
          while (rr.get(1) == 1)
            if (++q > max_q)
              fail(Kind::kMismatch, str_cat("sparseloco payload: chunk ", c, " index #", j, ": a Rice quotient over ", max_q,
                                            " (its chunk holds ", n, " values)"));
          // Below 2^18 (q <= max_q): the range check below applies to it as to a fixed index.
          idx = static_cast<uint32_t>(prev + 1 + ((q << rp) | (rp > 0 ? rr.get(rp) : 0)));
        } else {
          idx = ir.get(L.bits);
        }
        if (idx >= n)
          fail(Kind::kMismatch, str_cat("sparseloco payload: chunk ", c, " index #", j, " = ", idx,
                                        " is out of range for its ", n, " values"));
        if (static_cast<int64_t>(idx) <= prev)
          fail(Kind::kMismatch, str_cat("sparseloco payload: chunk ", c, " index #", j, " = ", idx,
                                        " does not follow ", prev, " (indices must increase within a chunk)"));
        prev = idx;
        const uint32_t code = cr.get(value_bits);
        y_c[idx] = std::bit_cast<float>(((code & 2u) ? hi_bits : lo_bits) | ((code & 1u) << 31));
      }
    }
    if (rice) {
      if (!rr.padding_zero()) fail(Kind::kMismatch, "sparseloco payload: non-zero padding bits after the last index");
      if (rr.left() > 0)
        fail(Kind::kMismatch, str_cat("sparseloco payload: ", rr.left(), " bytes after the Rice-coded indices"));
    } else if (!ir.padding_zero()) {
      fail(Kind::kMismatch, "sparseloco payload: non-zero padding bits after the last index");
    }
    if (!cr.padding_zero()) fail(Kind::kMismatch, "sparseloco payload: non-zero padding bits after the last code");
    return y;
  });
}

at::Tensor SparseLocoCodec::error_bound(const at::Tensor& t_in) const {
  at::Tensor t = detail::check_input(t_in, "sparseloco");
  const int64_t n = t.numel(), chunk = options_.block;
  at::Tensor bound = detail::empty_float(t.sizes());
  if (n == 0) return bound;
  const float* x = t.data_ptr<float>();
  float* b = bound.data_ptr<float>();
  Scratch s(std::min(chunk, n));
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start), k = sparseloco_count(len, options_.density);
    const ChunkCode cc = code_chunk(x + start, len, k, s, options_.value_bits == 2);
    // Not kept: decodes to 0.
    for (int64_t i = start; i < start + len; ++i) {
      const float a = std::fabs(x[i]);
      b[i] = std::isfinite(a) ? a : kInf;
    }
    // Kept: the magnitude and its level both lie within the level's group.
    const uint32_t* kept = s.kept.get();
    for (int64_t j = 0; j < k; ++j) {
      float& bi = b[start + kept[j]];
      if (!cc.finite)
        bi = kInf;
      else
        bi = magnitude_key(x[start + kept[j]]) >= cc.split ? cc.hi_spread : cc.lo_spread;
    }
  }
  return bound;
}

}  // namespace nebula::codec

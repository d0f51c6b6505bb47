// The codec registry (make_codec, decode_any) and the payload header shared by all codecs.
#include "codec/codec.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "codec/cast_codec.h"
#include "codec/payload.h"
#include "codec/powersgd_codec.h"
#include "codec/quant_codec.h"
#include "codec/sparseloco_codec.h"
#include "codec/topk_codec.h"

namespace nebula::codec {

using Kind = CodecError::Kind;

namespace {
constexpr const char* kKinds[] = {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco"};
constexpr int kNumKinds = sizeof(kKinds) / sizeof(kKinds[0]);
}  // namespace

std::string codec_name(CodecId id) {
  auto v = static_cast<int>(id);
  if (v < kNumKinds) return kKinds[v];
  return str_cat("codec(", v, ")");
}

Codec::~Codec() = default;

std::unique_ptr<Codec> make_codec(const CodecOptions& o) {
  int kind = -1;
  for (int i = 0; i < kNumKinds; ++i)
    if (o.kind == kKinds[i]) kind = i;
  if (kind < 0) {
    std::string list;
    for (int i = 0; i < kNumKinds; ++i) list += str_cat(i ? ", " : "", kKinds[i]);
    throw ConfigError(str_cat("strategy.codec = \"", o.kind, "\" is not one of ", list));
  }
  auto id = static_cast<CodecId>(kind);
  // Written so that NaN fails too.
  if (!(o.error_decay >= 0.0 && o.error_decay <= 1.0))
    throw ConfigError(str_cat("strategy.codec_error_decay = ", o.error_decay,
                              " is not in [0, 1] (the share of the error-feedback residual kept per encode)"));
  switch (id) {
    case CodecId::kNone:
    case CodecId::kFp16:
    case CodecId::kBf16:
      return std::make_unique<CastCodec>(id);
    case CodecId::kInt8:
    case CodecId::kInt4:
      if (o.block < 1 || o.block > (int64_t{1} << 24))
        throw ConfigError(str_cat("strategy.codec_block = ", o.block, " is not in [1, 16777216] (values per scale of ",
                                  o.kind, ")"));
      return std::make_unique<BlockQuantCodec>(id == CodecId::kInt8 ? 8 : 4, o);
    case CodecId::kTopK:
      // Written so that NaN fails too.
      if (!(o.density > 0.0 && o.density <= 1.0))
        throw ConfigError(str_cat("strategy.codec_density = ", o.density, " is not in (0, 1] (fraction topk keeps)"));
      return std::make_unique<TopKCodec>(o);
    case CodecId::kPowerSgd:
      if (o.rank < 1 || o.rank > 65536)
        throw ConfigError(str_cat("strategy.codec_rank = ", o.rank, " is not in [1, 65536] (rank of powersgd)"));
      return std::make_unique<PowerSgdCodec>(o);
    case CodecId::kSparseLoco:
      // The chunk is the block: in-chunk indices are at most 16 bits.
      if (o.block < 2 || o.block > kMaxSparseLocoChunk)
        throw ConfigError(str_cat("strategy.codec_block = ", o.block, " is not in [2, ", kMaxSparseLocoChunk,
                                  "] (values per chunk of sparseloco)"));
      if (!(o.density > 0.0 && o.density <= 1.0))
        throw ConfigError(
            str_cat("strategy.codec_density = ", o.density, " is not in (0, 1] (fraction sparseloco keeps per chunk)"));
      if (o.indices != "fixed" && o.indices != "rice")
        throw ConfigError(str_cat("strategy.codec_indices = \"", o.indices,
                                  "\" is not \"fixed\" or \"rice\" (how sparseloco sends its kept values' indices)"));
      if (o.value_bits != 1 && o.value_bits != 2)
        throw ConfigError(str_cat("strategy.codec_value_bits = ", o.value_bits,
                                  " is not 1 or 2 (bits per value sparseloco keeps: sign, and one of two levels with 2)"));
      return std::make_unique<SparseLocoCodec>(o);
  }
  throw ConfigError(str_cat("strategy.codec = \"", o.kind, "\": no codec"));  // unreachable
}

namespace {
const Codec& decoder_for(CodecId id) {
  // Decoding reads every parameter from the payload, so default options do.
  static const CastCodec none(CodecId::kNone), fp16(CodecId::kFp16), bf16(CodecId::kBf16);
  static const BlockQuantCodec int8(8, CodecOptions{}), int4(4, CodecOptions{});
  static const TopKCodec topk(CodecOptions{});
  static const PowerSgdCodec powersgd(CodecOptions{});
  static const SparseLocoCodec sparseloco(CodecOptions{});
  switch (id) {
    case CodecId::kNone: return none;
    case CodecId::kFp16: return fp16;
    case CodecId::kBf16: return bf16;
    case CodecId::kInt8: return int8;
    case CodecId::kInt4: return int4;
    case CodecId::kTopK: return topk;
    case CodecId::kPowerSgd: return powersgd;
    case CodecId::kSparseLoco: return sparseloco;
  }
  detail::fail(Kind::kBadHeader, str_cat("codec payload: unknown codec id ", static_cast<int>(id)));
}
}  // namespace

CodecId payload_codec(std::span<const uint8_t> payload) {
  return detail::guarded([&] {
    wire::ByteReader r(payload, "codec payload");
    return detail::read_header(r, CodecId::kNone, /*any=*/true, -1).id;
  });
}

at::Tensor decode_any(std::span<const uint8_t> payload, int64_t expected_numel) {
  return decoder_for(payload_codec(payload)).decode(payload, expected_numel);
}

namespace detail {

void fail(CodecError::Kind kind, const std::string& msg) { throw CodecError(kind, msg); }

at::Tensor check_input(const at::Tensor& t, const char* codec) {
  NEBULA_CHECK(t.defined(), codec, ": encode of an undefined tensor");
  NEBULA_CHECK(t.scalar_type() == at::kFloat, codec, ": encode needs a float32 tensor, got ", t.scalar_type());
  NEBULA_CHECK(t.device().is_cpu(), codec, ": encode needs a CPU tensor, got ", t.device());
  NEBULA_CHECK(t.dim() <= kMaxNdim, codec, ": ", t.dim(), " dims, the format allows ", kMaxNdim);
  NEBULA_CHECK(t.numel() <= kMaxNumel, codec, ": ", t.numel(), " elements, the format allows ", kMaxNumel,
               " (split the bucket)");
  return t.contiguous();
}

void write_header(wire::ByteWriter& w, CodecId id, at::IntArrayRef shape) {
  w.put_u8(static_cast<uint8_t>(id));
  w.put_u8(kFormatVersion);
  w.put_u8(kDtypeFloat32);
  w.put_u8(static_cast<uint8_t>(shape.size()));
  for (int64_t d : shape) w.put_u64(static_cast<uint64_t>(d));
}

PayloadHeader read_header(wire::ByteReader& r, CodecId expect, bool any, int64_t expected_numel) {
  PayloadHeader h;
  if (r.remaining() < 4)
    fail(Kind::kTruncated, str_cat("codec payload: ", r.remaining(), " bytes, the header needs at least 4"));
  uint8_t id = r.u8();
  if (id >= kNumKinds) fail(Kind::kBadHeader, str_cat("codec payload: unknown codec id ", int{id}));
  h.id = static_cast<CodecId>(id);
  const std::string name = codec_name(h.id);
  if (!any && h.id != expect)
    fail(Kind::kMismatch, str_cat(codec_name(expect), " decoder given a ", name, " payload"));
  uint8_t version = r.u8();
  if (version != kFormatVersion)
    fail(Kind::kBadHeader, str_cat(name, " payload: format version ", int{version}, ", this build reads ",
                                   int{kFormatVersion}));
  uint8_t dtype = r.u8();
  if (dtype != kDtypeFloat32)
    fail(Kind::kBadHeader, str_cat(name, " payload: dtype ", int{dtype}, ", only 1 (float32) is known"));
  uint8_t ndim = r.u8();
  if (ndim > kMaxNdim) fail(Kind::kBadHeader, str_cat(name, " payload: ndim ", int{ndim}, " above ", kMaxNdim));
  if (r.remaining() < size_t{ndim} * 8)
    fail(Kind::kTruncated, str_cat(name, " payload: ", r.remaining(), " bytes left for ", int{ndim}, " dims of 8 bytes"));
  h.numel = 1;
  bool zero = false;
  for (int i = 0; i < ndim; ++i) {
    uint64_t d = r.u64();
    if (d > static_cast<uint64_t>(kMaxNumel))
      fail(Kind::kBadHeader, str_cat(name, " payload: dim ", i, " = ", d, " above ", kMaxNumel));
    h.shape.push_back(static_cast<int64_t>(d));
    if (d == 0) zero = true;
  }
  // Multiply only the non-zero dims with a running bound, so nothing overflows.
  for (int64_t d : h.shape) {
    if (d == 0) continue;
    if (h.numel > kMaxNumel / d)
      fail(Kind::kBadHeader, str_cat(name, " payload: shape ", shape_str(h.shape), " has more than ", kMaxNumel,
                                     " elements"));
    h.numel *= d;
  }
  if (zero) h.numel = 0;
  if (expected_numel >= 0 && h.numel != expected_numel)
    fail(Kind::kMismatch, str_cat(name, " payload: shape ", shape_str(h.shape), " has ", h.numel,
                                  " elements, expected ", expected_numel));
  return h;
}

void expect_remaining(const wire::ByteReader& r, uint64_t need, const char* codec, const char* what) {
  if (r.remaining() < need)
    fail(Kind::kTruncated, str_cat(codec, " payload: ", what, " need ", need, " bytes at offset ", r.offset(), ", ",
                                   r.remaining(), " left"));
  if (r.remaining() > need)
    fail(Kind::kMismatch, str_cat(codec, " payload: ", r.remaining() - need, " bytes after ", what, " (", need,
                                  " bytes at offset ", r.offset(), ")"));
}

at::Tensor empty_float(at::IntArrayRef shape) { return at::empty(shape, at::TensorOptions().dtype(at::kFloat)); }

at::Tensor& residual_for(CodecState& state, const at::Tensor& t, const char* codec, double decay) {
  if (!state.residual.defined()) {
    state.residual = at::zeros(t.sizes(), at::TensorOptions().dtype(at::kFloat));
    return state.residual;
  }
  NEBULA_CHECK(state.residual.numel() == t.numel(), codec, ": error-feedback residual has ", state.residual.numel(),
               " elements, the tensor ", t.numel(), " (one CodecState per tensor)");
  if (state.residual.scalar_type() != at::kFloat || !state.residual.is_contiguous() || !state.residual.device().is_cpu())
    state.residual = state.residual.to(at::kCPU, at::kFloat).contiguous();
  if (state.residual.sizes() != t.sizes()) state.residual = state.residual.view(t.sizes());
  if (decay < 1.0) state.residual.mul_(decay);
  return state.residual;
}

void add(const float* a, const float* b, float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = a[i] + b[i];
}

void sub_finite(const float* x, const float* y, float* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) r[i] = finite_or_zero(x[i] - y[i]);
}

}  // namespace detail
}  // namespace nebula::codec

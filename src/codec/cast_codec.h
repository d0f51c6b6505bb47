// none, fp16, bf16: one value per element, cast (see codec.h for formats and bounds).
#pragma once

#include "codec/codec.h"

namespace nebula::codec {

// Raw float32 (kNone), IEEE binary16 (kFp16) or bfloat16 (kBf16), round to nearest even.
class CastCodec final : public Codec {
 public:
  // Precondition: id is kNone, kFp16 or kBf16.
  explicit CastCodec(CodecId id);
  CodecId id() const override { return id_; }
  std::string name() const override { return codec_name(id_); }
  std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const override;
  at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const override;
  at::Tensor error_bound(const at::Tensor& t) const override;

 private:
  CodecId id_;
};

}  // namespace nebula::codec

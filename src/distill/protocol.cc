#include "distill/protocol.h"

#include <limits>

#include "nebula/error.h"

namespace nebula::distill {

namespace {

[[noreturn]] void bad(const std::string& what, const std::string& msg) {
  throw FrameError(FrameError::Kind::kBadPayload, str_cat(what, ": ", msg));
}

void put_ids(wire::ByteWriter& w, const std::vector<int>& ids) {
  w.put_u32(static_cast<uint32_t>(ids.size()));
  for (int id : ids) w.put_u32(static_cast<uint32_t>(id));
}

std::vector<int> read_ids(wire::ByteReader& r, const RequestLimits& limits, const std::string& what, size_t seq,
                          const char* field) {
  const uint32_t len = r.u32();
  if (len > static_cast<uint64_t>(limits.max_len))
    bad(what, str_cat("sequence ", seq, ": ", field, " length ", len, " > max_len ", limits.max_len));
  if (r.remaining() < 4ull * len)
    bad(what, str_cat("sequence ", seq, ": ", field, " of ", len, " ids truncated (", r.remaining(), " bytes left)"));
  std::vector<int> ids(len);
  for (uint32_t i = 0; i < len; ++i) {
    const uint32_t id = r.u32();
    if (id >= static_cast<uint64_t>(limits.vocab))
      bad(what, str_cat("sequence ", seq, ": ", field, " position ", i, ": id ", id, " outside [0, ", limits.vocab, ")"));
    ids[i] = static_cast<int>(id);
  }
  return ids;
}

}  // namespace

std::string message_kind_name(uint16_t flags) {
  switch (static_cast<MessageKind>(flags)) {
    case MessageKind::kRequest: return "request";
    case MessageKind::kResponse: return "response";
    case MessageKind::kError: return "error";
    case MessageKind::kBye: return "bye";
  }
  return str_cat("kind(", flags, ")");
}

int64_t target_tokens(const Sequences& tgt_in) {
  int64_t n = 0;
  for (const auto& t : tgt_in) n += static_cast<int64_t>(t.size());
  return n;
}

std::vector<uint8_t> encode_request(const Sequences& src, const Sequences& tgt_in) {
  NEBULA_CHECK(src.size() == tgt_in.size(), "encode_request: ", src.size(), " src sequences but ", tgt_in.size(),
               " tgt_in sequences");
  NEBULA_CHECK(src.size() <= std::numeric_limits<uint32_t>::max(), "encode_request: ", src.size(), " sequences");
  size_t ids = 0;
  for (size_t s = 0; s < src.size(); ++s) {
    for (const auto* seq : {&src[s], &tgt_in[s]}) {
      NEBULA_CHECK(seq->size() <= std::numeric_limits<uint32_t>::max(), "encode_request: sequence ", s, " length ",
                   seq->size());
      for (int id : *seq) NEBULA_CHECK(id >= 0, "encode_request: sequence ", s, " has a negative id ", id);
      ids += seq->size();
    }
  }
  wire::ByteWriter w;
  w.reserve(4 + 8 * src.size() + 4 * ids);
  w.put_u32(static_cast<uint32_t>(src.size()));
  for (size_t s = 0; s < src.size(); ++s) {
    put_ids(w, src[s]);
    put_ids(w, tgt_in[s]);
  }
  return w.take();
}

Request decode_request(std::span<const uint8_t> payload, const RequestLimits& limits, const std::string& what) {
  NEBULA_CHECK(limits.vocab >= 1 && limits.vocab <= std::numeric_limits<int>::max() + int64_t{1},
               "decode_request: vocab ", limits.vocab);
  if (payload.empty()) bad(what, "empty request");
  wire::ByteReader r(payload, what);
  const uint32_t n = r.u32();
  if (n == 0) bad(what, "request has no sequences");
  if (n > static_cast<uint64_t>(limits.max_sequences))
    bad(what, str_cat(n, " sequences > max_sequences ", limits.max_sequences));
  Request req;
  req.src.reserve(n);
  req.tgt_in.reserve(n);
  for (uint32_t s = 0; s < n; ++s) {
    req.src.push_back(read_ids(r, limits, what, s, "src"));
    req.tgt_in.push_back(read_ids(r, limits, what, s, "tgt_in"));
  }
  if (!r.done()) bad(what, str_cat(r.remaining(), " trailing bytes after ", n, " sequences"));
  return req;
}

wire::Frame make_message(MessageKind kind, uint64_t id, std::vector<uint8_t> payload) {
  return wire::make_frame(wire::FrameType::kData, id, 0, std::move(payload), static_cast<uint16_t>(kind));
}

}  // namespace nebula::distill

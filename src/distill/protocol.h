// The teacher protocol of cross-site distillation: what a student (TeacherClient) and a
// teacher (serve_teacher) say to each other over one transport::Link (teacher_service.h).
//
// Every message is a wire::Frame of type kData whose `flags` is the MessageKind and whose
// `op_id` is the request id (chosen by the student; a response or error carries the id of
// the request it answers):
//   request  (1)  student → teacher   payload below
//   response (2)  teacher → student   encode_topk() bytes (topk.h) for the concatenation, in
//                                     order, of every sequence's tgt_in positions:
//                                     N = Σ len(tgt_in) rows
//   error    (3)  teacher → student   a UTF-8 message naming the problem and the request id
//   bye      (4)  both ways           empty; the student's last message, and the teacher's
//                                     answer to it once every earlier request is answered
//
// Request payload (little-endian):
//    n                u32   sequences, 1 <= n <= max_sequences
//    n times:  src_len u32, src_len x u32 token id,
//              tgt_len u32, tgt_len x u32 token id      (each length <= max_len, ids < vocab)
// src is the source sentence, tgt_in the target prefix the teacher is fed (teacher forcing):
// the teacher answers its distribution over the next token at each tgt_in position.
//
// decode_request validates like wire input: every failure is a nebula::FrameError
// (kBadPayload) whose message starts with `what` (e.g. "request 7 from site-b") and names the
// sequence, the field and the value. Nothing is allocated beyond max_len ids per sequence
// before the bytes are there. No torch here; pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "wire/frame.h"

namespace nebula::distill {

enum class MessageKind : uint16_t { kRequest = 1, kResponse = 2, kError = 3, kBye = 4 };

// "request", "response", "error", "bye", or "kind(N)".
std::string message_kind_name(uint16_t flags);

using Sequences = std::vector<std::vector<int>>;

struct Request {
  Sequences src;
  Sequences tgt_in;
};

struct RequestLimits {
  int64_t vocab = 0;            // ids must be in [0, vocab)
  int64_t max_sequences = 4096;
  int64_t max_len = 512;        // for src and tgt_in alike
};

// Σ len(tgt_in): the rows of the response.
int64_t target_tokens(const Sequences& tgt_in);

// The request payload. Preconditions (nebula::Error): src.size() == tgt_in.size(), every
// count fits in u32, every id >= 0. Limits are the teacher's business (it answers with an
// error message), so none are checked here.
std::vector<uint8_t> encode_request(const Sequences& src, const Sequences& tgt_in);

// Parses and validates a request payload (see above).
Request decode_request(std::span<const uint8_t> payload, const RequestLimits& limits, const std::string& what);

// A kData frame of `kind` for request `id`.
wire::Frame make_message(MessageKind kind, uint64_t id, std::vector<uint8_t> payload = {});

}  // namespace nebula::distill

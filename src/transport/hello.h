// The hello frames that open every inter-site connection (after TLS, before anything else):
// the accepting gateway greets, the dialing gateway names itself, job, target site, stream
// index and generation, and the acceptor confirms. Parsed like any wire input: every field
// is bounds-checked; a frame that is not a hello is an AuthError, a malformed hello a
// FrameError (kBadPayload); both name the peer (fuzzed: fuzz/hello_fuzzer.cc).
#pragma once

#include <cstdint>
#include <string>

#include "wire/frame.h"

namespace nebula::transport {

constexpr uint32_t kHelloProtocol = 3;

struct Hello {
  uint32_t protocol = kHelloProtocol;
  std::string job, from, to;  // each at most 256 bytes
  uint32_t stream = 0, streams = 1, generation = 0;
};

wire::Frame hello_frame(const Hello& h);
// Throws AuthError (not a hello frame) or FrameError (kBadPayload: malformed fields).
Hello read_hello(const wire::Frame& f, const std::string& peer);

}  // namespace nebula::transport

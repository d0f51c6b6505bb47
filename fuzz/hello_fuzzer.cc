// libFuzzer target for the handshake parser, transport::read_hello (transport/hello.h).
//
// The input is a hello payload; it is wrapped in a valid kHello frame and parsed. A
// malformed hello may throw AuthError or FrameError, and either must name the peer; a
// frame of any other type must be refused with AuthError. Anything else is a bug and
// aborts: another exception type, an ASan/UBSan report, an allocation sized by a length
// prefix (run with -malloc_limit_mb), or an accepted hello that does not re-encode to the
// same payload.
//
// Seed mode: NEBULA_FUZZ_WRITE_SEEDS=DIR ./hello_fuzzer writes a few valid hello payloads
// to DIR and exits (run_fuzzers.sh does this; fuzz/corpus/hello holds the same files).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "nebula/error.h"
#include "transport/hello.h"
#include "wire/frame.h"
#include "fuzz_util.h"

namespace {

using nebula::AuthError;
using nebula::FrameError;
using nebula::transport::Hello;
using namespace nebula::wire;

const std::string kPeer = "fuzz-peer";

bool names_peer(const std::exception& e) { return std::string(e.what()).find(kPeer) != std::string::npos; }

std::optional<Hello> check_read_hello(const Frame& f) {
  try {
    return nebula::transport::read_hello(f, kPeer);
  } catch (const AuthError& e) {
    FUZZ_ASSERT(e.peer() == kPeer);
  } catch (const FrameError& e) {
    FUZZ_ASSERT(e.kind() == FrameError::Kind::kBadPayload);
    FUZZ_ASSERT(names_peer(e));
  }
  return std::nullopt;
}

void write_seeds(const std::string& dir) {
  using nebula::transport::kHelloProtocol;
  std::vector<std::pair<std::string, Hello>> seeds = {
      {"typical", {kHelloProtocol, "job-1", "site-a", "site-b", 0, 1, 0}},
      {"striped", {kHelloProtocol, "llama-7b-run3", "us-east", "eu-west", 3, 4, 17}},
      {"empty-names", {kHelloProtocol, "", "", "", 0, 0, 0}},
      {"max-names", {kHelloProtocol, std::string(256, 'j'), std::string(256, 'f'), std::string(256, 't'),
                     std::numeric_limits<uint32_t>::max(), std::numeric_limits<uint32_t>::max(), 1}},
      {"old-protocol", {2, "job-1", "site-a", "site-b", 0, 1, 0}},
  };
  for (auto& [name, h] : seeds) {
    nebula::fuzz::write_seed_file(dir + "/" + name, nebula::transport::hello_frame(h).payload);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("NEBULA_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> payload(data, data + size);
  try {
    Frame f = make_frame(FrameType::kHello, 0, 0, payload);
    if (auto h = check_read_hello(f)) {
      for (const std::string* s : {&h->job, &h->from, &h->to}) FUZZ_ASSERT(s->size() <= 256);
      Frame again = nebula::transport::hello_frame(*h);
      FUZZ_ASSERT(again.payload == payload);
      FUZZ_ASSERT(again.header.checksum == f.header.checksum);
    }
    // The same frame after a trip over the wire parses the same way.
    Frame decoded = decode_frame(encode_frame(f), std::numeric_limits<uint64_t>::max());
    FUZZ_ASSERT(decoded.payload == payload);
    // Any other frame type is refused before the payload is looked at.
    auto other = static_cast<FrameType>(2 + size % 5);  // data, bye, heartbeat, ack, resume
    try {
      nebula::transport::read_hello(make_frame(other, 0, 0, payload), kPeer);
      FUZZ_ASSERT(!"read_hello accepted a non-hello frame");
    } catch (const AuthError& e) {
      FUZZ_ASSERT(e.peer() == kPeer);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
  return 0;
}

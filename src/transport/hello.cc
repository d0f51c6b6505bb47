#include "transport/hello.h"

#include "nebula/error.h"

namespace nebula::transport {

wire::Frame hello_frame(const Hello& h) {
  wire::ByteWriter w;
  w.put_u32(h.protocol);
  w.put_string(h.job);
  w.put_string(h.from);
  w.put_string(h.to);
  w.put_u32(h.stream);
  w.put_u32(h.streams);
  w.put_u32(h.generation);
  return wire::make_frame(wire::FrameType::kHello, 0, 0, w.take());
}

Hello read_hello(const wire::Frame& f, const std::string& peer) {
  if (f.header.type != wire::FrameType::kHello)
    throw AuthError(peer, str_cat("expected a hello frame, got ", wire::frame_type_name(f.header.type)));
  wire::ByteReader r(f.payload, "hello from " + peer);
  Hello h;
  h.protocol = r.u32();
  h.job = r.string(256);
  h.from = r.string(256);
  h.to = r.string(256);
  h.stream = r.u32();
  h.streams = r.u32();
  h.generation = r.u32();
  r.expect_done();
  return h;
}

}  // namespace nebula::transport

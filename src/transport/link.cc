#include "transport/link.h"

#include "nebula/error.h"

namespace nebula::transport {

Link::~Link() = default;

uint64_t parts_size(PayloadParts parts) {
  uint64_t n = 0;
  for (const auto& p : parts) n += p.size();
  return n;
}

void Link::send_parts(const wire::FrameHeader& header, PayloadParts parts, Deadline deadline) {
  wire::Frame frame;
  frame.header = header;
  frame.payload.reserve(parts_size(parts));
  for (const auto& p : parts) frame.payload.insert(frame.payload.end(), p.begin(), p.end());
  send(frame, deadline);
}

void Link::send_shared(std::shared_ptr<const wire::Frame> frame, Deadline deadline) {
  NEBULA_CHECK(frame != nullptr, "send_shared to ", peer(), ": null frame");
  send(*frame, deadline);
}

}  // namespace nebula::transport

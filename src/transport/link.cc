#include "transport/link.h"

namespace nebula::transport {

Link::~Link() = default;

}  // namespace nebula::transport

// Remote teacher for cross-site knowledge distillation: the teacher model runs on one site
// (serve_teacher), the student trains on another (TeacherClient), joined by a slow WAN Link.
// The messages are in protocol.h, the answer format in topk.h, the loss in kd_loss.h.
//
// Teacher side: serve_teacher() answers requests in arrival order on the calling thread,
// until the student says bye (it answers bye and returns) or the link goes away (PeerLost:
// returns normally). A bad request -- unparsable, the wrong kind of message, no sequences,
// too many sequences, a sequence longer than max_len, an id outside [0, vocab), a TeacherFn
// that throws or returns logits of the wrong shape -- gets an error message naming the
// problem and the request id, is logged with spdlog::warn, and the service goes on. Errors
// that end it: Timeout when no message arrives within idle_timeout (or a reply cannot be
// sent within it), FrameError when the peer sends an invalid frame (the link is broken).
//
// Student side: TeacherClient pipelines requests. submit() queues a request and returns at
// once; a sender thread sends queued requests in submit order, so a slow WAN never blocks the
// training loop; a receiver thread decodes responses and files them by id; wait(id) blocks
// only if that id's answer has not arrived yet. The trainer prefetches by submitting batches
// i+1 .. i+P before waiting on batch i, so with P >= RTT / step time (plus the teacher's
// compute) wait() returns at once:
//
//     for (i = 0; i < P; ++i) client.submit(i, src(i), tgt_in(i));
//     for (i = 0; ; ++i) {
//       if (i + P < steps) client.submit(i + P, src(i + P), tgt_in(i + P));
//       TopK t = client.wait(i, Deadline::after(timeout));
//       loss = (1 - α) · CE + α · kd_loss(student_logits, t, T);  ...
//     }
//
// Threading: the client owns two threads, one in link.send() and one in link.recv(), which is
// what link.h allows; nobody else may use the link while the client is open. submit(),
// wait(), stats() and close() may be called from any thread. serve_teacher uses the link from
// its calling thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "distill/protocol.h"
#include "distill/topk.h"
#include "nebula/deadline.h"
#include "transport/link.h"

namespace nebula::distill {

// Returns the teacher's logits [Σ len(tgt_in), V]: row j is the distribution over the next
// token at the j-th tgt_in position, sequences concatenated in order. Any floating dtype or
// device (top_k converts). Called on serve_teacher's thread; may throw (the student gets the
// message as an error reply).
using TeacherFn = std::function<at::Tensor(const Sequences& src, const Sequences& tgt_in)>;

struct ServeOptions {
  int64_t vocab = 0;              // V: ids and logits' width; required (>= 1)
  int64_t max_sequences = 4096;   // per request
  int64_t max_len = 512;          // per src or tgt_in sequence
  int64_t k = 8;                  // top-k entries per token, in [1, vocab]
  double temperature = 1;         // softmax temperature of the answers (the student's KD T)
  // Longest wait for the student's next message, and for a reply to be handed to the link.
  std::chrono::milliseconds idle_timeout{std::chrono::minutes(10)};
};

struct ServeStats {
  uint64_t requests = 0;        // request messages received (answered or not)
  uint64_t errors = 0;          // error replies sent
  uint64_t tokens = 0;          // target tokens answered (rows of all responses)
  uint64_t bytes_received = 0;  // request payload bytes
  uint64_t bytes_sent = 0;      // response and error payload bytes
};

// Serves `fn` on `link` (see the top of this file). Throws nebula::Error for invalid
// options (vocab < 1, k outside [1, vocab], max_sequences or max_len < 1, temperature <= 0).
ServeStats serve_teacher(transport::Link& link, const TeacherFn& fn, const ServeOptions& options);

struct ClientOptions {
  // Deadline for handing one request to the link (a slow WAN may hold a big one a while).
  std::chrono::milliseconds send_timeout{std::chrono::minutes(2)};
  // close(): how long to wait for the teacher to answer everything outstanding and its bye;
  // after that the link is closed (the only way to stop a receiver blocked in recv()).
  std::chrono::milliseconds close_timeout{std::chrono::seconds(30)};
};

struct ClientStats {
  uint64_t requests = 0;         // submitted
  uint64_t tokens = 0;           // target tokens requested (Σ len(tgt_in))
  uint64_t errors = 0;           // error replies received
  uint64_t bytes_sent = 0;       // request payload bytes handed to the link
  uint64_t bytes_received = 0;   // response and error payload bytes
  double wait_seconds = 0;       // time callers spent blocked in wait()
};

class TeacherClient {
 public:
  // `link` is not owned and must outlive the client; the client starts its two threads here.
  explicit TeacherClient(transport::Link& link, ClientOptions options = {});
  // close(), swallowing its errors.
  ~TeacherClient();
  TeacherClient(const TeacherClient&) = delete;
  TeacherClient& operator=(const TeacherClient&) = delete;

  // Queues request `id` and returns at once. Preconditions (nebula::Error): the client is
  // open, `id` is not outstanding (submitted and not yet waited for), and those of
  // encode_request (src.size() == tgt_in.size(), ids >= 0). Ids need not be consecutive.
  void submit(uint64_t id, Sequences src, Sequences tgt_in);

  // Blocks until request `id` is answered and returns the teacher's top-k, [Σ len(tgt_in), k]
  // on the CPU; `id` is then no longer outstanding. Throws
  //   nebula::Error  the teacher's error message ("teacher error for request 7: ..."; the id
  //                  is then no longer outstanding), or a response that does not decode
  //                  or has the wrong number of rows; or `id` is not outstanding;
  //   Timeout        the deadline passed first (the id stays outstanding: wait again);
  //   PeerLost       the link failed or the client was closed before the answer arrived.
  // One thread at a time may wait for a given id.
  TopK wait(uint64_t id, Deadline deadline);

  // Sends bye after the queued requests, waits (close_timeout) for the teacher's bye, which
  // follows its last answer, and stops both threads; answers that arrived stay available to
  // wait(). Idempotent. After a link failure the link is closed instead (it is broken).
  void close();

  ClientStats stats() const;

 private:
  struct Pending {
    int64_t tokens = 0;
    bool done = false;
    std::optional<TopK> result;
    std::string error;  // the teacher's error message, or why the answer was unusable
  };
  struct Outgoing {
    uint64_t id;
    std::vector<uint8_t> payload;
    bool bye = false;
  };

  void send_loop();
  void recv_loop();
  void fail_locked(std::exception_ptr e);  // caller holds mu_

  transport::Link& link_;
  const ClientOptions options_;
  const std::string peer_;

  mutable std::mutex mu_;
  std::condition_variable cv_;          // outbox, pending results, failure, teacher bye
  std::deque<Outgoing> outbox_;         // GUARDED_BY(mu_): sender thread takes from the front
  std::map<uint64_t, Pending> pending_; // GUARDED_BY(mu_): outstanding ids
  std::exception_ptr failure_;          // GUARDED_BY(mu_): the link failed (sticky)
  std::string failure_text_;            // GUARDED_BY(mu_)
  bool closing_ = false;                // GUARDED_BY(mu_): close() queued bye; no submits
  bool receiver_done_ = false;          // GUARDED_BY(mu_): no more answers will arrive
  bool stop_ = false;                   // GUARDED_BY(mu_): close() ends the sender
  ClientStats stats_;                   // GUARDED_BY(mu_)
  std::mutex close_mu_;                 // serializes close()
  bool closed_ = false;                 // GUARDED_BY(close_mu_)

  std::thread sender_;                  // last members: started after everything they use
  std::thread receiver_;
};

}  // namespace nebula::distill

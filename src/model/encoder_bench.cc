// Forward+backward time of the demo-size MLM encoder (examples/demo.toml [model]: dim 64,
// 2 layers, 4 heads, ffn 128, max_len 32; batch 16, vocab 1000), one intra-op thread as in a
// worker. Side by side in one run: the encoder stack alone, torch::nn::TransformerEncoderLayer
// vs ours; the MLM loss from full logits (before [5/5]) vs from the masked positions' only
// (tokens/s); the translation loss of the demo's seq2seq (examples/demo_mt.toml: max_len 64,
// vocab 8000, batch 32, targets of 4 to 40 pieces) from full logits vs from the target
// positions' only; then the whole MlmEncoder step without PEFT, with LoRA r=8 and with
// adapters 16, and each one's trainable parameter count. Prints ms per step; ctest runs a tiny mode
// (bench.encoder_bench, 20 steps) so it cannot rot.
//   build/src/model/encoder_bench [steps]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/transformerlayer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "model/peft.h"
#include "model/seq2seq.h"
#include "model/seq2seq_batch.h"

using namespace nebula;

namespace {

// Runs the steps in rounds of 20, alternating between the variants, and returns each one's
// median ms per step over the rounds: alternating cancels drift in machine load, the median
// ignores rounds hit by other processes.
std::vector<double> ms_per_step(const std::vector<std::function<void()>>& variants, int steps) {
  const int round = 20, rounds = std::max(1, steps / round);
  std::vector<std::vector<double>> times(variants.size());
  for (const auto& step : variants)
    for (int i = 0; i < 10; ++i) step();  // warm-up
  for (int r = 0; r < rounds; ++r)
    for (size_t v = 0; v < variants.size(); ++v) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < round; ++i) variants[v]();
      times[v].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
                         round);
    }
  std::vector<double> out;
  for (auto& t : times) {
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    out.push_back(t[t.size() / 2]);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 200;
  at::set_num_threads(1);
  at::manual_seed(0);
  ModelConfig c;
  c.dim = 64, c.layers = 2, c.heads = 4, c.ffn = 128, c.max_len = 32;
  const int64_t vocab = 1000, batch = 16, pad = 0;
  at::Tensor ids = at::randint(1, vocab, {batch, c.max_len}, at::kLong);
  ids.narrow(1, 24, 8).narrow(0, 0, 8).fill_(pad);  // half the rows padded at the end
  at::Tensor labels = at::where(at::rand({batch, c.max_len}).lt(0.15), ids, at::full_like(ids, model::kIgnoreIndex));
  at::Tensor pad_mask = ids.eq(pad);

  std::printf("demo-size model, batch %lld, %d steps, 1 thread: ms per forward+backward\n", (long long)batch, steps);
  {
    at::Tensor x = at::randn({batch, c.max_len, c.dim});
    std::vector<torch::nn::TransformerEncoderLayer> theirs;
    std::vector<model::EncoderLayer> ours;
    for (int64_t i = 0; i < c.layers; ++i) {
      theirs.emplace_back(torch::nn::TransformerEncoderLayerOptions(c.dim, c.heads).dim_feedforward(c.ffn).dropout(0).activation(torch::kGELU));
      ours.emplace_back(c.dim, c.heads, c.ffn, 0.0);
    }
    auto t = ms_per_step({[&] {
                            at::Tensor h = x.transpose(0, 1);  // torch's layer is sequence-first
                            for (auto& l : theirs) h = l->forward(h, {}, pad_mask);
                            h.sum().backward();
                          },
                          [&] {
                            at::Tensor h = x;
                            for (auto& l : ours) h = l(h, pad_mask);
                            h.sum().backward();
                          }},
                         steps);
    std::printf("  encoder layers only: torch %.3f  ours %.3f  (ours/torch %.2f)\n", t[0], t[1], t[1] / t[0]);
  }
  PeftConfig lora, adapter;
  lora.kind = "lora", lora.rank = 8;
  adapter.kind = "adapter", adapter.adapter_dim = 16;
  const std::vector<PeftConfig> pefts{PeftConfig{}, lora, adapter};
  std::vector<model::MlmEncoder> models;
  std::vector<std::function<void()>> steps_of;
  for (const PeftConfig& peft : pefts) {
    models.emplace_back(c, vocab, pad);
    model::apply_peft(*models.back(), peft);
    steps_of.push_back([m = models.back(), &ids, &labels]() mutable {
      m->zero_grad();
      m->loss(ids, labels).backward();
    });
  }
  {
    // [5/5] recipe: the MLM loss from logits at the masked positions only (MlmEncoderImpl::loss)
    // against the full [batch, seq, vocab] logits restricted afterwards (before [5/5]).
    model::MlmEncoder m(c, vocab, pad);
    const double tokens = static_cast<double>(ids.ne(pad).sum().item<int64_t>());
    auto full = [&] {
      m->zero_grad();
      const at::Tensor logits = m->forward(ids);
      at::cross_entropy_loss(logits.reshape({-1, vocab}), labels.reshape({-1}), {}, at::Reduction::Mean,
                             model::kIgnoreIndex)
          .backward();
    };
    auto masked = [&] {
      m->zero_grad();
      m->loss(ids, labels).backward();
    };
    auto t = ms_per_step({full, masked}, steps);
    std::printf("  MLM loss, full logits %.3f (%.0f tokens/s)  masked positions only %.3f (%.0f tokens/s): %.2fx\n",
                t[0], 1e3 * tokens / t[0], t[1], 1e3 * tokens / t[1], t[0] / t[1]);
  }
  {
    // [5/5] the translation loss from logits at the target positions only (Seq2SeqImpl::loss)
    // against the full [batch, T, vocab] logits with the padding ignored afterwards.
    ModelConfig mt = c;
    mt.max_len = 64;
    const int64_t mt_vocab = 8000, mt_batch = 32;
    model::SpecialIds sid;
    sid.pad = 0, sid.bos = 1, sid.eos = 2, sid.vocab_size = mt_vocab;
    std::vector<std::vector<int>> src, tgt;
    for (int64_t i = 0; i < mt_batch; ++i)
      for (auto* side : {&src, &tgt}) {
        const int64_t len = 4 + at::randint(37, {1}).item<int64_t>();  // 4..40 pieces, BOS and EOS included
        std::vector<int> s{static_cast<int>(sid.bos)};
        for (int64_t j = 2; j < len; ++j) s.push_back(static_cast<int>(at::randint(3, mt_vocab, {1}).item<int64_t>()));
        s.push_back(static_cast<int>(sid.eos));
        side->push_back(std::move(s));
      }
    std::vector<const std::vector<int>*> sp, tp;
    for (int64_t i = 0; i < mt_batch; ++i) sp.push_back(&src[i]), tp.push_back(&tgt[i]);
    const model::Seq2SeqBatch b = model::make_seq2seq_batch(sp, tp, sid);
    model::Seq2Seq m(mt, 2, mt_vocab, sid);
    const double tokens = static_cast<double>(b.target_tokens + b.src.ne(sid.pad).sum().item<int64_t>());
    auto full = [&] {
      m->zero_grad();
      const at::Tensor logits = m->forward(b.src, b.tgt_in);
      at::cross_entropy_loss(logits.reshape({-1, mt_vocab}), b.tgt_out.reshape({-1}), {}, at::Reduction::Mean,
                             model::kIgnoreIndex, 0.1)
          .backward();
    };
    auto targets = [&] {
      m->zero_grad();
      m->loss(b.src, b.tgt_in, b.tgt_out, 0.1).backward();
    };
    auto t = ms_per_step({full, targets}, steps);
    std::printf("  translation loss, full logits %.3f (%.0f tokens/s)  target positions only %.3f (%.0f tokens/s): "
                "%.2fx\n",
                t[0], 1e3 * tokens / t[0], t[1], 1e3 * tokens / t[1], t[0] / t[1]);
  }
  auto t = ms_per_step(steps_of, steps);
  for (size_t i = 0; i < pefts.size(); ++i)
    std::printf("  MlmEncoder peft %-8s %.3f   trainable %lld of %lld parameters\n", pefts[i].kind.c_str(), t[i],
                (long long)model::numel(models[i]->trainable_parameters()),
                (long long)model::numel(models[i]->parameters()));
}

#include "model/mlm_encoder.h"

#include <ATen/ATen.h>

#include <cmath>

#include "nebula/error.h"

namespace nebula::model {

BuildSink*& build_sink() {
  thread_local BuildSink* sink = nullptr;
  return sink;
}

MlmEncoderImpl::MlmEncoderImpl(const ModelConfig& c, int64_t vocab_size, int64_t pad_id)
    : config_(c), pad_id_(pad_id), max_len_(c.max_len), dim_(c.dim), vocab_size_(vocab_size) {
  NEBULA_CHECK(vocab_size > 0 && pad_id >= 0 && pad_id < vocab_size, "vocab ", vocab_size, " pad ", pad_id);
  tokens_ = register_module("tokens", torch::nn::Embedding(vocab_size, c.dim));
  vocab_ = {0, vocab_size};
  positions_ = register_module("positions", torch::nn::Embedding(c.max_len, c.dim));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) {
    layers_.push_back(EncoderLayer(c.dim, c.heads, c.ffn, c.dropout));
    list->push_back(layers_.back());
    layer_built(*layers_.back());  // ZeRO-3 may keep only its piece of it from here
  }
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  // Small embeddings: the tied output projection starts near uniform.
  torch::NoGradGuard no_grad;
  tokens_->weight.normal_(0, 0.02);
  positions_->weight.normal_(0, 0.02);
  // Units of ZeRO-3 too, each cut once its values are final (the random draws in the order they
  // always were).
  layer_built(*tokens_);
  layer_built(*positions_);
  layer_built(*norm_);
}

at::Tensor MlmEncoderImpl::embed_tokens(const at::Tensor& ids) {
  const torch::nn::Embedding tokens = tokens_;
  const double scale = std::sqrt(static_cast<double>(dim_));
  if (tensor_) {  // vocabulary-parallel: this worker's rows, zeros for the others' ids, summed over the group
    const at::Tensor mine = ids.ge(vocab_.begin).logical_and(ids.lt(vocab_.end));
    const at::Tensor local = at::embedding(tokens_->weight, (ids - vocab_.begin).clamp(0, vocab_.size() - 1));
    return reduce_from_tensor_group(local * mine.unsqueeze(-1).to(local.scalar_type()), *tensor_) * scale;
  }
  return run_layer(gather_, *tokens_, {}, [tokens, ids, scale](const std::vector<at::Tensor>&) {
    return torch::nn::Embedding(tokens)(ids) * scale;
  });
}

at::Tensor MlmEncoderImpl::project(const at::Tensor& hidden) {
  const torch::nn::Embedding tokens = tokens_;
  if (tensor_) return at::matmul(copy_to_tensor_group(hidden, *tensor_), tokens_->weight.t());  // this worker's rows' logits
  return run_layer(gather_, *tokens_, {hidden}, [tokens](const std::vector<at::Tensor>& in) {
    return at::matmul(in[0], tokens->weight.t());
  });
}

std::vector<torch::nn::Module*> MlmEncoderImpl::units() const {
  std::vector<torch::nn::Module*> out{tokens_.ptr().get(), positions_.ptr().get()};
  for (const EncoderLayer& layer : layers_) out.push_back(layer.ptr().get());
  out.push_back(norm_.ptr().get());
  return out;
}

at::Tensor MlmEncoderImpl::embed_input(const at::Tensor& input) {
  const at::Tensor ids = input.to(tokens_->weight.device());  // a no-op when both are on the CPU
  NEBULA_CHECK(ids.dim() == 2 && ids.size(1) <= max_len_, "ids of shape ", ids.sizes(), ", max_len ", max_len_);
  const int64_t seq = ids.size(1);
  at::Tensor pos = at::arange(seq, ids.options());
  const torch::nn::Embedding positions = positions_;
  return embed_tokens(ids) + run_layer(gather_, *positions_, {}, [positions, pos](const std::vector<at::Tensor>&) {
           return torch::nn::Embedding(positions)(pos).unsqueeze(0);
         });
}

at::Tensor MlmEncoderImpl::run_layers(at::Tensor x, const at::Tensor& ids, size_t begin, size_t end) {
  NEBULA_CHECK(begin <= end && end <= layers_.size(), "layers [", begin, ", ", end, ") of ", layers_.size());
  const at::Tensor pad_mask = ids.to(x.device()).eq(pad_id_);
  for (size_t i = begin; i < end; ++i) {
    const EncoderLayer& layer = layers_[i];
    x = run_layer(gather_, *layer.ptr(), {x}, [layer, pad_mask](const std::vector<at::Tensor>& in) {
      return EncoderLayer(layer)(in[0], pad_mask);
    });
  }
  return x;
}

at::Tensor MlmEncoderImpl::final_norm(const at::Tensor& x) {
  const torch::nn::LayerNorm norm = norm_;
  return run_layer(gather_, *norm_, {x}, [norm](const std::vector<at::Tensor>& in) {
    return torch::nn::LayerNorm(norm)(in[0]);
  });
}

at::Tensor MlmEncoderImpl::encode(const at::Tensor& ids) {
  return final_norm(run_layers(embed_input(ids), ids, 0, layers_.size()));
}

at::Tensor MlmEncoderImpl::forward(const at::Tensor& ids) {
  NEBULA_CHECK(!tensor_, "MlmEncoder::forward gives the whole vocabulary's logits: not while split for tensor "
                         "parallelism (run it with the slices gathered: parallel::TensorSplit::with_whole)");
  return project(encode(ids));
}

std::vector<TensorSlice> MlmEncoderImpl::split_for_tensor(TensorGroup& group) {
  NEBULA_CHECK(!gather_ && !tensor_, "split_for_tensor on an encoder ", gather_ ? "under ZeRO-3" : "split already");
  NEBULA_CHECK(tokens_->weight.size(0) >= group.size(), "a vocabulary of ", tokens_->weight.size(0),
               " pieces cannot be split over ", group.size(), " workers");
  std::vector<TensorSlice> out;
  slice_parameter(tokens_->weight, 0, group, out);
  vocab_ = out.back().mine;
  for (EncoderLayer& layer : layers_) layer->split_for_tensor(group, out);
  tensor_ = &group;
  return out;
}

void MlmEncoderImpl::set_tensor_group(TensorGroup* group) {
  tensor_ = group;
  for (EncoderLayer& layer : layers_) layer->set_tensor_group(group);
  vocab_ = group ? slice_of(vocab_size_, group->size(), group->rank()) : SliceRange{0, vocab_size_};
}

std::vector<at::Tensor> MlmEncoderImpl::trainable_parameters() const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

at::Tensor MlmEncoderImpl::loss(const at::Tensor& ids, const at::Tensor& labels) {
  return masked_loss(encode(ids), labels);
}

at::Tensor MlmEncoderImpl::masked_loss(const at::Tensor& hidden, const at::Tensor& labels) {
  // Logits at the masked positions only: the output projection (vocab × dim per position) is
  // most of an MLM step's work, and ~85 % of the positions carry no loss.
  const at::Tensor flat = labels.reshape({-1}).to(hidden.device());
  const at::Tensor masked = flat.ne(kIgnoreIndex).nonzero().squeeze(1);
  const at::Tensor logits = project(hidden.reshape({-1, hidden.size(-1)}).index_select(0, masked));
  if (tensor_) return vocab_parallel_cross_entropy(logits, flat.index_select(0, masked), vocab_.begin, *tensor_);
  return at::cross_entropy_loss(logits, flat.index_select(0, masked), /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex);
}

at::Tensor MlmEncoderImpl::embed(const at::Tensor& ids) { return pool(encode(ids), ids); }

at::Tensor MlmEncoderImpl::pool(const at::Tensor& hidden, const at::Tensor& ids) const {
  const at::Tensor keep = ids.to(hidden.device()).ne(pad_id_).unsqueeze(-1).to(hidden.scalar_type());  // [B, T, 1]
  const at::Tensor mean = (hidden * keep).sum(1) / keep.sum(1).clamp_min(1);
  return mean / mean.norm(2, {-1}, /*keepdim=*/true).clamp_min(1e-12);
}

}  // namespace nebula::model

// Tensor parallelism inside a site ([parallel] tensor = T), Megatron-style (Shoeybi et al. 2019):
// each of T workers holds a slice of every layer and they compute each layer together.
//
//   attention   q, k, v split by output rows (column-parallel: heads / T heads per worker), out
//               split by input columns (row-parallel): each worker's out gives a partial sum,
//               one all-reduce per block adds them, then out's bias (whole on every worker).
//   MLP         linear1 column-parallel (ffn / T units), linear2 row-parallel: one all-reduce.
//   embedding   the token embedding split by vocabulary rows (vocabulary-parallel): a worker
//               looks up the ids in its rows, zeros elsewhere, one all-reduce; the tied output
//               projection gives each worker its rows' logits, and the cross-entropy is computed
//               from them without gathering the vocabulary (one max, two sums over the group).
//   the rest    LayerNorms, position embeddings and row-parallel biases whole on every worker,
//               computed alike everywhere (their gradients are equal on every worker).
//
// Two autograd functions carry it (Megatron's f and g): copy_to_tensor_group before a
// column-parallel map (identity forward, all-reduce of the gradient in backward) and
// reduce_from_tensor_group after a row-parallel map (all-reduce forward, identity backward).
// The model code stays in model/ (transformer.cc, mlm_encoder.cc split their own parameters:
// one place knows which tensor is cut along which dimension); the group is an interface that
// parallel/tensor_parallel.h implements over the site's c10d group.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace nebula::model {

// The T workers a model's layers are split over; this worker's place in them.
class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: every worker's `t` becomes the element-wise sum over the group (same shape everywhere).
  virtual void all_reduce_sum(at::Tensor& t) = 0;
};

// Rows [begin, end) of `total` split into `parts` near-equal runs (the first ones ⌈total/parts⌉
// long), run `part`'s.
struct SliceRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
SliceRange slice_of(int64_t total, int parts, int part);

// Megatron's f: x forward; in backward the gradient summed over the group. Before a
// column-parallel map, whose input is the same on every worker.
at::Tensor copy_to_tensor_group(const at::Tensor& x, TensorGroup& group);
// Megatron's g: the sum of every worker's x forward; the gradient as it is in backward. After a
// row-parallel map (each worker's partial sum).
at::Tensor reduce_from_tensor_group(const at::Tensor& x, TensorGroup& group);

// Mean cross-entropy of targets [N] (no ignored entries) from each worker's logits [N, its
// vocabulary rows] for vocabulary rows [begin, begin + logits.size(1)): the value (and
// gradients) of at::cross_entropy on the whole vocabulary's logits, on every worker of the group.
// label_smoothing in [0, 1), torch's definition over a vocabulary of `vocab` (needed then).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t begin,
                                        TensorGroup& group, double label_smoothing = 0, int64_t vocab = 0);

// One parameter a model cut for tensor parallelism: the whole tensor's size along `dim`, and
// which part of it this worker keeps (the parameter now holds only that slice).
struct TensorSlice {
  at::Tensor param;  // the parameter itself (the same tensor as the module's, sliced in place)
  int64_t dim = 0;   // 0: rows, 1: columns
  int64_t whole = 0;
  SliceRange mine;
};
// Cuts `param` in place (set_data to a copy of its slice) along `dim` into group.size() parts,
// keeping group.rank()'s, and records it (a group of one: records it, the parameter untouched).
void slice_parameter(const at::Tensor& param, int64_t dim, const TensorGroup& group, std::vector<TensorSlice>& out);

}  // namespace nebula::model

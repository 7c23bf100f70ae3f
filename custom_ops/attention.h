// ai.dietcode::ScaledDotProductAttention (formerly Attention): softmax(Q @ Kt * scale + mask) @ V, the fused attention node of
// tuner/attention_graph.py. Shapes and the CPU computation in plain C++; the ORT op (CPU and CUDA) in attention.cc.
#ifndef DIETCODE_ATTENTION_H_
#define DIETCODE_ATTENTION_H_

#include <cstdint>
#include <string>
#include <vector>

struct OrtCustomOpDomain;

namespace dietcode {

// One call: z = product of the leading dims independent heads, Q [z, seq_q, d], Kt [z, d, seq_k],
// V [z, seq_k, d], the mask read at its broadcast strides over [lead..., seq_q, seq_k] (0: broadcast axis).
struct AttentionPlan {
  std::vector<int64_t> lead;       // the leading dims of Q (the output's too)
  int64_t seq_q = 0, seq_k = 0, head_dim = 0;
  bool has_mask = false;
  std::vector<int64_t> mask_strides;  // per scores axis (lead..., seq_q, seq_k), in elements
};

// The plan for these input shapes (mask: nullptr when absent), or false with a message naming the shapes:
// Q [..., T_q, d], Kt [..., d, T_k], V [..., T_k, d] with equal leading dims and one d; a mask of rank at
// most Q's whose dims (right-aligned) are 1 or the scores'; d equal to head_dim when head_dim > 0.
bool AttentionPlanMake(const std::vector<int64_t>& q, const std::vector<int64_t>& kt, const std::vector<int64_t>& v,
                       const std::vector<int64_t>* mask, int64_t head_dim, AttentionPlan* plan, std::string* error);

// The shapes of the contiguous equivalents (Q [B, H, T_q, d], Kt [B, H, d, T_k], V [B, H, T_k, d]) of a node's
// inputs given in operand layout `layout` (bundle_impl.h kLayout*: Q, K, V as [B, S, H, d]; packed: Q, K and V
// each the one projection [B, T, 3 * H * d] with H = its last dim / (3 * head_dim)); false with a message when
// the layout is no valid bit set, a bit is set and the ranks are not 4, or a packed call's three shapes differ,
// are not rank 3, or its last dim is not a positive multiple of 3 * head_dim (head_dim > 0 required). The
// output's shape for the plan in that layout.
bool AttentionCanonical(int layout, int64_t head_dim, std::vector<int64_t>* q, std::vector<int64_t>* k,
                        std::vector<int64_t>* v, std::string* error);
std::vector<int64_t> AttentionOutputShape(const AttentionPlan& plan, int layout);

// Part `part` (0 Q, 1 K, 2 V) of a packed projection [rows, 3 * width] (rows = B * T, width = H * d) copied to
// dst [rows, width] ([B, T, H, d]).
void UnpackPart(const float* src, int64_t rows, int64_t width, int part, float* dst);

// dst = src permuted: src has dims `dims` (rank 4), dst[i0, i1, i2, i3] = src at index j with j[perm[a]] = i_a
// (dst's dims are dims[perm[a]]), as ONNX Transpose computes it.
void Permute4(const float* src, const int64_t dims[4], const int perm[4], float* dst);

// In place on the scores [z, seq_q, seq_k] (Q @ Kt): scores = scores * scale + mask, the mask read at its
// broadcast strides (mask: nullptr when absent).
void AttentionScaleMask(const AttentionPlan& plan, float scale, const float* mask, float* scores);

// Adds the Attention op (float, float16, bfloat16) for the CPU EP (ORT's MatMul and Softmax) and the CUDA EP (the
// node's bundle of tuned kernels, no other path) to the domain (inputs (Q, Kt, V, mask, bundle)).
void AddAttentionOps(OrtCustomOpDomain* domain);

}  // namespace dietcode

#endif  // DIETCODE_ATTENTION_H_

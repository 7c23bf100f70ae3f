// Output shapes and ABI views of the ai.dietcode ops, in plain C++ (no ORT types).
//
// Output shapes follow ONNX: MatMul broadcasts like numpy.matmul, Gemm is 2-D with transA/transB, Conv is
// N-D with strides/pads/dilations/auto_pad. The ABI view (abi.md) says how a shape maps onto a compiled
// kernel's M, N, K, batch and strides; shapes the ABI cannot express go to ONNX Runtime's own kernel.
#ifndef DIETCODE_SHAPES_H_
#define DIETCODE_SHAPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core.h"

namespace dietcode {

using Shape = std::vector<int64_t>;

// "[2, 3, 4]": a shape as error messages print it.
std::string ShapeText(const Shape& s);

enum class BaseOp { kMatMul, kGemm, kConv };
// In the bundle's activation code order (docs/bundle.md): Gelu the erf form, GeluTanh the tanh approximation,
// Silu x * sigmoid(x), Relu6 min(max(x, 0), 6).
enum class Activation { kNone, kRelu, kGelu, kGeluTanh, kSilu, kRelu6 };
constexpr int kActivationCount = 6;

// What a node's op type says: the base op and the fused epilogue in its order ("GemmBiasGelu",
// "MatMulBiasResidual", "ConvBiasResidualRelu", "MatMulSiluMul" etc.), applied as y = act(scale * product + bias)
// + residual, or with residual_first y = act(scale * product + bias + residual), or with residual_mul
// y = act(scale * product + bias) * residual (scale: the node's `scale` attribute).
struct OpSpec {
  BaseOp base = BaseOp::kMatMul;
  bool bias = false;
  Activation activation = Activation::kNone;
  bool residual = false;  // one more input: a tensor of the output's shape, added after the activation
  bool residual_first = false;  // ... or before it (the op type names "Residual" before the activation)
  bool residual_mul = false;  // ... or multiplied after it (the op type ends in "Mul": "MatMulSiluMul")
  std::string name;
};

// Parses "<Op>Plain", "<Op>Bias[Act]", "<Op>[Bias]Act", "<Op>[Bias][Act]Residual", "<Op>[Bias]Residual<Act>" and
// "<Op>[Bias]<Act>Mul" with Op one of MatMul, Gemm, Conv and Act one of Relu, Gelu, GeluTanh, Silu, Relu6, and the
// bare "<Op>" of models written before (as "<Op>Plain"); false for anything else.
bool ParseOpType(const std::string& op_type, OpSpec* spec);

// The 132 op type names, in registration order: the 36 without a residual first; then the 3 bare bases of models
// written before ("MatMul", "Gemm", "Conv"): 135 in all.
std::vector<std::string> AllOpTypes();

struct GemmAttrs {
  int64_t trans_a = 0, trans_b = 0;
  float alpha = 1.0f, beta = 1.0f;
};

struct ConvAttrs {
  std::vector<int64_t> strides, pads, dilations, kernel_shape;
  int64_t group = 1;
  std::string auto_pad = "NOTSET";
  // the node's `channels_last` attribute: X [N, spatial..., C], W [OC, spatial..., C], Y (and a residual)
  // [N, out spatial..., OC]; ungrouped only. Strides, pads etc. keep their ONNX order (spatial dims).
  bool channels_last = false;
};

// A channels-last shape [N, spatial..., C] as its channels-first [N, C, spatial...] (and back); a shape of
// rank below 2 is returned as is.
Shape ChannelsFirst(const Shape& s);
Shape ChannelsLast(const Shape& s);

// Each returns false with a message naming the shapes when ONNX would reject them.
bool MatMulShape(const Shape& a, const Shape& b, Shape* out, std::string* error);
bool GemmShape(const Shape& a, const Shape& b, const GemmAttrs& attrs, Shape* out, std::string* error);
bool ConvShape(const Shape& x, const Shape& w, const ConvAttrs& attrs, Shape* out, std::string* error);

int64_t NumElements(const Shape& shape);

// Fill the scalar part of dc_launch_args for a compiled kernel; false when the ABI cannot express this
// shape (e.g. general batch broadcasting, transA, alpha != 1, a conv that is not 2-D), meaning: run the vendor
// kernel.
bool MatMulView(const Shape& a, const Shape& b, const Shape& out, bool kernel_is_batched, dc_launch_args* args);
bool GemmView(const Shape& a, const Shape& b, const Shape* c, const GemmAttrs& attrs, dc_launch_args* args);
// (a grouped conv: one group's N and K, batch = group; channels_last: the same M, N, K and image sizes as
// the channels-first view of the permuted shapes)
bool ConvView(const Shape& x, const Shape& w, const Shape& out, const ConvAttrs& attrs, dc_launch_args* args);

}  // namespace dietcode

#endif  // DIETCODE_SHAPES_H_

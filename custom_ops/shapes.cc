// Output shapes and ABI views of the ai.dietcode ops (see shapes.h).
#include "shapes.h"

#include "bundle_impl.h"

#include <algorithm>
#include <limits>

namespace dietcode {

std::string ShapeText(const Shape& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}
namespace {

std::string ToString(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

bool FitsInt32(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

// Batch dims of an operand left-padded with 1 to the output's batch rank.
Shape PadBatch(const Shape& s, size_t rank) {
  Shape batch(s.begin(), s.end() - 2);
  batch.insert(batch.begin(), rank - batch.size(), 1);
  return batch;
}

}  // namespace

namespace {

// The op type of base b (0 MatMul, 1 Gemm, 2 Conv), bias, activation a (0 none, 1 Relu, 2 Gelu, 3 GeluTanh,
// 4 Silu, 5 Relu6) and residual r
// (0 none, 1 added after the activation, 2 added before it, 3 multiplied after it): "ConvBiasReluResidual",
// "ConvBiasResidualRelu", "MatMulSiluMul", "GemmBiasResidual". Empty for the combinations no op type has (r 2
// without an activation, which r 1 already names; r 3 without an activation: the multiply follows one).
// With no epilogue at all, "MatMulPlain", "GemmPlain", "ConvPlain": no op type is an ONNX op's name, which tools
// that match nodes by op type alone (onnxruntime's quantizer) would take for that op. The bare bases, the names
// models written before used, are read as the Plain ones (ParseOpType) and registered too (AllOpTypes).
const char* const kBases[] = {"MatMul", "Gemm", "Conv"};

std::string OpTypeName(int b, bool bias, int a, int r) {
  static const char* const kActivations[kActivationCount] = {"", "Relu", "Gelu", "GeluTanh", "Silu", "Relu6"};
  if (r >= 2 && a == 0) return "";
  if (!bias && a == 0 && r == 0) return std::string(kBases[b]) + "Plain";
  const std::string head = std::string(kBases[b]) + (bias ? "Bias" : "");
  if (r == 2) return head + "Residual" + kActivations[a];
  if (r == 3) return head + kActivations[a] + "Mul";
  return head + kActivations[a] + (r == 1 ? "Residual" : "");
}

}  // namespace

bool ParseOpType(const std::string& op_type, OpSpec* spec) {
  for (int b = 0; b < 3; ++b) {
    if (op_type == kBases[b]) {
      *spec = OpSpec{};
      spec->base = static_cast<BaseOp>(b);
      spec->name = op_type;
      return true;
    }
  }
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < 3; ++b) {
      for (int a = 0; a < kActivationCount; ++a) {
        for (int bias = 0; bias < 2; ++bias) {
          const std::string name = OpTypeName(b, bias == 1, a, r);
          if (name.empty() || name != op_type) continue;
          spec->base = static_cast<BaseOp>(b);
          spec->bias = bias == 1;
          spec->activation = static_cast<Activation>(a);
          spec->residual = r != 0;
          spec->residual_first = r == 2;
          spec->residual_mul = r == 3;
          spec->name = op_type;
          return true;
        }
      }
    }
  }
  return false;
}

std::vector<std::string> AllOpTypes() {
  std::vector<std::string> out;
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < 3; ++b) {
      for (int a = 0; a < kActivationCount; ++a) {
        for (bool bias : {false, true}) {
          const std::string name = OpTypeName(b, bias, a, r);
          if (!name.empty()) out.push_back(name);
        }
      }
    }
  }
  out.insert(out.end(), std::begin(kBases), std::end(kBases));
  return out;
}

int64_t NumElements(const Shape& shape) {
  // 0 for any empty shape, whatever its other dims (an empty tensor's may be anything: [2^40, 2^40, 0]), else the
  // product saturated at INT64_MAX (no tensor that exists gets there; a crafted shape must not overflow)
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return INT64_MAX;
  }
  return n;
}

bool MatMulShape(const Shape& a_in, const Shape& b_in, Shape* out, std::string* error) {
  if (a_in.empty() || b_in.empty()) {
    *error = "MatMul inputs must have rank >= 1, got " + ToString(a_in) + " x " + ToString(b_in);
    return false;
  }
  // numpy.matmul's promotion, read in place (no copies: this runs per call): a 1-D A is [1, K], a 1-D B is
  // [K, 1]; the promoted dims are dropped from the output again.
  const size_t ra = std::max<size_t>(a_in.size(), 2), rb = std::max<size_t>(b_in.size(), 2);
  auto a = [&](size_t i) -> int64_t { return a_in.size() == 1 ? (i == 0 ? 1 : a_in[0]) : a_in[i]; };
  auto b = [&](size_t i) -> int64_t { return b_in.size() == 1 ? (i == 0 ? b_in[0] : 1) : b_in[i]; };
  if (a(ra - 1) != b(rb - 2)) {
    *error = "MatMul inner dims differ: " + ToString(a_in) + " x " + ToString(b_in);
    return false;
  }
  // Batch dims, each operand's left-padded with 1 to the output's batch rank.
  const size_t rank = std::max(ra, rb) - 2, pad_a = rank - (ra - 2), pad_b = rank - (rb - 2);
  out->clear();
  for (size_t i = 0; i < rank; ++i) {
    const int64_t da = i < pad_a ? 1 : a(i - pad_a), db = i < pad_b ? 1 : b(i - pad_b);
    if (da != db && da != 1 && db != 1) {
      *error = "MatMul batch dims do not broadcast: " + ToString(a_in) + " x " + ToString(b_in);
      return false;
    }
    out->push_back(da == 1 ? db : da);
  }
  if (a_in.size() > 1) out->push_back(a(ra - 2));
  if (b_in.size() > 1) out->push_back(b(rb - 1));
  return true;
}

bool GemmShape(const Shape& a, const Shape& b, const GemmAttrs& attrs, Shape* out, std::string* error) {
  if (a.size() != 2 || b.size() != 2) {
    *error = "Gemm inputs must be 2-D, got " + ToString(a) + " and " + ToString(b);
    return false;
  }
  const int64_t m = attrs.trans_a ? a[1] : a[0], k = attrs.trans_a ? a[0] : a[1];
  const int64_t kb = attrs.trans_b ? b[1] : b[0], n = attrs.trans_b ? b[0] : b[1];
  if (k != kb) {
    *error = "Gemm inner dims differ: " + ToString(a) + " x " + ToString(b) + " (transA=" +
             std::to_string(attrs.trans_a) + ", transB=" + std::to_string(attrs.trans_b) + ")";
    return false;
  }
  *out = {m, n};
  return true;
}

Shape ChannelsFirst(const Shape& s) {
  if (s.size() < 2) return s;
  Shape t(s);
  std::rotate(t.begin() + 1, t.end() - 1, t.end());
  return t;
}

Shape ChannelsLast(const Shape& s) {
  if (s.size() < 2) return s;
  Shape t(s);
  std::rotate(t.begin() + 1, t.begin() + 2, t.end());
  return t;
}

namespace {
bool ConvShapeNchw(const Shape& x, const Shape& w, const ConvAttrs& attrs, Shape* out, std::string* error);
}  // namespace

bool ConvShape(const Shape& x, const Shape& w, const ConvAttrs& attrs, Shape* out, std::string* error) {
  if (!attrs.channels_last) return ConvShapeNchw(x, w, attrs, out, error);
  if (attrs.group != 1) {
    *error = "a channels-last Conv must have group 1, got group " + std::to_string(attrs.group);
    return false;
  }
  if (x.size() < 3 || w.size() != x.size()) {
    *error = "a channels-last Conv needs X [N, spatial..., C] and W [OC, spatial..., C] of the same rank, got " +
             ToString(x) + " and " + ToString(w);
    return false;
  }
  Shape nchw;
  if (!ConvShapeNchw(ChannelsFirst(x), ChannelsFirst(w), attrs, &nchw, error)) {
    *error += " (channels-last X " + ToString(x) + ", W " + ToString(w) + ")";
    return false;
  }
  *out = ChannelsLast(nchw);
  return true;
}

namespace {
bool ConvShapeNchw(const Shape& x, const Shape& w, const ConvAttrs& attrs, Shape* out, std::string* error) {
  if (x.size() < 3 || w.size() != x.size()) {
    *error = "Conv needs X [N, C, spatial...] and W of the same rank, got " + ToString(x) + " and " + ToString(w);
    return false;
  }
  const size_t sp = x.size() - 2;
  auto get = [&](const std::vector<int64_t>& v, size_t i, int64_t def) { return v.empty() ? def : v[i]; };
  if ((!attrs.strides.empty() && attrs.strides.size() != sp) || (!attrs.dilations.empty() && attrs.dilations.size() != sp) ||
      (!attrs.pads.empty() && attrs.pads.size() != 2 * sp) ||
      (!attrs.kernel_shape.empty() && attrs.kernel_shape.size() != sp)) {
    *error = "Conv attributes do not match " + std::to_string(sp) + " spatial dims";
    return false;
  }
  for (int64_t p : attrs.pads) {
    if (p < 0) {
      *error = "Conv pads must be >= 0, got " + ToString(attrs.pads);
      return false;
    }
  }
  // (no product that could overflow: a crafted group may be any int64)
  if (attrs.group < 1 || attrs.group > x[1] || x[1] % attrs.group != 0 || x[1] / attrs.group != w[1] ||
      w[0] % attrs.group != 0) {
    *error = "Conv channels: X " + ToString(x) + ", W " + ToString(w) + ", group " + std::to_string(attrs.group);
    return false;
  }
  *out = {x[0], w[0]};
  for (size_t i = 0; i < sp; ++i) {
    const int64_t in = x[i + 2], k = get(attrs.kernel_shape, i, w[i + 2]);
    const int64_t s = get(attrs.strides, i, 1), d = get(attrs.dilations, i, 1);
    if (s < 1 || d < 1) {
      *error = "Conv strides and dilations must be >= 1";
      return false;
    }
    // the window's extent d * (k - 1) + 1 and the padded input, checked: crafted dilations and pads may be any
    // int64 (overflowed, either is past any input: an empty output); floor division, as ONNX's output size
    int64_t o = 0, extent = 0, padded = in;
    const bool huge = k < 1 || __builtin_mul_overflow(d, k - 1, &extent) ||
                      (attrs.auto_pad != "VALID" && (__builtin_add_overflow(in, get(attrs.pads, i, 0), &padded) ||
                                                     __builtin_add_overflow(padded, get(attrs.pads, i + sp, 0), &padded)));
    if (attrs.auto_pad == "SAME_UPPER" || attrs.auto_pad == "SAME_LOWER") {
      o = in / s + (in % s != 0);
    } else if (attrs.auto_pad == "VALID" || attrs.auto_pad == "NOTSET" || attrs.auto_pad.empty()) {
      o = huge || padded - 1 < extent ? 0 : (padded - 1 - extent) / s + 1;
    } else {
      *error = "Conv auto_pad '" + attrs.auto_pad + "', allowed: NOTSET, SAME_UPPER, SAME_LOWER, VALID";
      return false;
    }
    if (o < 1) {
      *error = "Conv output would be empty for X " + ToString(x) + " and W " + ToString(w);
      return false;
    }
    out->push_back(o);
  }
  return true;
}
}  // namespace

bool MatMulView(const Shape& a, const Shape& b, const Shape& out, bool kernel_is_batched, dc_launch_args* args) {
  if (a.size() < 2 || b.size() < 2) return false;
  const int64_t k = a.back(), n = b.back();
  if (!kernel_is_batched) {
    // gemm view: A flattened over its leading dims; B must be a single [K, N] matrix.
    if (NumElements(b) != k * n) return false;
    const int64_t m = NumElements(Shape(a.begin(), a.end() - 1));  // not NumElements(a) / K: K may be 0
    if (!FitsInt32(m) || !FitsInt32(n) || !FitsInt32(k)) return false;
    args->M = static_cast<int32_t>(m), args->N = static_cast<int32_t>(n), args->K = static_cast<int32_t>(k);
    args->batch = 1, args->stride_a_batch = 0, args->stride_b_batch = 0;
    return true;
  }
  // bmm view: each operand's batch dims are either the output's or all 1 (stride 0).
  const size_t rank = out.size() - 2;
  const Shape out_batch(out.begin(), out.end() - 2);
  const Shape pa = PadBatch(a, rank), pb = PadBatch(b, rank);
  const int64_t m = a[a.size() - 2], batch = NumElements(out_batch);
  const int64_t na = NumElements(pa), nb = NumElements(pb);
  if ((pa != out_batch && na != 1) || (pb != out_batch && nb != 1)) return false;
  const int64_t sa = na == 1 ? 0 : m * k, sb = nb == 1 ? 0 : k * n;
  if (!FitsInt32(m) || !FitsInt32(n) || !FitsInt32(k) || !FitsInt32(batch) || !FitsInt32(sa) || !FitsInt32(sb)) return false;
  args->M = static_cast<int32_t>(m), args->N = static_cast<int32_t>(n), args->K = static_cast<int32_t>(k);
  args->batch = static_cast<int32_t>(batch);
  args->stride_a_batch = static_cast<int32_t>(sa), args->stride_b_batch = static_cast<int32_t>(sb);
  return true;
}

bool GemmView(const Shape& a, const Shape& b, const Shape* c, const GemmAttrs& attrs, dc_launch_args* args) {
  if (attrs.trans_a || attrs.alpha != 1.0f || (c != nullptr && attrs.beta != 1.0f)) return false;
  const int64_t m = a[0], k = a[1], n = attrs.trans_b ? b[0] : b[1];
  if (c != nullptr && NumElements(*c) != n) return false;  // only a bias broadcast along N
  if (c != nullptr && c->size() == 2 && (*c)[1] != n) return false;
  if (!FitsInt32(m) || !FitsInt32(n) || !FitsInt32(k)) return false;
  args->M = static_cast<int32_t>(m), args->N = static_cast<int32_t>(n), args->K = static_cast<int32_t>(k);
  args->batch = 1;
  return true;
}

bool ConvView(const Shape& x, const Shape& w, const Shape& out, const ConvAttrs& attrs, dc_launch_args* args) {
  // a grouped conv: `group` GEMMs of one group's output channels and reduction, the group the grid's z (batch)
  if (x.size() != 4 || w.size() != 4 || out.size() != 4 || attrs.group < 1 || w[0] % attrs.group != 0) return false;
  // channels-last (ungrouped only; ConvShape refuses others): the channels-first view of the permuted shapes
  if (attrs.channels_last && attrs.group != 1) return false;
  const bool cl = attrs.channels_last;
  const size_t c = cl ? 3 : 1, h = cl ? 1 : 2, wd = cl ? 2 : 3;  // the positions of C, H, W
  const int64_t m = out[0] * out[h] * out[wd], n = w[0] / attrs.group, k = w[c] * w[h] * w[wd];
  for (int64_t v : {m, n, k, x[0], x[h], x[wd], out[h], out[wd], attrs.group}) {
    if (!FitsInt32(v)) return false;
  }
  args->M = static_cast<int32_t>(m), args->N = static_cast<int32_t>(n), args->K = static_cast<int32_t>(k);
  args->batch = static_cast<int32_t>(attrs.group);
  args->img_n = static_cast<int32_t>(x[0]), args->img_h = static_cast<int32_t>(x[h]), args->img_w = static_cast<int32_t>(x[wd]);
  args->out_h = static_cast<int32_t>(out[h]), args->out_w = static_cast<int32_t>(out[wd]);
  return true;
}

}  // namespace dietcode

extern "C" int dc_abi_view(int op, const int64_t* a, size_t ra, const int64_t* b, size_t rb, const int64_t* c,
                           size_t rc, const int64_t* ints, size_t n_ints, const float* floats, size_t n_floats,
                           int batched, dc_launch_args* out) {
  using namespace dietcode;
  if (a == nullptr || b == nullptr || out == nullptr || ra > 16 || rb > 16 || rc > 16) {
    SetError("dc_abi_view: null shapes or arguments, or a rank above 16");
    return -1;
  }
  const Shape sa(a, a + ra), sb(b, b + rb);
  const Shape sc = c != nullptr ? Shape(c, c + rc) : Shape();
  *out = dc_launch_args{};
  Shape shape;
  std::string error;
  bool ok = false;
  if (op == 0) {
    ok = MatMulShape(sa, sb, &shape, &error) && MatMulView(sa, sb, shape, batched != 0, out);
  } else if (op == 1) {
    if (n_ints != 2 || n_floats != 2 || ints == nullptr || floats == nullptr) {
      SetError("dc_abi_view: Gemm takes ints (trans_a, trans_b) and floats (alpha, beta)");
      return -1;
    }
    GemmAttrs attrs;
    attrs.trans_a = ints[0], attrs.trans_b = ints[1], attrs.alpha = floats[0], attrs.beta = floats[1];
    ok = GemmShape(sa, sb, attrs, &shape, &error) && GemmView(sa, sb, c != nullptr ? &sc : nullptr, attrs, out);
  } else if (op == 2) {
    if ((n_ints != 9 && n_ints != 10) || ints == nullptr) {
      SetError("dc_abi_view: Conv takes ints (strides[2], pads[4], dilations[2], group[, channels_last])");
      return -1;
    }
    if (n_ints == 10 && ints[9] != 0 && ints[9] != 1) {
      SetError("dc_abi_view: Conv's channels_last (the 10th int) must be 0 or 1, got " + std::to_string(ints[9]));
      return -1;
    }
    ConvAttrs attrs;
    attrs.strides = {ints[0], ints[1]}, attrs.pads = {ints[2], ints[3], ints[4], ints[5]};
    attrs.dilations = {ints[6], ints[7]}, attrs.group = ints[8];
    attrs.channels_last = n_ints == 10 && ints[9] == 1;
    ok = ConvShape(sa, sb, attrs, &shape, &error) && ConvView(sa, sb, shape, attrs, out);
  } else {
    SetError("dc_abi_view: op must be 0 (MatMul), 1 (Gemm) or 2 (Conv)");
    return -1;
  }
  if (!error.empty()) {
    SetError(error);
    return -1;
  }
  return ok ? 1 : 0;
}

"""Inspect: what an optimized model carries, node by node (workload, kernels, dispatch tree, tuned ranges).

Part of the runtime: it reads bundles through the C core (``read_bundle``) and needs nothing of the tuner.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from dietcode_ort.bundle import (DOMAIN, LIBRARY_OP_TYPES, Bundle, BundleKernel, dietcode_nodes, is_attention, node_bundles,
                                 read_bundle)
from dietcode_ort.errors import DietcodeError, check_model_file
from dietcode_ort.toolchain import format_driver, format_isa, ptx_mma, ptx_mma_shapes, ptx_target

__all__ = ["describe", "inspect_command", "load_optimized"]


def _render(bundle: Bundle, labels: list[str] | None) -> str:
    """The dispatch tree as a readable if-chain, each leaf named by the node's tuned config when known."""
    names = tuple(labels) if labels and len(labels) == len(bundle.kernels) else \
        tuple(k.name if k.kind == "triton" else "vendor" for k in bundle.kernels)
    return bundle.tree.render([f.name for f in bundle.features], names)


def _view(bundle: Bundle) -> str:
    """How the node's compiled kernels read its operands (gemm, bmm, conv); "vendor" when it has none."""
    views = sorted({k.view for k in bundle.kernels if k.kind == "triton"})
    return "/".join(views) or "vendor"


def _info(node: onnx.NodeProto, attr: onnx.AttributeProto) -> dict:
    """The node's JSON description; a malformed one is an error naming the node."""
    try:
        info = json.loads(attr.s.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DietcodeError(f"custom node {node.name!r}: its 'info' attribute is not JSON ({exc})") from None
    ranges = info.get("ranges", {}) if isinstance(info, dict) else None
    kernels = info.get("kernels", []) if isinstance(info, dict) else None
    if not isinstance(info, dict) or not isinstance(info.get("workload", {}), dict) \
            or not isinstance(ranges, dict) or not all(isinstance(r, list) and len(r) == 2 for r in ranges.values()) \
            or not isinstance(kernels, list) or not all(isinstance(k, str) for k in kernels):
        raise DietcodeError(f"custom node {node.name!r}: its 'info' attribute is not a description written by "
                            "`dietcode-ort optimize` (expected an object with workload, kernels and ranges)")
    return info


def _images(kernel: BundleKernel) -> list[dict]:
    """Each image of a kernel with what made it, the oldest driver that loads it and the global scratch it asks
    per program (TMA descriptors; docs/bundle.md)."""
    scratch = [*kernel.image_scratch, kernel.ptx_scratch]  # the cubins in order, then the PTX (as all_images)
    return [{"kind": choice.kind, "arch": choice.arch, "triton": chain.triton or None, "ptxas": chain.ptxas or None,
             "ptx_isa": format_isa(chain.ptx_isa) if chain.ptx_isa else None,
             "min_driver": format_driver(chain.min_driver) if chain.min_driver else None,
             "global_scratch": {"bytes": size, "align": align}}
            for (choice, chain), (size, align) in zip(kernel.all_images(), scratch)]


def _ptx_mma(ptx: str) -> dict | None:
    """The tensor-core instruction of a kernel's PTX and the arch it was written for (the bundle's PTX is the
    oldest target's: an sm_80 PTX says mma.sync even when the sm_90a cubin beside it uses wgmma)."""
    if not ptx:
        return None
    return {"target": ptx_target(ptx), "mma": ptx_mma(ptx), "shapes": list(ptx_mma_shapes(ptx))}


def _toolchain_line(chain: dict) -> str:
    parts = [f"triton {chain['triton']}" if chain["triton"] else "", f"ptxas {chain['ptxas']}" if chain["ptxas"] else "",
             f"PTX ISA {chain['ptx_isa']}" if chain["ptx_isa"] else "",
             f"driver >= {chain['min_driver']}" if chain["min_driver"] else "no driver requirement recorded",
             (f"global scratch {chain['global_scratch']['bytes']} B per program (aligned to "
              f"{chain['global_scratch']['align']})") if chain.get("global_scratch", {}).get("bytes") else ""]
    return f"{chain['kind']} {chain['arch']}: " + ", ".join(p for p in parts if p)


_REQUIRED = object()


def _attr(node: onnx.NodeProto, name: str, kind: int, default: object = _REQUIRED) -> Any:
    """Attribute ``name`` of ``node``, which must be of type ``kind`` (as the library checks it at session
    creation); ``default`` where it is absent, an error naming the node where it is required."""
    attr = next((a for a in node.attribute if a.name == name), None)
    if attr is None:
        if default is _REQUIRED:
            raise DietcodeError(f"custom node {node.name!r} ({node.op_type}): the {name!r} attribute is missing")
        return default
    if attr.type != kind:
        raise DietcodeError(f"custom node {node.name!r} ({node.op_type}): the {name!r} attribute is "
                            f"{onnx.AttributeProto.AttributeType.Name(attr.type)}, not "
                            f"{onnx.AttributeProto.AttributeType.Name(kind)}")
    return onnx.helper.get_attribute_value(attr)


def _attention(node: onnx.NodeProto) -> dict:
    """A fused Attention node's own facts (tuner/attention_graph.py): its inputs and attributes."""
    ints = {name: _attr(node, name, onnx.AttributeProto.INT, default)
            for name, default in (("head_dim", 0), ("nan_to_zero", 0), ("mask_rows", 1), ("causal", 0), ("layout", 0))}
    inputs = [name for name, value in zip(["Q", "Kt", "V", "mask"], node.input) if value]
    return {"inputs": inputs, "scale": _attr(node, "scale", onnx.AttributeProto.FLOAT), "head_dim": ints["head_dim"],
            "nan_to_zero": bool(ints["nan_to_zero"]), "mask_rows": bool(ints["mask_rows"]),
            "causal": bool(ints["causal"]), "layout": ints["layout"]}


def _layout_text(layout: int) -> str:
    """The operands an Attention node reads/writes as [batch, seq, heads, d] (docs/abi.md "Attention layouts")."""
    return (",".join(op for op, bit in (("q", 1), ("k", 2), ("v", 4), ("out", 8)) if layout & bit) + "=BSHD"
            + (",qkv=packed" if layout & 16 else ""))


def epilogue_of(node: onnx.NodeProto) -> dict:
    """What the node fuses after its product, as the library reads it: the op type's suffixes in their order
    and the ``scale`` attribute, applied as act(alpha * product + bias) + residual, or with ``residual_first``
    (``ConvBiasResidualRelu``) act(alpha * product + bias + residual), or with ``residual_mul``
    (``MatMulSiluMul``) act(alpha * product + bias) * residual."""
    import re

    from dietcode_ort.bundle import ACTIVATION_CODES, ACTIVATION_OP_NAMES

    acts = "|".join(sorted(ACTIVATION_OP_NAMES[1:], key=len, reverse=True))  # Relu6 before Relu
    m = re.fullmatch(rf"(MatMul|Gemm|Conv)(?:Plain|(Bias)?(?:({acts})?(Residual|Mul)?|(Residual)({acts})))",
                     node.op_type)
    scale = _attr(node, "scale", onnx.AttributeProto.FLOAT, 1.0)
    if m is None:
        return {"alpha": float(scale)}
    first = m.group(5) is not None
    act = m.group(6 if first else 3) or ""
    return {"alpha": float(scale), "bias": bool(m.group(2)),
            "activation": ACTIVATION_CODES[ACTIVATION_OP_NAMES.index(act)],
            "residual": first or bool(m.group(4)), "residual_first": first, "residual_mul": m.group(4) == "Mul"}


def _epilogue_text(e: dict) -> str:
    act = e["activation"] if e.get("activation", "none") != "none" else ""
    mul = bool(e.get("residual_mul"))
    steps = ["residual", act] if e.get("residual_first") else [act, "residual" if e.get("residual") and not mul else ""]
    parts = [f"alpha={e['alpha']:.6g}" if e.get("alpha", 1.0) != 1.0 else "", "bias" if e.get("bias") else "", *steps]
    return ("+".join(p for p in parts if p) or "-") + ("*residual" if mul else "")  # the SwiGLU gate: silu*residual


def describe(model: onnx.ModelProto, base_dir: str | Path | None = None) -> list[dict]:
    """Each ai.dietcode node's description; ``base_dir``: where the model's external data lives when it was
    loaded without it."""
    nodes: list[dict] = []
    custom = dietcode_nodes(model)
    parsed: dict[str, Bundle] = {}
    for (node, *_, graph), where in zip(custom, node_bundles(model, None if base_dir is None else str(base_dir))):
        attrs = {a.name: a for a in node.attribute}
        if where.initializer not in parsed:
            try:
                parsed[where.initializer] = read_bundle(where.payload)
            except DietcodeError as exc:
                raise DietcodeError(f"node {node.name!r}: {exc}") from None
        bundle = parsed[where.initializer]
        info = _info(node, attrs["info"]) if "info" in attrs else {}
        nodes.append({
            # exporters may leave names empty: then the node is named by its output
            "name": node.name or node.output[0], "op": node.op_type, "workload": info.get("workload"),
            "library_op": node.op_type in LIBRARY_OP_TYPES,  # else ORT runs its fallback function (renamed_note)
            "graph": graph,  # "" in the main graph, else the If branch (or loop body) it is in
            "epilogue": epilogue_of(node),
            "bundle": {"initializer": where.initializer, "bytes": len(where.payload)},
            "view": _view(bundle),
            "kernels": [{"name": k.name, "kind": k.kind, "view": k.view if k.kind == "triton" else None,
                         "archs": [a for a, _ in k.images], "images": _images(k),
                         "block_m": k.block_m, "block_n": k.block_n, "num_warps": k.num_warps,
                         "shared": k.shared, "image_shared": dict(zip((a for a, _ in k.images), k.image_shared)),
                         "split_k": k.split_k, "workspace": "workspace" in k.params, "div16": list(k.div16),
                         "alpha": k.alpha, "ptx_mma": _ptx_mma(k.ptx),
                         "built_for": {"dtype": k.dtype, "activation": k.activation, "trans_b": k.trans_b,
                                       "conv": list(k.conv), "grouped": k.grouped, "nhwc": k.channels_last,
                                       "precision": _precision(k)}}
                        for k in bundle.kernels],
            "configs": info.get("kernels"),
            "features": [f.name for f in bundle.features],
            "tree": {"feature": list(bundle.tree.feature), "threshold": list(bundle.tree.threshold),
                     "left": list(bundle.tree.left), "right": list(bundle.tree.right),
                     "leaf": list(bundle.tree.leaf), "if_chain": _render(bundle, info.get("kernels"))},
            "ranges": info.get("ranges", {}),
            "tuning": info.get("tuning"),
        })
        if is_attention(node.op_type):
            nodes[-1]["attention"] = _attention(node)
            # the SCALE the kernels were compiled with (their recorded alpha), which the runtime checks
            nodes[-1]["attention"]["kernel_scale"] = sorted({k.alpha for k in bundle.kernels if k.kind == "triton"})
    return nodes


def renamed_note(nodes: list[tuple[str, str]]) -> str:
    """What to say of ai.dietcode nodes (name, op type) whose op type the library does not run: ORT runs their
    fallback functions, so they get no dietcode kernel. onnx.compose's ``add_prefix`` and ``merge_models`` rename
    a model's local functions and, with them, the op types of the nodes calling them. "" for none."""
    if not nodes:
        return ""
    shown = ", ".join(f"{name!r} ({op})" for name, op in nodes[:3]) + (f" and {len(nodes) - 3} more"
                                                                       if len(nodes) > 3 else "")
    return (f"{len(nodes)} {DOMAIN} node(s) have an op type the library does not run: {shown}. ONNX Runtime runs "
            "their fallback functions (the original ops), with no dietcode kernel. onnx.compose's add_prefix and "
            "merge_models rename a model's functions and so its op types: merge the original models and optimize "
            "the merged one, or use add_prefix(..., rename_functions=False)")


def _kernel_facts(k: dict) -> str:
    """" tf32 (mma.sync, sm_80 PTX)": a compiled float32 kernel's precision and the MMA its PTX uses (" nhwc" first
    for a channels-last conv kernel)."""
    precision = f" {k['built_for']['precision']}" if k["built_for"]["precision"] else ""
    return (" nhwc" if k["built_for"].get("nhwc") else "") + precision + (f" ({k['ptx_mma']['mma']}, {k['ptx_mma']['target']} PTX)" if k["ptx_mma"] else "")


def _precision(k: BundleKernel) -> str | None:
    """How a compiled float32 kernel computes its dots ("tf32" or "ieee"); None for other kernels."""
    if k.kind != "triton" or k.dtype != "float32":
        return None
    return "tf32" if k.tf32 else "ieee"


def load_optimized(path: str | Path) -> onnx.ModelProto:
    """The model's graph without its external data (bundles are read from it on demand); DietcodeError for
    a missing or unreadable file."""
    path = Path(path)
    check_model_file(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, onnx raises several kinds
        raise DietcodeError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node:
        raise DietcodeError(f"{path} is not a readable ONNX model (its graph has no nodes)")
    return model


def inspect_command(path: str, as_json: bool) -> int:
    model = load_optimized(path)
    nodes = describe(model, Path(path).parent)
    if as_json:
        print(json.dumps({"nodes": nodes}, indent=2))
        return 0
    if not nodes:
        print(f"{path}: no {DOMAIN} nodes (not optimized by dietcode-ort)")
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=max(Console().width, 140))
    bundles = {n["bundle"]["initializer"]: n["bundle"]["bytes"] for n in nodes if n["bundle"]}
    table = Table(title=f"{len(nodes)} {DOMAIN} nodes, {len(bundles)} distinct kernel bundles "
                        f"({sum(bundles.values()) / 1e6:.2f} MB, stored once each)")
    for col in ("node", "op", "epilogue", "workload", "kernels", "tuned ranges", "dispatch"):
        table.add_column(col, overflow="fold")
    for n in nodes:
        w = n["workload"] or {}
        work = f"{w.get('op', '?')} M={w.get('m')} N={w.get('n')} K={w.get('k')}" + (
            f" batch={w['batch']}" if w.get("batch", "1") != "1" else "")
        epilogue = _epilogue_text(n["epilogue"])
        if "attention" in n:
            a = n["attention"]
            epilogue = "-"  # the scale applies to the scores, before the softmax
            baked = ",".join(f"{x:.6g}" for x in a["kernel_scale"])
            work = (f"attention({', '.join(a['inputs'])}) scale={a['scale']:.6g} (kernels {baked}) "
                    f"head_dim={a['head_dim']}"
                    + (" nan_to_zero" if a["nan_to_zero"] else "") + (" causal" if a["causal"] else "")
                    + (f" layout={_layout_text(a['layout'])}" if a["layout"] else ""))
        names = list(n["configs"] or [k["name"] for k in n["kernels"]])
        if len(names) == len(n["kernels"]):  # one line per kernel: its precision and which MMA its PTX uses
            names = [name + _kernel_facts(k) for name, k in zip(names, n["kernels"])]
        kernels = "\n".join(names)
        ranges = ", ".join(f"{k} {lo}..{hi}" for k, (lo, hi) in n["ranges"].items()) or "-"
        name = f"{n['graph']}: {n['name']}" if n["graph"] else n["name"]
        # names, the info text and toolchain versions come from the model: plain text, never rich markup
        table.add_row(*(Text(_printable(c)) for c in (name, n["op"], epilogue, work, kernels, ranges,
                                                      n["tree"]["if_chain"])))
    console.print(table)
    note = renamed_note([(n["name"], n["op"]) for n in nodes if not n["library_op"]])
    if note:
        console.print(Text(_printable(f"warning: {note}")))
    lines = sorted({_toolchain_line(image) for n in nodes for k in n["kernels"] for image in k["images"]})
    if lines:
        console.print(Text(_printable("images (what made them, the oldest CUDA driver that loads them):\n  "
                                      + "\n  ".join(lines))))
    return 0


def _printable(text: str) -> str:
    """``text`` with its control characters (a terminal's escape sequences in a crafted node name) escaped;
    line breaks stay."""
    return "".join(c if c == "\n" or c.isprintable() else repr(c)[1:-1] for c in text)

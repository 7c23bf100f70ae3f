"""Instance counts are bounded: a huge --dim range, a long weighted list, a product of ranges or a shape
log with many distinct shapes is bucketed to at most MAX_INSTANCES instances (the output says so), with
the total weight kept, in bounded time and memory."""
from __future__ import annotations

import json
import logging
import time
import tracemalloc

import pytest

from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError
from tuner import instances
from tuner.instances import MAX_INSTANCES, instances_from_shape_log, parse_dim_options, parse_dim_spec


def test_huge_range_is_bucketed_in_bounded_time_and_memory(caplog):
    caplog.set_level(logging.WARNING)
    tracemalloc.start()
    started = time.perf_counter()
    spec = parse_dim_spec("n=1:1000000")
    took = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    values = [v for v, _ in spec.values]
    assert len(values) == MAX_INSTANCES and values[0] == 1 and values[-1] == 1000000
    assert values == sorted(set(values))
    assert sum(w for _, w in spec.values) == pytest.approx(1000000)
    assert took < 1.0 and peak < 8 << 20, (took, peak)
    assert "1000000 values; tuning for 1024" in caplog.text


def test_small_ranges_are_kept_exactly():
    spec = parse_dim_spec("seq=16:512:16")
    assert spec.values == tuple((v, 1.0) for v in range(16, 513, 16))


def test_weighted_list_is_merged_and_bucketed():
    assert parse_dim_spec("s=16@3,64,16").values == ((16, 4.0), (64, 1.0))
    items = ",".join(f"{v}@{1 + v % 3}" for v in range(1, 5001))
    spec = parse_dim_spec(f"s={items}")
    assert len(spec.values) == MAX_INSTANCES
    assert sum(w for _, w in spec.values) == pytest.approx(sum(1 + v % 3 for v in range(1, 5001)))


def test_product_over_symbols_is_capped(caplog):
    caplog.set_level(logging.WARNING)
    specs = parse_dim_options(["batch=1:64", "seq=1:2048"], ["batch", "seq"])
    counts = {n: len(s.values) for n, s in specs.items()}
    assert counts["batch"] * counts["seq"] <= MAX_INSTANCES
    assert sum(w for _, w in specs["seq"].values) == pytest.approx(2048)
    assert "combinations of batch, seq" in caplog.text
    # just over the cap, or one narrow symbol: the product ends as close under it as it can (halving the widest
    # symbol tuned 528 of 33 x 33's 1089)
    for dims, kept in ((["batch=1:33", "seq=1:33"], {"batch": 32, "seq": 32}),
                       (["batch=1:3", "seq=1:1000"], {"batch": 3, "seq": 341}),
                       (["a=1:20", "b=1:20", "c=1:20"], {"a": 10, "b": 10, "c": 10})):
        specs = parse_dim_options(dims, [d.split("=")[0] for d in dims])
        assert {n: len(s.values) for n, s in specs.items()} == kept


def test_weights_too_small_to_multiply_are_refused():
    """A product of tiny weights underflowed to 0, which the tuner refused naming an internal object."""
    with pytest.raises(DietcodeError, match="weights must be positive and finite, at least 1e-12 and at most 1e"):
        parse_dim_options(["batch=1@1e-300,2@1e-300"], ["batch"])


def test_shape_log_with_many_shapes_keeps_the_frequent_ones_and_spans_the_rest(tmp_path, caplog, monkeypatch):
    """Past MAX_INSTANCES distinct shapes a log is tuned for representatives: the most frequent, then shapes spread
    over the rest (its ends included), each weighted by the calls nearest to it, so no call's weight is lost. (The
    1024 most frequent alone tuned a log of 4096 equally frequent token counts for 1..1024 only.)"""
    caplog.set_level(logging.WARNING)
    records = [{"x": [1, s], "count": 50 if s % 700 == 0 else 1} for s in range(1, 4097)]
    log = tmp_path / "shapes.json"
    log.write_text(json.dumps(records))
    counts = instances_from_shape_log(log, {"x": ("batch", "seq")})
    assert len(counts) == MAX_INSTANCES
    assert sum(counts.values()) == pytest.approx(4096 - 5 + 5 * 50)
    seqs = sorted(dict(key)["seq"] for key in counts)
    assert seqs[0] == 1 and seqs[-1] == 4096 and sum(s > 2048 for s in seqs) > 64
    assert all(counts[(("batch", 1), ("seq", s))] >= 50 for s in range(700, 4097, 700))  # frequent shapes are kept
    assert "4096 distinct shapes" in caplog.text and "representatives" in caplog.text
    # two symbols: each one's whole observed range is tuned for, and the large values are not left out
    grid = [{"x": [b, s]} for b in range(1, 33) for s in range(1, 129)]
    log.write_text(json.dumps(grid))
    counts = instances_from_shape_log(log, {"x": ("batch", "seq")})
    assert len(counts) == MAX_INSTANCES and sum(counts.values()) == pytest.approx(32 * 128)
    shapes = [dict(key) for key in counts]
    for name, top in (("batch", 32), ("seq", 128)):
        assert min(s[name] for s in shapes) == 1 and max(s[name] for s in shapes) == top
    assert sum(s["batch"] > 16 for s in shapes) > 128
    assert instances_from_shape_log(log, {"x": ("batch", "seq")}) == counts  # the same log, the same choice
    monkeypatch.setattr(instances, "MAX_SHAPE_LOG_BYTES", 100)
    with pytest.raises(DietcodeError, match="over the 0 MiB limit"):
        instances_from_shape_log(log, {"x": ("batch", "seq")})


def test_scan_says_so(tmp_path, capsys):
    from _bad_models import matmul_model, save

    model = save(matmul_model(), tmp_path / "tiny.onnx")
    assert main(["scan", str(model), "--dim", "n=1:1000000", "--json"]) == 0
    out = capsys.readouterr()
    (workload,) = json.loads(out.out)["workloads"]
    assert len(workload["instances"]) == MAX_INSTANCES
    assert "tuning for 1024" in out.err


def test_each_workload_is_capped_over_its_own_symbols():
    """Values given for dims a workload does not use do not thin out its shapes: a dense MatMul over u keeps all
    of u's 512 values while a batched one over a, b and u is bucketed to MAX_INSTANCES (the cap over the product
    of every symbol left the dense one 2 values of u)."""
    from onnx import TensorProto, helper

    from tuner.scan import attach_instances, scan_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["u", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "u", 8])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("d", "e")]
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], [0.0] * 64)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["d"]), helper.make_node("MatMul", ["y", "w"], ["e"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, y], outs, [w]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    scanned = attach_instances(scan_model(model), ["u=1:512", "a=1:8", "b=1:8"])
    counts = {w.nodes[0]: len(w.instances) for w in scanned.workloads}
    assert counts == {"d": 512, "e": MAX_INSTANCES}

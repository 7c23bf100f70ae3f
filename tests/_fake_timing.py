"""A timing backend for tests: plays the GPU timing child's part on the CPU (tuner.gpu_timing's hook).

Named as ``backend="_fake_timing:FakeBackend"``; it runs in the spawned child, which imports it through the
parent's sys.path. What it does per config key comes from the JSON in $DIETCODE_FAKE_TIMING (read when the
child starts): "exit" (os._exit mid-batch), "signal" (SIGSEGV), "hang", "lost" (a poisoned context),
"refuse" (a failure that follows from the config), "raise" (an unexpected exception); every other item gets
1 us per row of M. With "log": PATH, each timed item appends a JSON line: the child's pid, the config, the
kernel's div16 and params as the bundle holds them, and the launch view the C core computes for the node call.
With "refuse_start": the backend refuses to start.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

from tuner.gpu_timing import ContextLost, TimingBackend, TimingItem, node_call
from tuner.measure import MeasureResult

ENV = "DIETCODE_FAKE_TIMING"


class FakeBackend(TimingBackend):
    def device_key(self) -> str:
        return "model=fake;arch=sm_90;driver=0;triton=0"

    def open(self) -> None:
        self.plan = json.loads(os.environ.get(ENV, "{}"))
        if self.plan.get("refuse_start"):
            raise RuntimeError("no GPU in this fake")

    def time(self, item: TimingItem) -> MeasureResult:
        action = self.plan.get(item.config)
        if action == "exit":
            os._exit(7)
        if action == "signal":
            os.kill(os.getpid(), signal.SIGSEGV)
        if action == "hang":
            time.sleep(3600)
        if action == "lost":
            raise ContextLost("CUDA_ERROR_ILLEGAL_ADDRESS (fake)")
        if action == "refuse":
            return MeasureResult(math.inf, "does not fit this GPU (fake)")
        if action == "raise":
            raise RuntimeError("unexpected (fake)")
        if "log" in self.plan:
            self._log(item)
        return MeasureResult(1e-6 * item.problem.m)

    def _log(self, item: TimingItem) -> None:
        from dietcode_ort.bundle import read_bundle
        from dietcode_ort.runtime import load_core

        kernel = read_bundle(item.bundle).kernels[0]
        if item.op == "attention":  # the attention view: seq_q, seq_k, heads, z and the mask's strides
            att = load_core().attention_view(**node_call(item))
            assert att is not None
            record = {"pid": os.getpid(), "config": item.config, "params": list(kernel.params),
                      "view": [att.seq_q, att.seq_k, att.heads, att.batch, att.stride_mask_b, att.stride_mask_q,
                               att.stride_mask_k]}
            with open(self.plan["log"], "a") as fh:
                fh.write(json.dumps(record) + "\n")
            return
        view = load_core().abi_view(**node_call(item))
        assert view is not None
        record = {"pid": os.getpid(), "config": item.config, "div16": list(kernel.div16), "params": list(kernel.params),
                  "name": kernel.name, "tf32": kernel.tf32, "view": [view.M, view.N, view.K, view.batch, view.stride_a_batch,
                                                view.stride_b_batch]}
        with open(self.plan["log"], "a") as fh:
            fh.write(json.dumps(record) + "\n")

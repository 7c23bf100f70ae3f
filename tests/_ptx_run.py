"""Run the vendor epilogue's PTX (custom_ops/vendor.cc) on the host, one thread, for tests without a GPU.

A straight-line executor for exactly the instruction subset that kernel uses, with PTX's semantics: integer
ops on unsigned 64/32-bit values, float32 arithmetic rounded per instruction (fma rounds once), b16 loads and
stores, f16/bf16 conversions rounding to nearest even. An instruction outside the subset raises, so the
kernel cannot grow past what this checks unnoticed. ``run`` executes every thread of the launch's grid of blocks
(2-D each), one after the other to its ``ret``: the kernel must then have visited every element exactly as the
hardware's threads would, which the callers check over the whole output.
"""
from __future__ import annotations

import re
import struct
from typing import Any

import numpy as np

M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def _f32(v: float) -> float:
    with np.errstate(over="ignore"):  # past float32's range: inf, as the hardware rounds it
        return float(np.float32(v))


def _bits_to_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def _bf16_bits(v: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    if v != v:
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


class Memory:
    """Global memory: numpy buffers at made-up base addresses."""

    def __init__(self) -> None:
        self.buffers: list[tuple[int, np.ndarray]] = []
        self.next = 0x10000

    def place(self, array: np.ndarray) -> int:
        base = self.next
        self.buffers.append((base, array.view(np.uint8).reshape(-1)))
        self.next += (array.nbytes + 0xFFFF) & ~0xFFFF
        return base

    def _find(self, addr: int, size: int) -> tuple[np.ndarray, int]:
        for base, buf in self.buffers:
            if base <= addr and addr + size <= base + len(buf):
                return buf, addr - base
        raise IndexError(f"global access of {size} bytes at {addr:#x} outside every buffer")

    def load(self, addr: int, size: int) -> int:
        buf, off = self._find(addr, size)
        return int.from_bytes(bytes(buf[off:off + size]), "little")

    def store(self, addr: int, size: int, value: int) -> None:
        buf, off = self._find(addr, size)
        buf[off:off + size] = np.frombuffer(value.to_bytes(size, "little"), np.uint8)


def _parse(ptx: str) -> tuple[list[tuple[str | None, bool, str, list[str]]], dict[str, int]]:
    body = ptx[ptx.index("{") + 1:ptx.rindex("}")]
    code: list[tuple[str | None, bool, str, list[str]]] = []
    labels: dict[str, int] = {}
    for raw in body.splitlines():
        line = raw.strip().rstrip(";").strip()
        if not line or line.startswith(".reg"):
            continue
        if line.endswith(":"):
            labels[line[:-1]] = len(code)
            continue
        pred, negate = None, False
        if line.startswith("@"):
            guard, line = line.split(None, 1)
            negate = guard.startswith("@!")
            pred = guard[2:] if negate else guard[1:]
        op, _, rest = line.partition(" ")
        code.append((pred, negate, op, [a.strip() for a in rest.split(",")] if rest else []))
    return code, labels


def run(ptx: str, params: dict[str, Any], memory: Memory, grid: tuple[int, int] = (1, 1),
        block: tuple[int, int] = (1, 1), max_steps: int = 2_000_000) -> None:
    """Every thread of a ``grid`` (x, y) of ``block`` (x, y) threads, in turn; ``max_steps`` bounds each thread."""
    code, labels = _parse(ptx)
    for cy in range(grid[1]):
        for cx in range(grid[0]):
            for ty in range(block[1]):
                for tx in range(block[0]):
                    special = {"%ctaid.x": cx, "%ctaid.y": cy, "%ntid.x": block[0], "%ntid.y": block[1],
                               "%tid.x": tx, "%tid.y": ty, "%nctaid.x": grid[0], "%nctaid.y": grid[1]}
                    _thread(code, labels, params, memory, special, max_steps)


def _thread(code: list[tuple[str | None, bool, str, list[str]]], labels: dict[str, int], params: dict[str, Any],
            memory: Memory, special: dict[str, int], max_steps: int) -> None:
    reg: dict[str, Any] = {}

    def val(x: str) -> Any:
        if x.startswith("0f"):
            return _bits_to_f32(int(x[2:], 16))
        if x in special:
            return special[x]
        if x.startswith("%"):
            return reg[x]
        return int(x, 0)

    def addr(x: str) -> Any:
        inner = re.fullmatch(r"\[(.+)\]", x)
        assert inner, x
        name = inner.group(1)
        return params[name] if name in params else reg[name]

    pc, steps = 0, 0
    while True:
        steps += 1
        if steps > max_steps:
            raise RuntimeError("the kernel did not finish")
        pred, negate, op, a = code[pc]
        pc += 1
        if pred is not None and bool(reg[pred]) == negate:
            continue
        if op == "ret":
            return
        if op == "bra":
            pc = labels[a[0]]
        elif op.startswith("ld.param."):
            reg[a[0]] = addr(a[1])
        elif op.startswith("setp."):  # ordered compares: false where a float operand is NaN (bar ne, ints only)
            parts, x, y = op.split("."), val(a[1]), val(a[2])
            got = {"ne": x != y, "eq": x == y, "ge": x >= y, "lt": x < y, "le": x <= y, "gt": x > y}[parts[1]]
            if len(parts) == 4:  # setp.CmpOp.BoolOp.type p, a, b, c
                got = {"and": got and bool(val(a[3])), "or": got or bool(val(a[3]))}[parts[2]]
            reg[a[0]] = got
        elif op == "or.pred":
            reg[a[0]] = bool(val(a[1])) or bool(val(a[2]))
        elif op == "mov.f32":
            reg[a[0]] = val(a[1])
        elif op == "cvta.to.global.u64" or op == "cvt.u64.u32" or op == "mov.u32":
            reg[a[0]] = val(a[1])
        elif op == "mov.b32":
            reg[a[0]] = _bits_to_f32(val(a[1]))
        elif op == "cvt.u32.u16":
            reg[a[0]] = val(a[1]) & 0xFFFF
        elif op in ("mul.wide.u32", "mul.lo.u64"):
            reg[a[0]] = (val(a[1]) * val(a[2])) & M64
        elif op == "add.u64":
            reg[a[0]] = (val(a[1]) + val(a[2])) & M64
        elif op == "mad.lo.u64":
            reg[a[0]] = (val(a[1]) * val(a[2]) + val(a[3])) & M64
        elif op == "sub.u64":
            reg[a[0]] = (val(a[1]) - val(a[2])) & M64
        elif op == "div.u64":
            reg[a[0]] = val(a[1]) // val(a[2])
        elif op == "rem.u64":
            reg[a[0]] = val(a[1]) % val(a[2])
        elif op == "shl.b64":
            reg[a[0]] = (val(a[1]) << val(a[2])) & M64
        elif op == "shl.b32":
            reg[a[0]] = (val(a[1]) << val(a[2])) & M32
        elif op == "ld.global.f32":
            reg[a[0]] = _bits_to_f32(memory.load(addr(a[1]), 4))
        elif op == "ld.global.b16":
            reg[a[0]] = memory.load(addr(a[1]), 2)
        elif op == "st.global.f32":
            memory.store(addr(a[0]), 4, struct.unpack("<I", struct.pack("<f", val(a[1])))[0])
        elif op == "st.global.b16":
            memory.store(addr(a[0]), 2, val(a[1]))
        elif op == "cvt.f32.f16":
            reg[a[0]] = float(np.array([val(a[1])], np.uint16).view(np.float16)[0])
        elif op == "cvt.rn.f16.f32":
            reg[a[0]] = int(np.array([val(a[1])], np.float32).astype(np.float16).view(np.uint16)[0])
        elif op == "cvt.rn.bf16.f32":
            reg[a[0]] = _bf16_bits(val(a[1]))
        elif op == "fma.rn.f32":
            reg[a[0]] = _f32(np.float64(val(a[1])) * np.float64(val(a[2])) + np.float64(val(a[3])))
        elif op in ("mul.f32", "add.f32", "sub.f32", "max.f32", "min.f32"):
            x, y = np.float32(val(a[1])), np.float32(val(a[2]))
            # max.f32 / min.f32 give the operand that is not NaN (NaN only when both are): numpy's fmax / fmin
            reg[a[0]] = float({"mul.f32": x * y, "add.f32": x + y, "sub.f32": x - y, "max.f32": np.fmax(x, y),
                               "min.f32": np.fmin(x, y)}[op])
        elif op == "abs.f32":
            reg[a[0]] = abs(val(a[1]))
        elif op == "rcp.rn.f32":
            reg[a[0]] = _f32(1.0 / np.float64(val(a[1])))
        elif op == "ex2.approx.f32":
            reg[a[0]] = _f32(2.0 ** np.float64(val(a[1])))
        elif op == "copysign.f32":  # d = |b| with the sign of a
            reg[a[0]] = float(np.copysign(np.float32(val(a[2])), np.float32(val(a[1]))))
        else:
            raise NotImplementedError(f"PTX instruction {op!r} is outside what tests/_ptx_run.py executes")

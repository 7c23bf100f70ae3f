"""Attention template-vs-reference cases run under TRITON_INTERPRET=1 in a child process
(tests/test_attention.py). ``CASES`` is plain data; ``main()`` runs them and prints one JSON object
{case: max abs error / tolerance}. Run by hand: ``TRITON_INTERPRET=1 python tests/_attention_cases.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["Case", "CASES", "main"]


@dataclass(frozen=True)
class Case:
    name: str
    lead: tuple[int, ...]  # [batch, heads] or [z]
    seq_q: int
    seq_k: int
    head_dim: int
    configs: tuple[tuple[int, int, int, int], ...]  # block_m, block_n, num_warps, num_stages
    dtype: str = "float32"
    mask: tuple[int, ...] | None = None  # the additive mask's shape (broadcast to [batch, heads, T_q, T_k])
    scale: float = 1.0
    causal: bool = False
    masked_cols: int = 0  # the last keys of batch item 0 get -10000 (BERT's extended mask)
    dead_rows: int = 0  # the first query rows of batch item 0 get -inf for every key
    nan_to_zero: bool = False
    layout: int = 0  # tuner.attention.LAYOUT_BITS: operands given as [batch, seq, heads, d] (K: the keys)


CASES: tuple[Case, ...] = (
    Case("t1_d16", (1, 2), 1, 1, 16, ((16, 16, 2, 1),)),
    Case("t5_d32_scale", (2, 2), 5, 5, 32, ((16, 16, 2, 1), (32, 64, 4, 2)), scale=0.125),
    Case("t17_d16_multiblock", (1, 3), 17, 17, 16, ((16, 16, 2, 1),), scale=0.25),
    Case("t17_d32_bert_mask", (2, 2), 17, 17, 32, ((16, 16, 2, 1), (32, 32, 4, 2)), mask=(2, 1, 1, 17),
         scale=1 / 32 ** 0.5, masked_cols=6),
    Case("t5_d16_full_mask_fp16", (2, 2), 5, 5, 16, ((16, 16, 2, 1),), dtype="float16", mask=(2, 2, 5, 5),
         scale=0.25),
    Case("t17_d32_bert_mask_fp16", (2, 2), 17, 17, 32, ((16, 16, 2, 1),), dtype="float16", mask=(2, 1, 1, 17),
         scale=1 / 32 ** 0.5, masked_cols=9),
    Case("t5_rows_mask_3d", (3,), 5, 17, 32, ((16, 32, 2, 1),), mask=(5, 17)),
    Case("t1_decode_keys17", (1, 2), 1, 17, 16, ((16, 16, 2, 1),), mask=(1, 1, 1, 17), scale=0.5),
    Case("t17_causal", (1, 2), 17, 17, 16, ((16, 16, 2, 1), (32, 16, 2, 1)), causal=True),
    Case("t5_d24_padded_head", (1, 2), 5, 5, 24, ((16, 16, 2, 1),), scale=0.3),
    # keys in whole blocks (the kernel's unmasked loop) before or without a tail: a padded head, BERT's mask
    # with masked keys inside a whole block, and a per-row mask whose query tile runs past seq_q
    Case("t32_whole_blocks_padded_head_bert_mask", (2, 2), 32, 32, 24, ((16, 16, 2, 1), (16, 32, 2, 1)),
         mask=(2, 1, 1, 32), scale=0.2, masked_cols=6),
    Case("t17_keys48_whole_blocks_dead_rows", (2, 2), 17, 48, 16, ((16, 16, 2, 1), (32, 32, 4, 2)),
         mask=(2, 1, 17, 48), dead_rows=3, nan_to_zero=True),
    Case("t17_dead_rows_nan_to_zero", (2, 2), 17, 17, 16, ((16, 16, 2, 1),), mask=(2, 1, 17, 17), dead_rows=3,
         nan_to_zero=True),
    # the head-split layouts (the Transposes around the node absorbed): every operand, each alone, mixed, with
    # ragged sequences (17 keys over 16-key blocks), a decode step, masks, causal and float16
    Case("bshd_all_bert_mask", (2, 3), 17, 17, 32, ((16, 16, 2, 1), (32, 32, 4, 2)), mask=(2, 1, 1, 17),
         scale=1 / 32 ** 0.5, masked_cols=6, layout=15),
    Case("bshd_q_only", (2, 3), 5, 17, 16, ((16, 16, 2, 1),), scale=0.5, layout=1),
    Case("bshd_k_only_rows_mask", (2, 3), 17, 5, 16, ((16, 16, 2, 1),), mask=(2, 3, 17, 5), layout=2),
    Case("bshd_v_out", (1, 2), 17, 17, 24, ((16, 16, 2, 1),), scale=0.3, layout=12),
    Case("bshd_all_decode", (2, 2), 1, 17, 16, ((16, 16, 2, 1),), mask=(2, 1, 1, 17), layout=15),
    Case("bshd_all_causal", (1, 3), 17, 17, 16, ((16, 16, 2, 1),), causal=True, layout=15),
    Case("bshd_all_fp16_rows_mask", (2, 2), 17, 17, 32, ((16, 16, 2, 1),), dtype="float16", mask=(2, 2, 17, 17),
         scale=0.25, layout=15),
    # the packed projection (layout 16 | q | k | v): Q, K, V read in place from one [batch, seq, 3 * heads * d]
    # tensor, alone and with the output head-split, BERT's mask, ragged keys, causal, float16 and a padded head
    Case("packed_bert_mask_out", (2, 3), 17, 17, 32, ((16, 16, 2, 1), (32, 32, 4, 2)), mask=(2, 1, 1, 17),
         scale=1 / 32 ** 0.5, masked_cols=6, layout=31),
    Case("packed_only", (1, 2), 5, 5, 16, ((16, 16, 2, 1),), scale=0.5, layout=23),
    Case("packed_causal_d24", (1, 2), 17, 17, 24, ((16, 16, 2, 1),), causal=True, scale=0.3, layout=31),
    Case("packed_fp16_rows_mask", (2, 2), 17, 17, 16, ((16, 16, 2, 1),), dtype="float16", mask=(2, 2, 17, 17),
         scale=0.25, layout=31),
)

# bfloat16 is left to the GPU tests: the interpreter computes through numpy, which has no bfloat16.
_TOL = {"float32": 1e-5, "float16": 2e-3}


def main() -> None:
    import torch

    from tuner.attention import AttentionConfig, reference_attention, run_attention

    torch.manual_seed(0)
    results: dict[str, list[float]] = {}
    for case in CASES:
        dtype = getattr(torch, case.dtype)
        q = torch.randn(*case.lead, case.seq_q, case.head_dim).to(dtype)
        kt = torch.randn(*case.lead, case.head_dim, case.seq_k).to(dtype)
        v = torch.randn(*case.lead, case.seq_k, case.head_dim).to(dtype)
        mask = None
        if case.mask is not None:
            mask = torch.randn(*case.mask)
            if case.masked_cols:
                mask[0, ..., -case.masked_cols:] = -10000.0
            if case.dead_rows:
                mask[0, ..., :case.dead_rows, :] = float("-inf")
            mask = mask.to(dtype)
        want = reference_attention(q, kt, v, mask=mask, scale=case.scale, causal=case.causal,
                                   nan_to_zero=case.nan_to_zero).double()
        errors = []
        # the operands as the layout gives them: [batch, seq, heads, d] (K: the keys, Kt's dims (0, 3, 1, 2))
        given = (q.transpose(1, 2).contiguous() if case.layout & 1 else q,
                 kt.permute(0, 3, 1, 2).contiguous() if case.layout & 2 else kt,
                 v.transpose(1, 2).contiguous() if case.layout & 4 else v)
        if case.layout & 16:  # one [batch, seq, 3 * heads * d] tensor: q, k, v concatenated on the last axis
            packed = torch.cat([t.flatten(2) for t in given], dim=-1).contiguous()
            given = (packed, packed, packed)
        for fields in case.configs:
            got = run_attention(AttentionConfig(*fields), *given, mask=mask, scale=case.scale,
                                causal=case.causal, nan_to_zero=case.nan_to_zero, layout=case.layout,
                                head_dim=case.head_dim)
            if case.layout & 8:  # the output as [batch, seq_q, heads, d]
                assert got.shape == (want.shape[0], want.shape[2], want.shape[1], want.shape[3]), got.shape
                got = got.transpose(1, 2)
            assert got.shape == want.shape and got.dtype == q.dtype, (got.shape, got.dtype)
            if case.nan_to_zero:
                assert torch.equal(got[0, :, :case.dead_rows], torch.zeros_like(got[0, :, :case.dead_rows]))
            errors.append(float((got.double() - want).abs().max()) / _TOL[case.dtype])
        results[case.name] = errors
    print(json.dumps(results))


if __name__ == "__main__":
    main()

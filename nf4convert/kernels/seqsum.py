"""The GGUF quantizers' ``seqsum`` (sinks/gguf/quants/arith.py) on a CUDA GPU in one kernel: ``float s = 0;
for (i...) s += a[i] * b[i];`` for every column, in that order, each product rounded before it is added (Triton with
``enable_fp_fusion=False``, so no multiply-add is contracted), subnormals kept. The loop it replaces launches one
operation per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512


@triton.jit
def _seqsum(terms, times, out, n_terms, n_columns, HAS_TIMES: tl.constexpr, BLOCK: tl.constexpr):
    columns = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < n_columns
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(n_terms):
        term = tl.load(terms + i * n_columns + columns, mask=inside, other=0.0)
        if HAS_TIMES:
            term = term * tl.load(times + i * n_columns + columns, mask=inside, other=0.0)
        total = total + term
    tl.store(out + columns, total, mask=inside)


def seqsum_cuda(terms: torch.Tensor, times: torch.Tensor | None) -> torch.Tensor:
    """Columns of float32 ``terms`` (n, ...) (times ``times`` of the same shape), summed in order: (...)."""
    if times is not None and times.shape != terms.shape:
        terms, times = torch.broadcast_tensors(terms, times)
    has_times = times is not None
    terms = terms.contiguous()
    times = times.contiguous() if has_times else terms
    out = torch.empty(terms.shape[1:], dtype=torch.float32, device=terms.device)
    n_columns = out.numel()
    if n_columns:
        grid = (triton.cdiv(n_columns, BLOCK),)
        _seqsum[grid](
            terms,
            times,
            out,
            terms.shape[0],
            n_columns,
            HAS_TIMES=has_times,
            BLOCK=BLOCK,
            enable_fp_fusion=False,
        )
    return out

"""Launch knobs of the dequantize kernel per GPU, and how one weight's launch is shaped.

Speed only: every config is bit-exact (the tests run each variant). ``GPU_CONFIGS`` holds tables measured on a
named GPU (matched in ``torch.cuda.get_device_name``: an H100 and an H200 share compute capability 9.0 and 132
SMs, yet differ in memory, and so in the best config); ``CONFIGS`` is by compute capability (prefix match; ``()``
is the default, measured on an H100 and an H200) for every other GPU. Rows ``(largest packed size in bytes, Config)``,
or ``(largest packed size, Config, output element size)`` for a row that applies to one output width only; the first
row that fits is taken.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton.language as tl


@dataclass(frozen=True)
class Config:
    tile_bytes: int  # packed bytes per tile (whole quant blocks)
    num_warps: int
    evict: bool  # evict_first hints on the streamed bytes and output
    lut_select: bool = False  # nibble decode by selects instead of an L1 gather
    programs_per_sm: int = 0  # > 0: persistent grid of this many programs per SM
    stages: int = 1  # pipelining depth of the persistent loop
    streaming_stores: bool = False  # st.global.cs for the output
    ptx: bool = True  # inline PTX for the exact multiplies; False: plain ops and a compare-flush (exact
    # only with fp fusion off, so never under torch.compile: the benchmark's "no PTX" column)


CONFIGS = {
    # Measured on an H100 and an H200 with CUDA-graph timing (docs/performance.md). Above 2 MiB packed, evict_first
    # hints with 4 warps per 2 KiB tile are the fastest config on the H100 or within a fraction of a percent of it,
    # and close to each H200 run's best; 8 warps tie on the H100 and lose on the H200 for 16-bit outputs.
    # fp32 outputs past 64 MiB packed (8x the bytes out): 4 KiB tiles over 8 warps, with the hints, a little faster on
    # both GPUs at the largest shapes and slower at small ones.
    (): (
        (1 << 16, Config(512, 2, False)),
        (1 << 21, Config(1024, 4, True)),
        (1 << 26, Config(2048, 4, True)),
        (None, Config(4096, 8, True), 4),
        (None, Config(2048, 4, True)),
    ),
    # T4: only L1 eviction hints exist there; keep the plain loads.
    (7, 5): ((None, Config(1024, 4, False)),),
}
# Tables for a GPU model whose best configs differ from its compute capability's (matched in the device name;
# an H100 and an H200 share compute capability 9.0 and 132 SMs yet differ in memory).
GPU_CONFIGS: dict = {
    # H200: the default table, and for 16-bit outputs past 64 MiB packed 4 KiB tiles over 4 warps with the hints,
    # faster than the default row in every graph-timed comparison at the largest shape. Not measured on the H100.
    "H200": (*CONFIGS[()][:4], (None, Config(4096, 4, True), 2), CONFIGS[()][4]),
}
_override: Optional[Config] = None


@contextlib.contextmanager
def override(config: Config):
    """Launch every weight with ``config`` inside the block (the benchmark and tests measure variants so)."""
    global _override
    previous, _override = _override, config
    try:
        yield config
    finally:
        _override = previous


def current_override() -> Optional[Config]:
    return _override


def table_for(capability: tuple, gpu_name: str = "") -> tuple:
    """The config table of a GPU: its model's own, else its compute capability's, else the default."""
    for model, table in GPU_CONFIGS.items():
        if model in gpu_name:
            return table
    return CONFIGS.get(tuple(capability)) or CONFIGS.get(tuple(capability[:1])) or CONFIGS[()]


def choose_config(n_bytes: int, capability: tuple, gpu_name: str = "", out_size: int = 2) -> Config:
    """The launch config for a weight of ``n_bytes`` packed bytes decoded to ``out_size``-byte elements on a GPU of
    ``capability`` (named ``gpu_name``)."""
    if _override is not None:
        return _override
    table = table_for(capability, gpu_name)
    for limit, config, *only in table:
        if (limit is None or n_bytes <= limit) and (not only or only[0] == out_size):
            return config
    return table[-1][1]


def launch_config(n_elements, blocksize, nested_blocksize, nested, out_dtype, capability, sm_count, gpu_name=""):
    """(grid, constexprs, num_warps) for one weight; ``capability`` None means the interpreter."""
    half_block = blocksize // 2
    n_bytes = (n_elements + 1) // 2
    if capability is None and _override is None:
        config = Config(max(half_block, 4096), 4, False)  # the interpreter: few, large programs
    else:
        config = choose_config(n_bytes, capability, gpu_name, out_dtype.itemsize)
    blocks = max(1, config.tile_bytes // half_block)
    n_tiles = -(-n_bytes // (half_block * blocks))
    persistent = config.programs_per_sm > 0 and n_tiles > sm_count * config.programs_per_sm
    constexprs = dict(
        HALF_BLOCK=half_block,
        BLOCKS_PER_PROGRAM=blocks,
        NESTED=nested,
        NESTED_SHIFT=nested_blocksize.bit_length() - 1 if nested else 0,
        PTX=capability is not None and config.ptx,
        BF16_BITS=out_dtype == torch.bfloat16 and (capability is None or tuple(capability) < (8, 0)),
        EVICT="evict_first" if config.evict else "",
        MASKED=n_elements % (2 * half_block * blocks) != 0,
        PAIR_STORE=n_elements % 2 == 0,
        PAIR_TYPE=tl.uint64 if out_dtype == torch.float32 else tl.uint32,
        LUT_SELECT=config.lut_select,
        PERSISTENT=persistent,
        STAGES=config.stages,
        STORE_CACHE=".cs" if config.streaming_stores else "",
    )
    grid = (sm_count * config.programs_per_sm,) if persistent else (n_tiles,)
    return grid, constexprs, config.num_warps

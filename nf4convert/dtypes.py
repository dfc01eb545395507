"""The one table of dtypes: safetensors' names, torch's and numpy's, sizes, and which ones an output may take.

Everything else (the CLI's --dtype choices, plan's casts, the shard writer, verify) reads this table.
Neither torch nor numpy is imported here, so the CLI can parse options without them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ArgumentError


@dataclass(frozen=True)
class DType:
    code: str  # safetensors' name, e.g. "BF16"
    name: str  # torch's name, e.g. "bfloat16"
    itemsize: int
    short: str | None = None  # the CLI's short name, for the dtypes an output can take
    cast: bool = False  # a plain tensor of this dtype takes the output dtype (so the output is of one dtype)

    @property
    def torch(self):
        import torch

        return getattr(torch, self.name)

    @property
    def numpy(self):
        """The numpy dtype that holds this dtype's bits (its own where numpy has it; bf16 as uint16, fp8 as uint8)."""
        import numpy as np

        return np.dtype(_NUMPY.get(self.name, self.name))


_NUMPY = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "float8_e8m0fnu": "uint8"}


DTYPES = {
    dtype.code: dtype
    for dtype in (
        DType("F64", "float64", 8, cast=True), DType("F32", "float32", 4, "fp32", cast=True),
        DType("F16", "float16", 2, "fp16", cast=True), DType("BF16", "bfloat16", 2, "bf16", cast=True),
        DType("F8_E4M3", "float8_e4m3fn", 1), DType("F8_E5M2", "float8_e5m2", 1),
        DType("F8_E8M0", "float8_e8m0fnu", 1),
        DType("I64", "int64", 8), DType("I32", "int32", 4), DType("I16", "int16", 2), DType("I8", "int8", 1),
        DType("U64", "uint64", 8), DType("U32", "uint32", 4), DType("U16", "uint16", 2), DType("U8", "uint8", 1),
        DType("BOOL", "bool", 1),
    )
}  # fmt: skip
BY_NAME = {dtype.name: dtype for dtype in DTYPES.values()}
OUTPUT_DTYPES = {name: BY_NAME[name] for name in ("bfloat16", "float16", "float32")}  # those with a short name
# What --dtype / dtype= accept: "auto", the short names and torch's names.
OUTPUT_CHOICES = ("auto", *(d.short for d in OUTPUT_DTYPES.values()), *OUTPUT_DTYPES)


def to_float32(raw, code: str):
    """The fp32 values (a numpy array) of ``raw``, the uint8 numpy bytes of float dtype ``code``: exact from F16 and
    BF16, rounded to nearest even from F64 (as torch's casts from float64 to fp16/bf16 go through fp32)."""
    import numpy as np

    if code == "BF16":
        return np.left_shift(raw.view(np.uint16).astype(np.uint32), 16).view(np.float32)
    with np.errstate(all="ignore"):
        return raw.view(DTYPES[code].numpy).astype(np.float32)


def output_dtype(choice: str) -> DType | None:
    """The output DType a ``dtype`` option names (``None`` for "auto"); ArgumentError for anything else."""
    if choice == "auto":
        return None
    for dtype in OUTPUT_DTYPES.values():
        if choice in (dtype.short, dtype.name):
            return dtype
    raise ArgumentError(f"dtype {choice!r} is not one of {', '.join(OUTPUT_CHOICES)}", option="dtype")

"""The streaming loop: plan, then write every tensor's bytes straight into its place in its shard.

Peak memory is a few chunks (CHUNK_ELEMENTS outputs of the weight in hand), whatever the model
or shard size. Output goes to a temporary folder beside OUT that is renamed into place only when
everything is written; on any failure (a full disk, Ctrl-C) it is removed and OUT is untouched.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import DTYPES, ShardWriter, TensorReader
from .errors import OutputError
from .hub import model_name, resolve
from .plan import Plan, QuantGroup, dense_config, index_json, make_plan, parse_size

CHUNK_ELEMENTS = 1 << 24  # outputs per step of a quantized weight: 32 MiB of bf16
CHUNK_BYTES = 1 << 25  # source bytes per step of a plain tensor
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class ConvertResult:
    output: Path
    dtype: str
    tensors: int
    quantized: int
    bytes: int
    seconds: float


def default_output(source: str, dtype: str) -> Path:
    name = model_name(source)
    for suffix in ("-bnb-4bit", "-bnb-nf4", "-bnb-fp4", "-4bit", "-nf4", "-fp4"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return Path(f"{name}-{SHORT_DTYPES.get(dtype, dtype)}")


def pick_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is available")
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N")
    return chosen


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise OutputError(f"{output}: exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise OutputError(f"{output}: exists and is not empty (pass --overwrite to replace it)")


def check_free_space(plan: Plan, output: Path) -> None:
    needed = plan.tensor_bytes + plan.other_bytes
    parent = output.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < needed + (64 << 20):
        raise OutputError(f"{parent}: {free / 1e9:.2f} GB free, the output needs {needed / 1e9:.2f} GB")


def _quant_state(group: QuantGroup, reader: TensorReader, device):
    import torch

    from .quant_state import build_quant_state

    parts = {suffix: reader.tensor(info) for suffix, info in group.parts.items() if suffix != "quant_state"}
    if not group.nested:
        parts["absmax"] = parts["absmax"].to(torch.float32)
    return build_quant_state(group.meta, parts, name=group.name, device=device)


def _write_quantized(group: QuantGroup, emit, reader: TensorReader, device, out_dtype):
    """Dequantize one weight in chunks of whole (nested) blocks and append them to the shard."""
    import torch

    from .dequantize import dequantize_4bit
    from .quant_state import NestedState, QuantState4bit

    state = _quant_state(group, reader, device)
    n = math.prod(group.shape)
    unit = state.blocksize * (state.state2.blocksize if state.nested else 1)
    chunk = max(unit, CHUNK_ELEMENTS // unit * unit)
    packed_buffer = torch.empty((min(chunk, n) + 1) // 2, dtype=torch.uint8)
    for first in range(0, n, chunk):
        count = min(chunk, n - first)
        first_block, end_block = first // state.blocksize, -(-(first + count) // state.blocksize)
        packed = reader.read(group.packed, first // 2, (count + 1) // 2, out=packed_buffer).to(device)
        state2 = None
        if state.nested:
            nested = state.state2
            n2 = nested.blocksize
            state2 = NestedState(nested.absmax[first_block // n2 : -(-end_block // n2)], nested.code, n2)
        piece = QuantState4bit(absmax=state.absmax[first_block:end_block], shape=torch.Size([count]), dtype=out_dtype,
                               blocksize=state.blocksize, quant_type=state.quant_type, offset=state.offset, state2=state2)  # fmt: skip
        emit(group.name, dequantize_4bit(packed, piece).cpu())


def _write_plain(info, emit, reader: TensorReader, out_dtype_code: str):
    import torch

    source_type = getattr(torch, DTYPES[info.dtype][0])
    target_type = getattr(torch, DTYPES[out_dtype_code][0])
    size = DTYPES[info.dtype][1]
    step = max(size, CHUNK_BYTES // size * size)
    for first in range(0, info.nbytes, step):
        data = reader.read(info, first, min(step, info.nbytes - first)).view(source_type)
        emit(info.name, data.to(target_type) if source_type != target_type else data)
    if info.nbytes == 0:
        emit(info.name, torch.empty(0, dtype=torch.uint8))


class _Pipeline:
    """Writes chunks on a background thread while the next ones are computed (file writes and torch
    release the GIL); at most ``depth`` chunks wait, so memory stays bounded."""

    def __init__(self, progress, depth: int = 2):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nf4convert-writer")
        self._pending = deque()
        self._progress = progress
        self._depth = depth
        self.writer: ShardWriter | None = None

    def emit(self, name, data) -> None:
        self._pending.append(self._pool.submit(self.writer.write, name, data))
        self._progress(data.numel() * data.element_size())
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)


def convert(
    source: str,
    output: str | os.PathLike | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
    output_dir: str | os.PathLike | None = None,
) -> ConvertResult:
    """Convert a bitsandbytes 4-bit checkpoint into a dense safetensors checkpoint.

    ``output`` defaults to ``<output_dir or .>/<name>-<dtype>``.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    import torch
    from tqdm.auto import tqdm

    started = time.perf_counter()
    shard_limit = parse_size(max_shard_size)
    chosen_device = pick_device(device)
    if output is not None:
        check_output(Path(output), overwrite)
    folder = resolve(source, revision=revision, token=token, cache_dir=cache_dir)
    reader = TensorReader()
    try:
        plan = make_plan(folder, dtype=dtype, max_shard_size=shard_limit, reader=reader)
        output = Path(output) if output is not None else Path(output_dir or ".") / default_output(source, plan.dtype)
        if output.resolve() == folder.resolve() or output.resolve() in folder.resolve().parents:
            raise OutputError(f"{output}: is the source checkpoint's folder (or holds it); choose another output")
        check_output(output, overwrite)
        check_free_space(plan, output)
        temporary = output.parent / f".{output.name}.nf4convert-partial"
        shutil.rmtree(temporary, ignore_errors=True)  # left by a run that was killed outright
        temporary.mkdir(parents=True)
        out_dtype = getattr(torch, plan.dtype)
        try:
            with tqdm(total=plan.tensor_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                      desc=f"{model_name(source)} -> {plan.dtype}", dynamic_ncols=True) as bar:  # fmt: skip
                done = 0
                pipeline = _Pipeline(bar.update)
                try:
                    for shard in plan.shards:
                        pipeline.writer = ShardWriter(temporary / shard.filename, [t.output for t in shard.tensors])
                        for tensor in shard.tensors:
                            if tensor.quantized:
                                _write_quantized(tensor.source, pipeline.emit, reader, chosen_device, out_dtype)
                            else:
                                _write_plain(tensor.source, pipeline.emit, reader, tensor.output.dtype)
                            done += 1
                            bar.set_postfix_str(f"{done}/{plan.n_tensors} tensors", refresh=False)
                        pipeline.drain()
                        pipeline.writer.close()
                finally:
                    pipeline.close()
            _write_side_files(plan, temporary)
            _move_into_place(temporary, output)
        except OSError as error:
            shutil.rmtree(temporary, ignore_errors=True)
            raise OutputError(f"{output}: writing failed ({error.strerror or error}); nothing was written") from None
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
    finally:
        reader.close()
    return ConvertResult(output, plan.dtype, plan.n_tensors, len(plan.groups), plan.tensor_bytes, time.perf_counter() - started)


def _write_side_files(plan: Plan, folder: Path) -> None:
    for relative in plan.other_files:
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.folder / relative, target)
    if plan.config is not None:
        (folder / "config.json").write_text(json.dumps(dense_config(plan.config, plan.dtype), indent=2) + "\n")
    if len(plan.shards) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_json(plan), indent=2) + "\n")


def _move_into_place(temporary: Path, output: Path) -> None:
    """Rename the finished folder to OUT; an old OUT (--overwrite) is removed only after that."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.nf4convert-old"
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    try:
        temporary.rename(output)
    except OSError:
        if old is not None:
            old.rename(output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

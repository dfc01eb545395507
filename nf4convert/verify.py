"""Check a converted checkpoint against its source with bitsandbytes' own dequantize_4bit.

Every quantized weight is recomputed by ``bitsandbytes.functional.dequantize_4bit`` (not by our
kernel) and compared bit for bit; every other source tensor must be there, cast to the output
dtype; no quantization key or config may remain.

On the CPU, bitsandbytes' native kernel is asked for a flat ``[1, n]`` shape: on AVX512 machines it
indexes absmax per row, which is wrong when a row is not a whole number of blocks, and a flat shape
is one row. Its CPU paths also decode FP4 nibble 8 as +0.0 where its CUDA kernel (the truth, which
the output follows) gives -0.0, so on the CPU a zero at such a position matches either sign; that
allowance is counted in the report. On a GPU the comparison is plain bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import DTYPES, TensorReader, read_tensors
from .hub import resolve
from .plan import QUANT_PARTS, QuantGroup, make_plan
from .quant_state import QUANT_STATE_PREFIX


@dataclass
class VerifyReport:
    output: Path
    checked: int = 0
    quantized: int = 0
    signed_zero_allowances: int = 0
    device: str = "cpu"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _bits(tensor):
    import torch

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(-1).view(integer)


def _bnb_state(group: QuantGroup, reader: TensorReader, device):
    import bitsandbytes.functional as F

    tensors = {f"{group.name}.{suffix}": reader.tensor(info) for suffix, info in group.parts.items() if suffix != "quant_state"}
    tensors[group.parts["quant_state"].name] = reader.tensor(group.parts["quant_state"])
    return F.QuantState.from_dict(tensors, device=device)


def _reference(group: QuantGroup, reader: TensorReader, device, out_dtype):
    """bitsandbytes' result for a weight at ``out_dtype``, and the FP4 nibble-8 mask (CPU allowance)."""
    import bitsandbytes.functional as F
    import torch

    state = _bnb_state(group, reader, device)
    state.dtype = out_dtype  # bitsandbytes rounds its fp32 products straight to the dtype asked for
    packed = reader.tensor(group.packed).to(device)
    shape = state.shape
    if device.type == "cpu":
        state.shape = torch.Size([1, shape.numel()])
    expected = F.dequantize_4bit(packed.view(torch.uint8).reshape(-1, 1), state).reshape(shape)
    zero_mask = None
    if device.type == "cpu" and state.quant_type == "fp4":
        flat = packed.view(torch.uint8).reshape(-1).to(torch.int32)
        zero_mask = (torch.stack((flat >> 4, flat & 15), 1).reshape(-1)[: shape.numel()] == 8).reshape(shape)
    return expected, zero_mask


def verify(output: str | Path, source: str, *, device: str = "auto", revision=None, token=None, cache_dir=None,
           progress: bool = False) -> VerifyReport:  # fmt: skip
    """Compare the converted checkpoint in ``output`` with ``source``; a report, never an exception for mismatches.

    Example:
        >>> report = verify("llama-1b-bf16", "unsloth/Llama-3.2-1B-Instruct-bnb-4bit")
        >>> report.ok
    """
    import logging

    import torch

    from .convert import pick_device

    # bitsandbytes warns on import about an optional CPU matmul kernel that verification never uses.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    output = Path(output)
    chosen = pick_device(device)
    report = VerifyReport(output, device=str(chosen))
    folder = resolve(source, revision=revision, token=token, cache_dir=cache_dir)
    source_reader, output_reader = TensorReader(), TensorReader()
    try:
        plan = make_plan(folder, reader=source_reader)
        produced = read_tensors(output)
        for name in produced:
            if name.endswith(tuple("." + p for p in QUANT_PARTS)) or QUANT_STATE_PREFIX in name:
                report.problems.append(f"{name}: a quantization key remains in the output")
        config_path = output / "config.json"
        if config_path.exists() and "quantization_config" in config_path.read_text():
            report.problems.append("config.json: quantization_config remains")
        dtypes = {info.dtype for info in produced.values() if info.dtype in ("F16", "BF16", "F32")}
        out_code = dtypes.pop() if len(dtypes) == 1 else None
        if out_code is None:
            report.problems.append(f"output floating tensors are not of one dtype: {sorted(dtypes)}")
            return report
        out_type = getattr(torch, DTYPES[out_code][0])
        groups = {group.name: group for group in plan.groups}
        consumed = {key for group in plan.groups for key in group.source_keys}
        expected_names = set(groups) | (set(plan.source_tensors) - consumed)
        for name in sorted(expected_names - set(produced)):
            report.problems.append(f"{name}: in the source, missing from the output")
        for name in sorted(set(produced) - expected_names):
            report.problems.append(f"{name}: in the output, not in the source")
        from tqdm.auto import tqdm

        names = sorted(expected_names & set(produced))
        for name in tqdm(names, desc=f"verifying {output.name}", unit="tensor", disable=not progress, dynamic_ncols=True):
            got = output_reader.tensor(produced[name])
            report.checked += 1
            if name in groups:
                report.quantized += 1
                expected, zero_mask = _reference(groups[name], source_reader, chosen, out_type)
            else:
                expected, zero_mask = source_reader.tensor(plan.source_tensors[name]), None
                if expected.is_floating_point() and expected.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                    expected = expected.to(out_type)
            if tuple(got.shape) != tuple(expected.shape) or got.dtype != expected.dtype:
                report.problems.append(f"{name}: {got.dtype} {list(got.shape)} in the output, {expected.dtype} {list(expected.shape)} expected")
                continue
            differ = _bits(got) != _bits(expected.to("cpu"))
            if zero_mask is not None:
                allowed = differ & zero_mask.reshape(-1) & (got.reshape(-1) == 0) & (expected.to("cpu").reshape(-1) == 0)
                report.signed_zero_allowances += int(allowed.sum())
                differ &= ~allowed
            mismatches = int(differ.sum())
            if mismatches:
                report.problems.append(f"{name}: {mismatches} of {got.numel()} elements differ from bitsandbytes")
    finally:
        source_reader.close()
        output_reader.close()
    return report


def report_lines(report: VerifyReport) -> list[str]:
    lines = [f"{report.output}: {report.checked} tensors checked ({report.quantized} dequantized by bitsandbytes on {report.device})"]
    if report.signed_zero_allowances:
        lines.append(f"  {report.signed_zero_allowances} FP4 zeros are -0.0 as on CUDA where bitsandbytes' CPU path gives +0.0")
    lines += [f"  MISMATCH {problem}" for problem in report.problems[:20]]
    if len(report.problems) > 20:
        lines.append(f"  ... and {len(report.problems) - 20} more problems")
    lines.append("OK: bit-exact with bitsandbytes" if report.ok else f"FAILED: {len(report.problems)} problems")
    return lines

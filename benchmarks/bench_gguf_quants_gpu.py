"""The GGUF quantizers on a CUDA GPU (the same code as the CPU's, on torch tensors): GB/s of bf16 input at
Llama-3.1-8B's tensor shapes, and the whole model's quantization time under llama-quantize's Q4_K_M type plan
(nf4convert/sinks/gguf/typeplan.py), without and with an importance matrix.

    python benchmarks/bench_gguf_quants_gpu.py [--ftype Q4_K_M] [--chunks 22,23,24,25] [--json OUT.json]

Each distinct (shape, type) of the plan is quantized once from a bf16 tensor already on the GPU (as the GPU route
holds it after dequantizing), timed from the call to the bytes on the device (``torch.cuda.synchronize``); the
model's time is the sum over its tensors of their (shape, type)'s time. Values are normal * 0.02, bf16-rounded; the
importance matrix is squared normals. ``--chunks`` first times Q4_K on one ffn_gate at several chunk sizes
(log2 of values per chunk), with the in-order sums as one Triton kernel each and as one torch operation per element,
and keeps the fastest chunk size of the first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nf4convert.sinks.gguf.quants import quant_type  # noqa: E402
from nf4convert.sinks.gguf.quants.base import QuantType  # noqa: E402
from nf4convert.sinks.gguf.quants.xp import TORCH  # noqa: E402
from nf4convert.sinks.gguf.typeplan import Hparams, Tensor, type_plan  # noqa: E402

N_LAYER, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB = 32, 4096, 14336, 32, 8, 128, 128256


def llama_8b():
    tensors = [
        Tensor("token_embd.weight", (N_EMBD, N_VOCAB), "BF16"),
        Tensor("output.weight", (N_EMBD, N_VOCAB), "BF16"),
    ]
    for i in range(N_LAYER):
        blk = f"blk.{i}."
        tensors += [
            Tensor(blk + "attn_q.weight", (N_EMBD, N_HEAD * HEAD_DIM), "BF16"),
            Tensor(blk + "attn_k.weight", (N_EMBD, N_HEAD_KV * HEAD_DIM), "BF16"),
            Tensor(blk + "attn_v.weight", (N_EMBD, N_HEAD_KV * HEAD_DIM), "BF16"),
            Tensor(blk + "attn_output.weight", (N_HEAD * HEAD_DIM, N_EMBD), "BF16"),
            Tensor(blk + "ffn_gate.weight", (N_EMBD, N_FF), "BF16"),
            Tensor(blk + "ffn_up.weight", (N_EMBD, N_FF), "BF16"),
            Tensor(blk + "ffn_down.weight", (N_FF, N_EMBD), "BF16"),
        ]
    return tensors


def timed(kind, rows, imatrix):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = kind.quantize(rows, imatrix)
    torch.cuda.synchronize()
    assert out.shape == (rows.shape[0], kind.row_size(rows.shape[1]))
    return time.perf_counter() - start


def profile(rows, result):
    """Wall time against the GPU's busy time (the kernels' sum) and the number of kernels: how much of the time is
    the host launching operations rather than the GPU running them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    kind = quant_type("Q4_K")
    timed(kind, rows[:64], None)
    with profiler(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = timed(kind, rows, None)
    events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(event.time_range.elapsed_us() for event in events) / 1e6
    print(f"profile Q4_K ffn_gate: wall {wall:.3f} s, kernels {len(events)}, GPU busy {busy:.3f} s", flush=True)
    result["profile"] = {"wall": wall, "kernels": len(events), "gpu_busy": busy}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ftype", default="Q4_K_M")
    parser.add_argument("--chunks", default="22,23,24,25", help="log2 values per chunk to try; '' keeps the default")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="first: Q4_K on one ffn_gate under torch's profiler")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)

    def weight(ne):
        return (torch.randn(ne[1], ne[0], generator=generator, device="cuda") * 0.02).to(torch.bfloat16)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GB/s of bf16 input, on the device")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ftype": args.ftype}
    if args.chunks:
        rows, kind, sweep, best = weight((N_EMBD, N_FF)), quant_type("Q4_K"), {}, (0.0, 24)
        timed(kind, rows[:64], None)
        for fused in (True, False):
            TORCH.cuda_sums = fused
            for log2 in (int(v) for v in args.chunks.split(",")):
                kind.device_chunk_values = 1 << log2
                gbps = rows.numel() * 2 / timed(kind, rows, None) / 1e9
                sums = "one kernel a sum" if fused else "one operation an element"
                print(f"Q4_K ffn_gate, 2**{log2} values a chunk, {sums}: {gbps:.2f} GB/s", flush=True)
                sweep[f"{log2}{'' if fused else '-unfused'}"] = gbps
                if fused:
                    best = max(best, (gbps, log2))
        TORCH.cuda_sums = True
        QuantType.device_chunk_values = 1 << best[1]
        del kind.device_chunk_values
        result["chunk_sweep_gbps"] = sweep
    result["device_chunk_values"] = QuantType.device_chunk_values

    if args.profile:
        profile(weight((N_EMBD, N_FF)), result)
    tensors = llama_8b()
    plan = type_plan(tensors, Hparams("llama", N_LAYER, N_HEAD, N_HEAD_KV), args.ftype)
    counts = Counter((tensor.ne, plan[tensor.name]) for tensor in tensors)
    total_bytes = sum(tensor.ne[0] * tensor.ne[1] * 2 for tensor in tensors)
    for weighted in (False, True):
        model_seconds, rows_out = 0.0, []
        for (ne, name), count in sorted(counts.items(), key=lambda item: item[0][1]):
            kind, rows = quant_type(name), weight(ne)
            imatrix = (torch.randn(ne[0], generator=generator, device="cuda") ** 2) if weighted else None
            timed(kind, rows[:8], imatrix)
            seconds = timed(kind, rows, imatrix)
            model_seconds += count * seconds
            gbps = rows.numel() * 2 / seconds / 1e9
            rows_out.append({"type": name, "shape": [ne[1], ne[0]], "tensors": count, "seconds": seconds, "gbps": gbps})
            label = "imatrix" if weighted else "plain"
            print(
                f"{label:8s} {name:5s} {ne[1]:6d} x {ne[0]:5d} x{count:3d}: {seconds:7.3f} s, {gbps:6.2f} GB/s",
                flush=True,
            )
            del rows
        gbps = total_bytes / model_seconds / 1e9
        print(
            f"{'imatrix' if weighted else 'plain'}: Llama-3.1-8B {args.ftype}, {total_bytes / 1e9:.1f} GB of bf16: "
            f"{model_seconds:.1f} s, {gbps:.2f} GB/s",
            flush=True,
        )
        result["imatrix" if weighted else "plain"] = {"tensors": rows_out, "model_seconds": model_seconds, "gbps": gbps}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

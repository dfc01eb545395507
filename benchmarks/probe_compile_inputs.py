"""Probe: does a compiled layer stack pay per quant-state tensor? (torch.compile with torch's defaults; the GPU.)

    python benchmarks/probe_compile_inputs.py [ROWSxCOLS]

A Linear4bit-style layer hands the torch.compile op five tensors (packed weight, absmax, nested code, nested absmax,
offset); each graph input costs Dynamo a tensor guard and Inductor (torch 2.11) a size assert before the first kernel.
Were that the compiled stack's extra time, folding the four quant-state tensors into one buffer (an opt-in step on the
user's quant states) would pay. Variants, 16 and 48 layers, eager and compiled (bench_compile's stack_times):
  api      nf4convert.dequantize_4bit (the checks, the five tensors)
  direct5  the op called with the state's five tensors, no checks (what the checks' guards cost)
  direct2  the op with the packed weight and one zero buffer standing for all four state tensors: two inputs, the
           same kernel work (zero scales; outputs are zeros, compared only eager against compiled)
  dense    the control: F.linear on dense weights
Two rounds. Eager times of direct5/direct2 call the triton_op eagerly (its slow path): compare compiled times."""

import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_compile as B

import nf4convert
from nf4convert.dequantize import _code_table
from nf4convert.kernels import compiled  # noqa: F401

rows, cols = map(int, (sys.argv[1] if len(sys.argv) > 1 else "14336x4096").split("x"))
dtype = torch.float16
counts = [16, 48]


class Direct(torch.nn.Module):
    def __init__(self, packed, state, fold):
        super().__init__()
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.quant_state = state
        self.fold = fold
        if fold:
            n_blocks = state.absmax.numel()
            self.quant_state.buf = torch.zeros(max(n_blocks, 260), dtype=torch.float32, device="cuda")

    def forward(self, x):
        q = self.quant_state
        code = _code_table(q.quant_type, self.weight.device)
        if self.fold:
            b = q.buf
            w = torch.ops.nf4convert.dequantize_4bit(self.weight, b, b, b, b, code, 64, 256, [rows, cols], dtype)
        else:
            w = torch.ops.nf4convert.dequantize_4bit(
                self.weight, q.absmax, q.state2.code, q.state2.absmax, q.offset, code, 64, 256, [rows, cols], dtype
            )
        return torch.nn.functional.linear(x, w)


weights = [B.quantized((rows, cols), dtype, seed) for seed in range(max(counts))]
for w in weights:
    s = w[1]
    if not isinstance(s.offset, torch.Tensor):
        s.offset = torch.tensor(float(s.offset))
    s.offset = s.offset.to("cuda", torch.float32)
x = torch.randn(1, cols, dtype=dtype, device="cuda")
dense_w = [nf4convert.dequantize_4bit(p, s) for p, s in weights]
variants = {
    "api": lambda ws: B.Layers([B.Layer(p, s) for p, s in ws]),
    "direct5": lambda ws: B.Layers([Direct(p, s, False) for p, s in ws]),
    "direct2": lambda ws: B.Layers([Direct(p, s, True) for p, s in ws]),
    "dense": lambda ws: B.Dense([dense_w[i] for i in range(len(ws))]),
}
for rnd in range(2):
    for name, make in variants.items():
        r = B.stack_times(make, weights, counts, x, None, B.close)
        e, c = r["forward_us"]["48"]
        print(
            f"round {rnd} {name:8s} {rows}x{cols}: 48-layer forward eager {e:.0f} us compiled {c:.0f} us x{c / e:.3f}; "
            f"per layer {r['eager_us_per_layer']:.1f}/{r['compiled_us_per_layer']:.1f} graphs {r['graphs']}",
            flush=True,
        )

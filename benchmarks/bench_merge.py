"""Where one LoRA merge's time goes on the conversion's route (the adapter route's serial part): the base weight
made whole (on the device where the route can, else through the route's pieces into host memory), its copy to
the device, peft's merge arithmetic, the copy back (through pinned memory from a GPU). One layer
of the 8B-shaped checkpoint of bench_convert.py with its rank-16 adapter; milliseconds, best of 3, per weight."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from bench_convert import build_adapter, build_source

from nf4convert.adapters import merge as peft_merge
from nf4convert.dtypes import output_dtype
from nf4convert.kinds.base import whole as _whole
from nf4convert.kinds.merge_lora import MergeLora
from nf4convert.pipeline.routes.base import route_for
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader


def timed(fn, sync):
    sync()
    started = time.perf_counter()
    result = fn()
    sync()
    return result, (time.perf_counter() - started) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--via-host", action="store_true", help="the way before: whole in pageable host memory, out into it"
    )
    options = parser.parse_args()
    device = torch.device(options.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as work:
        source, adapter = Path(work) / "src", Path(work) / "adapter"
        build_source(source, layers=1)
        build_adapter(adapter, layers=1)
        plan = make_plan(source, dtype=output_dtype("bf16"), adapter=adapter)
        merges = [t for t in plan.tensors if isinstance(t.recipe, MergeLora)]
        print(f"{device}: {len(merges)} merges in one layer; ms per weight, best of 3", flush=True)
        print("| weight | shape | whole via pieces | to device | merge | back to host | total |")
        print("|---|---|---|---|---|---|---|")
        with route_for(device) as route, TensorReader() as reader:
            for tensor in merges:
                best = None
                for _ in range(3):
                    base = dataclasses.replace(tensor, recipe=tensor.recipe.base)
                    # as kinds/merge_lora.py does: whole on the device where the route can, else through the host
                    where = "cpu" if options.via_host else route.device
                    whole, t_whole = timed(lambda: _whole(base, reader, route, where), sync)
                    weight = whole.view(torch.bfloat16).view(tensor.shape)
                    on_device, t_h2d = timed(lambda: weight.to(route.device), sync)
                    lora = peft_merge.read_lora(tensor.recipe.target, reader)
                    merged, t_merge = timed(
                        lambda: peft_merge.merge(tensor.recipe.target, on_device, lora, inplace=True), sync
                    )
                    flat = merged.contiguous().view(-1).view(torch.uint8)
                    out = (
                        (lambda: torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True).copy_(flat))
                        if flat.is_cuda and not options.via_host
                        else flat.cpu
                    )
                    _, t_d2h = timed(out, sync)
                    row = (t_whole, t_h2d, t_merge, t_d2h)
                    best = row if best is None or sum(row) < sum(best) else best
                print(
                    f"| {tensor.name} | {list(tensor.shape)} | "
                    + " | ".join(f"{t:.1f}" for t in best)
                    + f" | {sum(best):.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""nf4convert beside llm-dequant (a single-purpose compressed-tensors NVFP4 dequantizer on the registry) on the same
compressed-tensors NVFP4 checkpoint: both outputs compared tensor by tensor (and, where they differ, against
compressed-tensors' own decompression), both timed with their peak memory.

    pip install --target DIR llm-dequant==0.1.0
    python benchmarks/bench_llm_dequant.py --llm-dequant DIR [--layers 6] [--workdir DIR] [--repeat 2]

The checkpoint is Qwen3-shaped (hidden 1024, intermediate 3072, 16 heads of 64, 8 KV heads, vocab 32000,
``--layers`` layers, bf16 random weights of a trained model's spread), every linear layer but ``lm_head`` NVFP4
(llm-compressor's NVFP4 scheme: each global scale from ``generate_gparam``, the group scales from
``calculate_qparams``, packed by compressed-tensors' own ``NVFP4PackedCompressor.compress``), with static input
global scales. Each tool runs in a fresh process on the CPU, bf16 out; ``bench_convert.measure`` samples its
RssAnon, VmRSS and the PSS of its process tree every 5 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_convert import measure

NVFP4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False)


def build_source(folder: Path, layers: int) -> None:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    args = QuantizationArgs(**NVFP4)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=args,
        input_activations=QuantizationArgs(**{**NVFP4, "dynamic": "local"}),
        format="nvfp4-pack-quantized",
    )
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    state = {}
    for name, parameter in model.state_dict().items():
        value = parameter.detach().normal_(0, 0.02) if parameter.ndim == 2 else parameter.detach()
        if not name.endswith("_proj.weight"):
            state[name] = value.contiguous()
            continue
        amax = value.float().abs().amax().reshape(1)
        global_scale = generate_gparam(-amax, amax)
        groups = value.float().unflatten(-1, (-1, 16))
        zero = torch.zeros(groups.shape[:-1])
        scale, _ = calculate_qparams(
            torch.minimum(groups.amin(-1), zero), torch.maximum(groups.amax(-1), zero), args, global_scale=global_scale
        )
        layer = name[: -len(".weight")]
        parts = {"weight": value, "weight_scale": scale, "weight_global_scale": global_scale}
        for part, tensor in compressor.compress(parts, scheme).items():
            state[f"{layer}.{part}"] = tensor.contiguous()
        state[f"{layer}.input_global_scale"] = torch.tensor([1.0], dtype=torch.float32)
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    quantization = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    saved = json.loads(config.to_json_string())
    saved.update(architectures=["Qwen3ForCausalLM"], quantization_config=quantization)
    (folder / "config.json").write_text(json.dumps(saved, indent=2))


def read_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def compare(source: Path, ours: Path, theirs: Path) -> dict:
    """Tensor by tensor: names, dtypes, shapes and bytes; where the two differ, which the library's own decompression
    gives."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    a, b, src = read_state(ours), read_state(theirs), read_state(source)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**NVFP4))
    differing, agrees = [], {}
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        if same:
            continue
        differing.append(name)
        layer = name[: -len(".weight")]
        if f"{layer}.weight_packed" in src:
            parts = {p: src[f"{layer}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            reference = compressor.decompress(parts, scheme)["weight"]
            agrees[name] = {
                "nf4convert": bool(torch.equal(x.view(torch.uint8), reference.view(torch.uint8))),
                "llm-dequant": bool(torch.equal(y.view(torch.uint8), reference.view(torch.uint8))),
            }
    return {
        "tensors_ours": len(a),
        "tensors_theirs": len(b),
        "only_ours": sorted(a.keys() - b.keys()),
        "only_theirs": sorted(b.keys() - a.keys()),
        "differing": differing,
        "reference_agrees": agrees,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm-dequant", required=True, help="the folder llm-dequant was pip-installed into (--target)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-llm-dequant-"))
    source = work / "qwen3-nvfp4"
    if not source.exists():
        build_source(source, args.layers)
    commands = {
        "nf4convert": lambda out: [
            sys.executable,
            "-m",
            "nf4convert",
            str(source),
            "-o",
            str(out),
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "-q",
        ],  # fmt: skip
        "llm-dequant": lambda out: [
            sys.executable,
            "-m",
            "llm_dequant.cli",
            "convert",
            str(source),
            str(out),
            "--dtype",
            "bf16",
        ],  # fmt: skip
    }
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [args.llm_dequant, os.environ.get("PYTHONPATH")]))}
    runs = {tool: [] for tool in commands}
    for index in range(args.repeat):
        for tool, command in commands.items():
            out = work / f"{tool}-{index}"
            shutil.rmtree(out, ignore_errors=True)
            runs[tool].append(measure(command(out), env=env if tool == "llm-dequant" else None))
    output_bytes = sum(p.stat().st_size for p in (work / "nf4convert-0").glob("*.safetensors"))
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "source_bytes": sum(p.stat().st_size for p in source.glob("*.safetensors")),
        "output_bytes": output_bytes,
        "comparison": compare(source, work / "nf4convert-0", work / "llm-dequant-0"),
        **{
            tool: {
                "seconds_median": statistics.median(r["seconds"] for r in rs),
                "peak_anon_mb_max": max(r["peak_anon_mb"] for r in rs),
                "peak_tree_pss_mb_max": max(r["peak_tree_pss_mb"] for r in rs),
                "runs": [{k: r[k] for k in ("seconds", "peak_anon_mb", "peak_rss_mb", "peak_tree_pss_mb")} for r in rs],
            }
            for tool, rs in runs.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

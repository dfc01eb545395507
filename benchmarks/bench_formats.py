"""Checkpoints released as floats, at real shapes: gpt-oss-20b's MXFP4 experts and DeepSeek-V3's block FP8, converted
on each route and verified, beside ``dd`` of the same output bytes.

    python benchmarks/bench_formats.py --format mxfp4 [--layers 24] [--experts 32] [--steps ...] [--workdir DIR]
    python benchmarks/bench_formats.py --format fp8 --layers 4 [--experts 256] [--steps ...] [--workdir DIR]
    python benchmarks/bench_formats.py --format nvfp4 --layers 12 [--experts 128] [--steps ...] [--workdir DIR]

Checkpoints (synthesized, not quantized: random valid packed data, so building takes seconds; built once into
``--workdir`` and reused while a folder of the same shapes is there; ``--build-only`` builds and stops):

  mxfp4  gpt-oss-20b: hidden 2880, intermediate 2880, 32 experts, 24 layers, 64 heads of 64, 8 KV heads, vocab
         201088, untied head. Experts' ``gate_up_proj`` / ``down_proj`` as ``_blocks`` (random bytes: every nibble is
         an E2M1 value) and ``_scales`` (E8M0 bytes 118..133), their biases and everything else BF16, as gpt-oss
         ships it; ``quant_method: "mxfp4"``. About 13 GB in, 40 GB of bf16 out. (gpt-oss-120b: ``--experts 128
         --layers 36``, the same per-expert shapes.)
  fp8    DeepSeek-V3: hidden 7168, MLA attention (q_lora_rank 1536, kv_lora_rank 512, 128 heads, 128 + 64 / 128 head
         dims), the first 3 layers dense (intermediate 18432), the rest MoE (256 routed experts and 1 shared of 2048,
         the router BF16 with its F32 correction bias), vocab 129280; every linear weight F8_E4M3 (random codes, no
         NaN) with F32 ``weight_scale_inv`` per 128 x 128 block (ragged where DeepSeek's are: ``kv_a_proj_with_mqa``
         [576, 7168]), ``quant_method: "fp8"``. A MoE layer is 11.5 GB in and 23 GB of bf16 out: ``--layers 4`` (3
         dense and 1 MoE) is 17 GB in and 30 GB out.
  nvfp4  Qwen3-30B-A3B as compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4 recipe): hidden 2048,
         48 layers of 128 experts (intermediate 768), 32 heads of 128, 4 KV heads, vocab 151936; every linear weight
         ``weight_packed`` (random bytes), ``weight_scale`` (positive E4M3 codes) and an F32 ``weight_global_scale``,
         the router, the head and the rest BF16. A layer is 0.34 GB in and 1.2 GB of bf16 out: ``--layers 12`` (the
         default) is 4.7 GB in and 16 GB out; all 48 are 17 GB in and 61 GB out.

Steps (``--steps``, comma-separated, in order, each in a fresh process after the previous output is removed and a
``sync``): ``dd`` (the dense output's bytes), ``cuda`` / ``cpu`` (nf4convert SOURCE -o OUT --device ...),
``verify-cuda`` (nf4convert verify of the cuda output on the GPU), ``verify-cpu`` (of the cpu output on the CPU).
Each is timed at its process's exit and after the ``sync`` that follows; peak RssAnon and peak Pss with children, as
bench_convert.py measures them. The cuda and cpu outputs are compared by the SHA-256 of each shard (both never lie
on the disk at once: about 56 GB for gpt-oss-20b's source and one output; kept in the workdir, so steps split over
several calls are compared too). A markdown table on stdout; JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_convert import measure, sync_seconds

GPT_OSS_20B = dict(
    hidden=2880, intermediate=2880, experts=32, layers=24, heads=64, kv_heads=8, head_dim=64, vocab=201088
)
DEEPSEEK_V3 = dict(
    hidden=7168, intermediate=18432, moe_intermediate=2048, experts=256, shared=1, heads=128, q_lora=1536, kv_lora=512,
    nope=128, rope=64, v_head=128, vocab=129280, dense_layers=3, layers=61,
)  # fmt: skip
QWEN3_30B_A3B = dict(
    hidden=2048, moe_intermediate=768, experts=128, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936,
)  # fmt: skip
BLOCK = 128
ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 4 * 10**9  # the Hub's releases of both are sharded near this


def _shapes_mxfp4(sizes: dict):
    """(name, kind, shape) in the order gpt-oss's checkpoint holds them: kind "bf16", "blocks", "scales"."""
    hidden, inter, experts = sizes["hidden"], sizes["intermediate"], sizes["experts"]
    heads, kv, head_dim = sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    groups = hidden // 32
    yield "model.embed_tokens.weight", "bf16", (sizes["vocab"], hidden)
    for layer in range(sizes["layers"]):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", "bf16", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", "bf16", (hidden,)
        for name, rows, columns in (
            ("q_proj", heads * head_dim, hidden),
            ("k_proj", kv * head_dim, hidden),
            ("v_proj", kv * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
        ):
            yield f"{prefix}.self_attn.{name}.weight", "bf16", (rows, columns)
            yield f"{prefix}.self_attn.{name}.bias", "bf16", (rows,)
        yield f"{prefix}.self_attn.sinks", "bf16", (heads,)
        yield f"{prefix}.mlp.router.weight", "bf16", (experts, hidden)
        yield f"{prefix}.mlp.router.bias", "bf16", (experts,)
        for name, rows, in_groups in (("gate_up_proj", 2 * inter, groups), ("down_proj", hidden, inter // 32)):
            yield f"{prefix}.mlp.experts.{name}_blocks", "blocks", (experts, rows, in_groups, 16)
            yield f"{prefix}.mlp.experts.{name}_scales", "scales", (experts, rows, in_groups)
            yield f"{prefix}.mlp.experts.{name}_bias", "bf16", (experts, rows)
    yield "model.norm.weight", "bf16", (hidden,)
    yield "lm_head.weight", "bf16", (sizes["vocab"], hidden)


def _linear_fp8(name: str, rows: int, columns: int):
    yield name + ".weight", "fp8", (rows, columns)
    yield name + ".weight_scale_inv", "scale", (-(-rows // BLOCK), -(-columns // BLOCK))


def _shapes_fp8(sizes: dict):
    """(name, kind, shape) in the order DeepSeek-V3's checkpoint holds a layer: kind "bf16", "f32", "fp8", "scale"."""
    hidden, heads = sizes["hidden"], sizes["heads"]
    yield "model.embed_tokens.weight", "bf16", (sizes["vocab"], hidden)
    for layer in range(sizes["layers"]):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", "bf16", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", "bf16", (hidden,)
        attention = f"{prefix}.self_attn"
        yield from _linear_fp8(f"{attention}.q_a_proj", sizes["q_lora"], hidden)
        yield f"{attention}.q_a_layernorm.weight", "bf16", (sizes["q_lora"],)
        yield from _linear_fp8(f"{attention}.q_b_proj", heads * (sizes["nope"] + sizes["rope"]), sizes["q_lora"])
        yield from _linear_fp8(f"{attention}.kv_a_proj_with_mqa", sizes["kv_lora"] + sizes["rope"], hidden)
        yield f"{attention}.kv_a_layernorm.weight", "bf16", (sizes["kv_lora"],)
        yield from _linear_fp8(f"{attention}.kv_b_proj", heads * (sizes["nope"] + sizes["v_head"]), sizes["kv_lora"])
        yield from _linear_fp8(f"{attention}.o_proj", hidden, heads * sizes["v_head"])
        if layer < sizes["dense_layers"]:
            mlps = [(f"{prefix}.mlp", sizes["intermediate"])]
        else:
            yield f"{prefix}.mlp.gate.weight", "bf16", (sizes["experts"], hidden)
            yield f"{prefix}.mlp.gate.e_score_correction_bias", "f32", (sizes["experts"],)
            mlps = [(f"{prefix}.mlp.experts.{e}", sizes["moe_intermediate"]) for e in range(sizes["experts"])]
            mlps.append((f"{prefix}.mlp.shared_experts", sizes["moe_intermediate"] * sizes["shared"]))
        for mlp, inter in mlps:
            yield from _linear_fp8(f"{mlp}.gate_proj", inter, hidden)
            yield from _linear_fp8(f"{mlp}.up_proj", inter, hidden)
            yield from _linear_fp8(f"{mlp}.down_proj", hidden, inter)
    yield "model.norm.weight", "bf16", (hidden,)
    yield "lm_head.weight", "bf16", (sizes["vocab"], hidden)


def _linear_nvfp4(name: str, rows: int, columns: int):
    yield name + ".weight_packed", "nvfp4", (rows, columns // 2)
    yield name + ".weight_scale", "nvfp4-scale", (rows, columns // 16)
    yield name + ".weight_global_scale", "global-scale", (1,)


def _shapes_nvfp4(sizes: dict):
    """(name, kind, shape) of a Qwen3-30B-A3B-shaped compressed-tensors NVFP4 checkpoint: every linear layer NVFP4
    but the router and the head, as llm-compressor's NVFP4 recipe leaves them."""
    hidden, heads, kv, head_dim = sizes["hidden"], sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    yield "model.embed_tokens.weight", "bf16", (sizes["vocab"], hidden)
    for layer in range(sizes["layers"]):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", "bf16", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", "bf16", (hidden,)
        attention = f"{prefix}.self_attn"
        yield from _linear_nvfp4(f"{attention}.q_proj", heads * head_dim, hidden)
        yield from _linear_nvfp4(f"{attention}.k_proj", kv * head_dim, hidden)
        yield from _linear_nvfp4(f"{attention}.v_proj", kv * head_dim, hidden)
        yield from _linear_nvfp4(f"{attention}.o_proj", hidden, heads * head_dim)
        yield f"{attention}.q_norm.weight", "bf16", (head_dim,)
        yield f"{attention}.k_norm.weight", "bf16", (head_dim,)
        yield f"{prefix}.mlp.gate.weight", "bf16", (sizes["experts"], hidden)
        for expert in range(sizes["experts"]):
            mlp = f"{prefix}.mlp.experts.{expert}"
            yield from _linear_nvfp4(f"{mlp}.gate_proj", sizes["moe_intermediate"], hidden)
            yield from _linear_nvfp4(f"{mlp}.up_proj", sizes["moe_intermediate"], hidden)
            yield from _linear_nvfp4(f"{mlp}.down_proj", hidden, sizes["moe_intermediate"])
    yield "model.norm.weight", "bf16", (hidden,)
    yield "lm_head.weight", "bf16", (sizes["vocab"], hidden)


def _tensor(kind: str, shape: tuple, generator, device):
    """Random valid data of ``kind``: bf16 weights of a trained model's size, any byte for MXFP4 blocks, E8M0 scale
    bytes of a trained model's range, FP8 codes but the NaN ones, positive finite F32 block scales."""
    import torch

    if kind == "bf16":
        return (torch.randn(shape, device=device, generator=generator) * 0.02).to(torch.bfloat16).cpu()
    if kind == "f32":
        return torch.randn(shape, device=device, generator=generator).cpu()
    if kind == "blocks":
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator).cpu()
    if kind == "scales":
        return torch.randint(118, 134, shape, dtype=torch.uint8, device=device, generator=generator).cpu()
    if kind == "fp8":
        codes = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
        codes[(codes & 0x7F) == 0x7F] -= 1  # 0x7f/0xff are e4m3's NaN: no writer makes them
        return codes.view(torch.float8_e4m3fn).cpu()
    if kind == "nvfp4":  # any byte: every nibble is an E2M1 value
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator).cpu()
    if kind == "nvfp4-scale":  # positive normal E4M3 codes of a trained model's range
        codes = torch.randint(0x30, 0x58, shape, dtype=torch.uint8, device=device, generator=generator)
        return codes.view(torch.float8_e4m3fn).cpu()
    if kind == "global-scale":  # 448 * 6 / amax of the layer's weights, as compressed-tensors computes it
        return (torch.rand(shape, device=device, generator=generator) * 1e4 + 1e4).cpu()
    return (torch.rand(shape, device=device, generator=generator) * 1e-3 + 1e-5).cpu()  # "scale"


def _dense_bytes(shapes) -> int:
    """Bytes of the bf16 output: blocks become [E, G * 32, R], codes a bf16 weight of their shape; scales vanish."""
    total = 0
    for _, kind, shape in shapes:
        if kind in ("blocks", "nvfp4"):
            total += 2 * math.prod(shape) * 2  # two values a byte
        elif kind in ("bf16", "fp8"):
            total += 2 * math.prod(shape)
        elif kind == "f32":
            total += 2 * math.prod(shape)  # cast to the output dtype
    return total


def build(folder: Path, fmt: str, sizes: dict) -> int:
    """Write the synthesized checkpoint into ``folder`` (shards of about SHARD_BYTES, their index, config.json);
    returns the bytes of its dense bf16 output."""
    import torch
    from safetensors.torch import save_file

    shapes = list({"mxfp4": _shapes_mxfp4, "fp8": _shapes_fp8, "nvfp4": _shapes_nvfp4}[fmt](sizes))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random bytes at GPU speed where there is one
    generator = torch.Generator(device).manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    parts, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        if current:
            parts.append(list(current))
            save_file(current, folder / f"part-{len(parts)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0

    for name, kind, shape in shapes:
        tensor = _tensor(kind, shape, generator, device)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
        current[name] = tensor
        size += nbytes
    flush()
    weight_map = {}
    for index, names in enumerate(parts, 1):
        target = folder / f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        (folder / f"part-{index}.safetensors").rename(target)
        weight_map.update(dict.fromkeys(names, target.name))
    total = sum((folder / name).stat().st_size for name in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(_config(fmt, sizes), indent=2))
    return _dense_bytes(shapes)


def _config(fmt: str, sizes: dict) -> dict:
    if fmt == "mxfp4":
        from transformers import GptOssConfig

        config = GptOssConfig(
            num_hidden_layers=sizes["layers"],
            num_local_experts=sizes["experts"],
            vocab_size=sizes["vocab"],
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["intermediate"],
            num_attention_heads=sizes["heads"],
            num_key_value_heads=sizes["kv_heads"],
            head_dim=sizes["head_dim"],
            layer_types=["sliding_attention", "full_attention"] * (sizes["layers"] // 2)
            + ["sliding_attention"] * (sizes["layers"] % 2),
            tie_word_embeddings=False,
        ).to_dict()
        config["quantization_config"] = {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        }
        config["architectures"] = ["GptOssForCausalLM"]
    elif fmt == "nvfp4":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(
            num_hidden_layers=sizes["layers"],
            num_experts=sizes["experts"],
            num_experts_per_tok=min(8, sizes["experts"]),
            moe_intermediate_size=sizes["moe_intermediate"],
            hidden_size=sizes["hidden"],
            num_attention_heads=sizes["heads"],
            num_key_value_heads=sizes["kv_heads"],
            head_dim=sizes["head_dim"],
            vocab_size=sizes["vocab"],
            tie_word_embeddings=False,
        ).to_dict()
        weights = QuantizationArgs(
            num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False
        )
        scheme = QuantizationScheme(targets=["Linear"], weights=weights, format="nvfp4-pack-quantized")
        config["quantization_config"] = QuantizationConfig(
            config_groups={"group_0": scheme},
            format="nvfp4-pack-quantized",
            quantization_status="compressed",
            ignore=["lm_head", "re:.*mlp.gate$"],
        ).model_dump(mode="json")
        config["architectures"] = ["Qwen3MoeForCausalLM"]
    else:
        from transformers import DeepseekV3Config

        config = DeepseekV3Config(
            num_hidden_layers=sizes["layers"],
            first_k_dense_replace=min(sizes["dense_layers"], sizes["layers"]),
            n_routed_experts=sizes["experts"],
            n_shared_experts=sizes["shared"],
            num_experts_per_tok=min(8, sizes["experts"]),
            n_group=min(8, sizes["experts"]),
            topk_group=min(4, sizes["experts"]),
            vocab_size=sizes["vocab"],
            tie_word_embeddings=False,
        ).to_dict()
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
        }
        config["architectures"] = ["DeepseekV3ForCausalLM"]
    config["dtype"] = "bfloat16"
    return config


def shard_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each safetensors file, hashed on every core (hashlib lets go of Python's lock)."""

    def digest(path: Path) -> str:
        hashed = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                hashed.update(chunk)
        return hashed.hexdigest()

    paths = sorted(folder.glob("*.safetensors"))
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return dict(zip((p.name for p in paths), pool.map(digest, paths)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["mxfp4", "fp8", "nvfp4"], required=True)
    parser.add_argument("--layers", type=int, default=None, help="default: gpt-oss-20b's 24; fp8: 4 (3 dense + 1 MoE)")
    parser.add_argument("--experts", type=int, default=None, help="default: gpt-oss-20b's 32, DeepSeek-V3's 256")
    parser.add_argument("--vocab", type=int, default=None, help="default: the model's")
    parser.add_argument("--steps", default="dd,cuda,verify-cuda,cpu,verify-cpu")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--json")
    options = parser.parse_args()
    import torch
    import transformers

    sizes = dict({"mxfp4": GPT_OSS_20B, "fp8": DEEPSEEK_V3, "nvfp4": QWEN3_30B_A3B}[options.format])
    sizes["layers"] = options.layers or {"mxfp4": GPT_OSS_20B["layers"], "fp8": 4, "nvfp4": 12}[options.format]
    sizes["experts"] = options.experts or sizes["experts"]
    sizes["vocab"] = options.vocab or sizes["vocab"]
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="nf4convert-bench-formats-"))
    label = f"{options.format}-{sizes['layers']}l-{sizes['experts']}e-{sizes['vocab']}v"
    source = workdir / f"source-{label}"
    marker = source / "built.json"
    if marker.is_file():
        dense = json.loads(marker.read_text())["dense_bytes"]
        print(f"source: {source} (built before)", flush=True)
    else:
        for stale in workdir.glob("source-*"):  # another shape's: the disk holds one source and one output
            shutil.rmtree(stale, ignore_errors=True)
        started = time.perf_counter()
        dense = build(source, options.format, sizes)
        marker.write_text(json.dumps({"dense_bytes": dense, "sizes": sizes}))
        built = time.perf_counter() - started
        print(f"source: built in {built:.1f} s", flush=True)
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    free = shutil.disk_usage(workdir).free
    print(
        f"{label}: {source_bytes / 1e9:.2f} GB in, {dense / 1e9:.2f} GB of bf16 out; {free / 1e9:.1f} GB free",
        flush=True,
    )
    if dense > free:
        raise SystemExit(f"the output ({dense / 1e9:.1f} GB) does not fit the {free / 1e9:.1f} GB free: fewer --layers")
    if options.build_only:
        return
    module = [sys.executable, "-m", "nf4convert.cli.commands"]
    out_of = {"cuda": workdir / "out-cuda", "cpu": workdir / "out-cpu", "dd": workdir / "out-dd"}
    commands = {
        "dd": [
            "bash",
            "-c",
            f"mkdir -p {out_of['dd']} && dd if=/dev/zero of={out_of['dd']}/model.bin bs=64M iflag=count_bytes "
            f"count={dense} status=none",
        ],
        "cuda": [*module, str(source), "-q", "--overwrite", "-o", str(out_of["cuda"]), "--device", "cuda"],
        "cpu": [*module, str(source), "-q", "--overwrite", "-o", str(out_of["cpu"]), "--device", "cpu"],
        "verify-cuda": [*module, "verify", str(out_of["cuda"]), str(source), "--device", "cuda", "-q"],
        "verify-cpu": [*module, "verify", str(out_of["cpu"]), str(source), "--device", "cpu", "-q"],
    }
    # this checkout's nf4convert, wherever the script is run from
    env = {"NF4CONVERT_PROFILE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    steps = [step for step in options.steps.split(",") if step]
    unknown = [step for step in steps if step not in commands]
    if unknown:
        raise SystemExit(f"unknown steps {unknown}: {', '.join(commands)}")
    results = {}
    kept = workdir / f"digests-{label}.json"  # a later call's steps are compared with an earlier call's output
    digests = json.loads(kept.read_text()) if kept.is_file() else {}
    for index, step in enumerate(steps):
        route = step.removeprefix("verify-")
        if not step.startswith("verify-"):  # a new output: every other one goes first (the disk holds one)
            for other in out_of.values():
                shutil.rmtree(other, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        try:
            run = measure(commands[step], env)
        except SystemExit as error:
            print(f"{step}: failed: {str(error)[-800:]}", flush=True)
            continue
        run["synced_seconds"] = run["seconds"] + sync_seconds()
        results[step] = run
        print(step, json.dumps(run), flush=True)
        if step in ("cuda", "cpu"):
            run["output_gb"] = sum(p.stat().st_size for p in out_of[route].glob("*.safetensors")) / 1e9
            digests[step] = shard_digests(out_of[route])
            kept.write_text(json.dumps(digests))
        later = steps[index + 1 :]
        if step != "dd" and f"verify-{route}" not in later:
            shutil.rmtree(out_of[route], ignore_errors=True)
    for other in out_of.values():
        shutil.rmtree(other, ignore_errors=True)
    identical = digests["cuda"] == digests["cpu"] if {"cuda", "cpu"} <= digests.keys() else None
    if identical is not None:
        print(f"cuda and cpu outputs identical: {identical}", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}; {label}: "
        f"{source_bytes / 1e9:.2f} GB in, {dense / 1e9:.2f} GB of bf16 out"
    )
    print("| step | s (exit) | GB/s out | x dd | s (+sync) | x dd | x its conversion | peak RssAnon | peak Pss tree |")
    print("|---|---|---|---|---|---|---|---|---|")
    dd = results.get("dd")
    for step, run in results.items():
        conversion = results.get(step.removeprefix("verify-")) if step.startswith("verify-") else None

        def ratio(value, base):
            return f"{value / base:.2f}" if base else "-"

        print(
            f"| {step} | {run['seconds']:.1f} | {dense / 1e9 / run['seconds']:.2f} | "
            f"{ratio(run['seconds'], dd and dd['seconds'])} | {run['synced_seconds']:.1f} | "
            f"{ratio(run['synced_seconds'], dd and dd['synced_seconds'])} | "
            f"{ratio(run['seconds'], conversion and conversion['seconds'])} | {run['peak_anon_mb']:.0f} MB | "
            f"{run['peak_tree_pss_mb']:.0f} MB |"
        )
    if options.json:
        Path(options.json).write_text(
            json.dumps(
                {
                    "gpu": gpu,
                    "label": label,
                    "sizes": sizes,
                    "source_bytes": source_bytes,
                    "dense_bytes": dense,
                    "identical": identical,
                    "results": results,
                },
                indent=1,
            )  # fmt: skip
        )
    if options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""compressed-tensors weights in an output dtype other than the one the library decompresses them in: the output
holds the library's values (its ``decompress`` on the checkpoint's tensors as stored, in the scale's dtype for FP8
and integers, in bf16 for NVFP4, then the cast), what a model loaded through compressed-tensors holds, and verify
checks against the library in that order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures import float_checkpoints as fc
from fixtures.cli import cli

pytest.importorskip("compressed_tensors")
OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def library_weights(source: Path) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight as compressed-tensors' own ``decompress`` makes it from the tensors as stored,
    the layer's scheme found by the library's matching."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_targets

    quantization = json.loads((source / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(quantization)
    table = {target: scheme for scheme in config.config_groups.values() for target in scheme.targets}
    state = fc.read_state(source)
    with torch.device("meta"):
        layer = torch.nn.Linear(1, 1)
    made = {}
    for module in sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")}):
        scheme = table[match_targets(module, layer, table)[0]]
        parts = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == module}
        if "weight_shape" in parts:
            parts["weight_shape"] = parts["weight_shape"].tolist()
        compressor = BaseCompressor.get_value_from_registry(scheme.format or config.format)
        made[module + ".weight"] = compressor.decompress(parts, scheme)["weight"]
    return made


def _converted_as_the_library_decompresses(source: Path, out: Path, flag: str) -> int:
    """Convert ``source`` in ``flag`` and compare every decompressed weight with the library's, cast; verify says
    bit-exact. How many elements differ from the exact product rounded once to the output dtype."""
    dtype = OUT[flag]
    cli(source, "-o", out, "--dtype", flag, "-q", "--device", "cpu")
    ours = fc.read_state(out)
    library = library_weights(source)
    assert library
    for name, weight in library.items():
        want = weight.to(dtype)
        assert ours[name].dtype == dtype and torch.equal(ours[name].view(BITS[dtype]), want.view(BITS[dtype])), name
    assert "OK: bit-exact" in cli("verify", out, source, "-q", "--device", "cpu")
    return len(library)


@pytest.mark.parametrize("flag", ["fp16", "fp32"])
def test_nvfp4_fp8_and_int_groups_in_another_dtype_are_the_librarys(tmp_path, flag):
    from fixtures.nvfp4_checkpoints import build

    source = build(tmp_path / "tiny-NVFP4", "qwen3-ct-mixed")
    assert _converted_as_the_library_decompresses(source, tmp_path / "out", flag) > 3


def test_fp8_with_fp16_scales_in_bf16_is_the_librarys(tmp_path):
    from safetensors.torch import save_file

    source = fc.build_compressed(tmp_path / "tiny-FP8", "qwen3-ct-fp8-channel")
    state = fc.read_state(source)
    for name in [k for k in state if k.endswith(".weight_scale")]:
        state[name] = state[name].to(torch.float16)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        save_file({k: state[k] for k, v in index["weight_map"].items() if v == file}, source / file, {"format": "pt"})
    assert _converted_as_the_library_decompresses(source, tmp_path / "out", "bf16") > 3

"""The GGUF runs in llama.cpp's own runtime (the pinned llama.cpp's libllama, linked into a small harness in the same
cached build: tests/fixtures/llama_cpp.py): it loads, generates, and its logits for a prompt are transformers' on the
dense output of the same values.

- f32 and f16: transformers in float32 on this tool's dense output in that dtype (the same values): equal within float
  error. f32 within 1e-5 relative; f16 within 2e-3, since llama.cpp's CPU rounds the activations to f16 for an f16
  weight's dot products.
- llama-quantize's types: transformers on the bf16 dense output (the values they were quantized from), within a
  relative RMS error per type (``TOLERANCE``) about 1.5 times what the quantization error of these random weights
  gives at the pinned llama.cpp, which grows as the type's bits per weight shrink (llama.cpp also quantizes the
  activations to 8 bits for these dot products). A file whose blocks llama.cpp read wrongly would give logits
  uncorrelated with transformers': a relative error of about 1.4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.cli import invoke as cli
from fixtures.kquant_models import build_model
from fixtures.llama_cpp import LlamaCpp

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter

PROMPT = [1, 17, 200, 45, 301, 77, 12, 499, 250, 8, 99, 380, 5, 64, 130, 411]
VOCAB = 512
TOLERANCE = {  # relative RMS error of the logits against transformers' on the bf16 values
    "q8_0": 0.05,
    "q6_k": 0.08,
    "q5_k_m": 0.13,
    "q5_0": 0.3,
    "q4_k_m": 0.3,
    "q4_0": 0.5,
    "iq4_xs": 0.4,
    "iq4_nl": 0.4,
    "q3_k_m": 0.5,
    "q2_k": 0.8,
}


@pytest.fixture(scope="module")
def ref():
    return LlamaCpp.ready()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("runtime") / "llama-256-bnb-4bit", "llama-256", seed=11)


def _transformers(folder) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def _run(ref, source, tmp_path, gguf_type, dtype):
    dense, out = tmp_path / f"dense-{dtype}", tmp_path / f"x-{gguf_type}.gguf"
    cli(source, "-o", dense, "--dtype", dtype, "-q", "--device", "cpu")
    cli(source, "-o", out, "--gguf-type", gguf_type, "-q", "--device", "cpu")
    logits, generated = ref.logits(out, PROMPT, VOCAB, generate=8)
    assert len(generated) == 8 and all(0 <= token < VOCAB for token in generated)
    return logits, _transformers(dense)


@pytest.mark.parametrize(("gguf_type", "dtype", "tolerance"), [("f32", "fp32", 1e-5), ("f16", "fp16", 2e-3)])
def test_a_float_gguf_gives_transformers_logits(ref, source, tmp_path, gguf_type, dtype, tolerance):
    logits, want = _run(ref, source, tmp_path, gguf_type, dtype)
    assert _relative(logits, want) < tolerance


@pytest.mark.parametrize("gguf_type", TOLERANCE)
def test_a_quantized_gguf_runs_and_its_logits_are_close_to_transformers(ref, source, tmp_path, gguf_type):
    logits, want = _run(ref, source, tmp_path, gguf_type, "bf16")
    assert _relative(logits, want) < TOLERANCE[gguf_type]
    assert _relative(logits, want) > 1e-4  # quantized: not the float file by mistake

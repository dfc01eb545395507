"""Build small checkpoints of the other formats nf4convert reads, to try them without a download: GPTQ, AWQ,
compressed-tensors (integer and FP8), block FP8 and MXFP4 (gpt-oss's experts), each a few hundred KB of random
weights quantized as that format's own tools lay them out. They are the test suite's builders (tests/fixtures), so
this runs from a clone of the repository, on the CPU, with the test extra installed:

    python examples/make_format_examples.py [OUT]          # default OUT: ./format-examples
    nf4convert format-examples/gptq-4bit -o gptq-dense      # then convert (or verify) any of them
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# folder name: (builder module, function, variant)
EXAMPLES = {
    "gptq-4bit": ("int_checkpoints", "build", "gptq-llama-4bit-g32-v1-sym"),
    "awq-gemm": ("int_checkpoints", "build", "awq-llama-gemm-g32"),
    "compressed-tensors-w4a16": ("int_checkpoints", "build", "ct-llama-w4a16-g32-sym"),
    "compressed-tensors-fp8-block": ("float_checkpoints", "build_compressed", "qwen3-ct-fp8-block"),
    "fp8-block128": ("float_checkpoints", "build_fp8", "qwen3-fp8-block128-bf16"),
    "gpt-oss-mxfp4": ("float_checkpoints", "build_mxfp4", None),
}


def main(out: Path) -> None:
    import importlib

    for name, (module, function, variant) in EXAMPLES.items():
        build = getattr(importlib.import_module(f"fixtures.{module}"), function)
        folder = out / name
        build(folder, variant, seed=1) if variant is not None else build(folder, seed=1)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("format-examples"))

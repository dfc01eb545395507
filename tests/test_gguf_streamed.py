"""GGUF tensors streamed piece by piece: with pieces far smaller than any tensor (and cut off Q8_0's 32-value blocks),
every kind of tensor (plain copies, 4-bit and 8-bit dequantized, transposed, untied, merged with an adapter) streams
into the converter's bytes for bf16, f16 and q8_0; and a conversion's peak memory does not grow with the embedding and
the head, which are never whole."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nf4convert.dtypes import BY_NAME, DTYPES

from fixtures import checkpoints, checkpoints8
from fixtures.adapters import make_adapter
from fixtures.processes import package_env
from fixtures.trained_tokenizers import byte_bpe_tokenizer, sentencepiece_tokenizer, with_n_ctx

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
gguf = pytest.importorskip("gguf")

PIECE_BYTES = 1000  # 500 bf16 values a plain piece: its edges cut Q8_0 blocks
NESTED_BLOCK_BYTES = 64 * 256 * 4  # the least a double-quantized 4-bit piece holds (fp32 values at most)


def _llama(root: Path) -> tuple[Path, None]:
    source = checkpoints.build(root / "llama-bnb-4bit", "llama-nf4-dq", seed=21)
    sentencepiece_tokenizer(source)
    return source, None


def _llama_8bit(root: Path) -> tuple[Path, None]:
    source = checkpoints8.build(root / "llama-bnb-8bit", "llama-8bit-bf16", seed=22)
    sentencepiece_tokenizer(source)
    return source, None


def _gpt2(root: Path) -> tuple[Path, None]:
    source = checkpoints.build(root / "gpt2-bnb-4bit", "gpt2-conv1d-nf4-dq", seed=23)
    byte_bpe_tokenizer(source)
    with_n_ctx(source)
    return source, None


def _llama_adapter(root: Path) -> tuple[Path, Path]:
    source, _ = _llama(root)
    return source, make_adapter(root / "adapter", "linear", seed=25)


def _qwen2_tied_adapter(root: Path) -> tuple[Path, Path]:
    source = checkpoints.build(root / "qwen2-bnb-4bit", "qwen2-tied-fp4", seed=24)
    sentencepiece_tokenizer(source)
    return source, make_adapter(root / "adapter", "embeddings_to_save", seed=26, arch="qwen2")


# case -> (builder, the kinds of tensor it streams, the BPE pre-tokenizer name its tokenizer is given). GPT-2's
# Conv1D weights (our transposes) the converter transposes back: those are made whole, the rest streams.
CASES = {
    "4-bit and copies": (_llama, {"dequantize_4bit", "copy"}, None),
    "8-bit": (_llama_8bit, {"dequantize_8bit", "copy"}, None),
    "conv1d": (_gpt2, {"copy"}, "gpt-2"),
    "adapter": (_llama_adapter, {"merge_lora", "copy"}, None),
    "tied base, embeddings saved by an adapter": (_qwen2_tied_adapter, {"merge_lora", "untied"}, None),
}


def _write(plan, out: Path, gguf_type: str, *, fast: bool, piece_bytes: int | None = None, device: str = "cpu"):
    from nf4convert.pipeline.routes.base import route_for
    from nf4convert.pipeline.routes.cpu import CpuRoute
    from nf4convert.safetensors_io.read import TensorReader
    from nf4convert.sinks.gguf.sink import write_gguf

    route = CpuRoute(processes=0) if device == "cpu" else route_for(torch.device(device))
    with TensorReader() as reader, route:
        if piece_bytes is not None:
            route.piece_bytes = piece_bytes
        return write_gguf(plan, out, reader, route, gguf_type=gguf_type, name="model", card=None, fast=fast)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_streams_in_small_pieces_into_the_converters_bytes(case, device, tmp_path, monkeypatch):
    from conversion.base import TextModel

    from nf4convert.plan import make_plan
    from nf4convert.sinks.gguf import streamed

    build, kinds, pre_tokenizer = CASES[case]
    if pre_tokenizer is not None:
        monkeypatch.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: pre_tokenizer)
    source, adapter = build(tmp_path)
    pieces: dict[str, list[tuple[int, int]]] = {}
    write = streamed.StreamedTensor.write

    def recorded(self, name, data, offset):
        pieces.setdefault(name, []).append((offset, len(data)))
        return write(self, name, data, offset)

    monkeypatch.setattr(streamed.StreamedTensor, "write", recorded)
    for gguf_type in ("bf16", "f16", "q8_0"):
        dtype = {"bf16": BY_NAME["bfloat16"], "f16": BY_NAME["float16"], "q8_0": None}[gguf_type]
        plan = make_plan(source, dtype=dtype, adapter=adapter)
        planned = {tensor.name: tensor for tensor in plan.tensors}
        pieces.clear()
        expected = tmp_path / f"converter-{gguf_type}.gguf"
        _write(plan, expected, gguf_type, fast=False)  # the converter's own graph for every tensor, made whole
        assert not pieces
        ours = tmp_path / f"streamed-{gguf_type}.gguf"
        written = _write(plan, ours, gguf_type, fast=True, piece_bytes=PIECE_BYTES, device=device)
        assert ours.read_bytes() == expected.read_bytes(), gguf_type
        assert kinds <= {planned[name].recipe.kind for name in pieces}, gguf_type
        assert written.fast >= len(pieces) > 0
        for name, offsets in pieces.items():  # every byte once; a 4-bit piece is at least one nested block
            ends = sorted((offset, offset + size) for offset, size in offsets)
            assert ends[0][0] == 0 and ends[-1][1] == planned[name].nbytes, name
            assert all(end == start for (_, end), (start, _) in zip(ends, ends[1:])), name
            assert len(offsets) > 1 or planned[name].nbytes <= NESTED_BLOCK_BYTES, name
        if gguf_type == "q8_0":  # pieces whose edges cut a block were among them
            itemsize = {name: DTYPES[planned[name].dtype].itemsize for name in pieces}
            cut = [offset for name, offsets in pieces.items() for offset, _ in offsets if offset // itemsize[name] % 32]
            assert cut, "no piece cut a Q8_0 block"


def test_a_reordered_tensor_is_made_whole_and_the_rest_streams(tmp_path, monkeypatch):
    """The q/k permute reorders a weight's rows: those two are made whole, every other 2-D weight streams."""
    from nf4convert.plan import make_plan
    from nf4convert.sinks.gguf import fast as gguf_fast

    source, _ = _llama(tmp_path)
    plan = make_plan(source)
    made = []
    install = gguf_fast.FastTensor.__init__

    def noted(self, recognised, *args, **kwargs):
        made.append(recognised)
        install(self, recognised, *args, **kwargs)

    monkeypatch.setattr(gguf_fast.FastTensor, "__init__", noted)
    _write(plan, tmp_path / "x.gguf", "bf16", fast=True)
    whole = sorted(recognised.source for recognised in made if not recognised.streamed)
    layers = {int(m[1]) for name in whole if (m := re.search(r"layers\.(\d+)\.", name))}
    assert whole == sorted(
        f"model.layers.{layer}.self_attn.{projection}.weight" for layer in layers for projection in ("q_proj", "k_proj")
    )
    assert sum(recognised.streamed for recognised in made) == len(made) - len(whole) > len(whole)


def test_pieces_made_before_the_metadata_is_written_are_held_then_written(tmp_path, monkeypatch):
    """The converter's metadata (its tokenizer, the card) comes late: the first streamed pieces are held (a bounded
    amount), the next wait for it; the file is the same."""
    from conversion.base import ModelBase

    from nf4convert.plan import make_plan
    from nf4convert.sinks.gguf import streamed

    source, _ = _llama(tmp_path)
    plan = make_plan(source)
    expected = tmp_path / "expected.gguf"
    _write(plan, expected, "q8_0", fast=False)
    held, layout_set = [], streamed.Layout.set
    monkeypatch.setattr(streamed, "HELD_BYTES", 4000)
    monkeypatch.setattr(streamed.Layout, "set", lambda self, offsets: held.extend(layout_set(self, offsets)) or held)
    prepare_metadata = ModelBase.prepare_metadata

    def late(self, vocab_only):
        time.sleep(1.0)
        prepare_metadata(self, vocab_only)

    monkeypatch.setattr(ModelBase, "prepare_metadata", late)
    ours = tmp_path / "ours.gguf"
    _write(plan, ours, "q8_0", fast=True, piece_bytes=PIECE_BYTES)
    assert ours.read_bytes() == expected.read_bytes()
    assert held and sum(data.nbytes for _, data in held) <= 4000


# The peak of a conversion to GGUF in a process of its own, on two cores: VmHWM (ru_maxrss would start from pytest's)
MEMORY = """
import json, os, re, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
from nf4convert import convert
convert(sys.argv[1], sys.argv[2], gguf_type=sys.argv[3], device="cpu", progress=False)
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1])
print(json.dumps({"peak_mb": peak / 1024}))
"""


def _wide_model(folder: Path, vocab: int, hidden: int = 2048, seed: int = 0) -> Path:
    """A Llama of one layer whose embedding and head (``vocab`` x ``hidden``, bf16) are most of it, beside one
    4-bit weight (random packed bytes and absmax codes, positive nested absmax, bitsandbytes' own tables) and the
    layer's other weights, dense zeros."""
    import numpy as np
    from bitsandbytes.functional import create_dynamic_map
    from safetensors.torch import save_file

    from nf4convert.formats.bnb4 import CODES

    generator = np.random.default_rng(seed)
    rows, n = 256, 256 * hidden
    meta = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [rows, hidden],
            "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0312}  # fmt: skip
    name = "model.layers.0.mlp.up_proj.weight"
    values = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=values).to(torch.bfloat16),
        name: torch.from_numpy(generator.integers(0, 256, (n // 2, 1), dtype=np.uint8)),
        f"{name}.absmax": torch.from_numpy(generator.integers(0, 256, n // 64, dtype=np.uint8)),
        f"{name}.quant_map": torch.tensor(CODES["nf4"], dtype=torch.float32),
        f"{name}.nested_absmax": torch.from_numpy(generator.random(-(-n // 64 // 256), dtype=np.float32) * 0.05 + 1e-3),
        f"{name}.nested_quant_map": create_dynamic_map(signed=True).float(),
        f"{name}.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(vocab, hidden, generator=values).to(torch.bfloat16),
    }
    layer = "model.layers.0"  # the rest of the layer, dense and small beside the embedding: the model whole
    for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"{layer}.self_attn.{part}.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
    tensors[f"{layer}.mlp.gate_proj.weight"] = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    tensors[f"{layer}.mlp.down_proj.weight"] = torch.zeros(hidden, rows, dtype=torch.bfloat16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{layer}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": rows,
        "num_hidden_layers": 1, "num_attention_heads": hidden // 128, "num_key_value_heads": hidden // 128,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    sentencepiece_tokenizer(folder)
    return folder


@pytest.mark.parametrize("gguf_type", ["bf16", "q8_0"])
def test_memory_does_not_grow_with_the_embedding(gguf_type, tmp_path):
    # embedding and head of 8 MiB each against 128 MiB each: made whole, the larger would hold at least 240 MiB more
    peaks = {}
    for vocab in (2048, 32768):
        source = _wide_model(tmp_path / f"wide-{vocab}-bnb-4bit", vocab)
        out = tmp_path / f"wide-{vocab}.gguf"
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(MEMORY), str(source), str(out), gguf_type],
            capture_output=True,
            text=True,
            timeout=900,
            env=package_env(),
        )
        assert result.returncode == 0, result.stderr
        peaks[vocab] = json.loads(result.stdout.splitlines()[-1])["peak_mb"]
        reader = gguf.GGUFReader(out)
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        assert list(embedding.shape) == [2048, vocab]
        out.unlink()
    grown = peaks[32768] - peaks[2048]
    assert grown < 64, peaks


def test_metadata_is_packed_as_gguf_py_packs_it():
    """Every kind of field, arrays of every item type among them (a vocabulary's strings with multi-byte and empty
    ones, scores, types, bools, bytes), and arrays gguf-py refuses or packs itself: the same bytes, or its error."""
    import random

    from gguf import GGUFValueType as T
    from gguf.gguf_writer import GGUFValue, GGUFWriter

    from nf4convert.sinks.gguf.metadata import pack_field

    rng = random.Random(5)
    words = ["", "a", "é", "▁the", "\u4e2d\u6587", "<0x0A>", "\U0001f600"] + [
        f"t{rng.randrange(10**6)}" for _ in range(50)
    ]
    fields = {
        "s": GGUFValue("name é", T.STRING),
        "u32": GGUFValue(7, T.UINT32),
        "f32": GGUFValue(0.1, T.FLOAT32),
        "b": GGUFValue(True, T.BOOL),
        "i64": GGUFValue(-(2**40), T.INT64),
        "tokens": GGUFValue([rng.choice(words) for _ in range(3000)], T.ARRAY),
        "bytes-tokens": GGUFValue([w.encode() for w in words], T.ARRAY),
        "scores": GGUFValue([rng.uniform(-1e6, 1e6) for _ in range(3000)], T.ARRAY),
        "types": GGUFValue([rng.randrange(1, 7) for _ in range(3000)], T.ARRAY, T.INT32),
        "ints": GGUFValue([rng.randrange(-(2**31), 2**31) for _ in range(100)], T.ARRAY),
        "u8": GGUFValue(bytes(range(256)), T.ARRAY),
        "flags": GGUFValue([True, False, True], T.ARRAY),
        "u64s": GGUFValue([2**63 + 5, 3], T.ARRAY, T.UINT64),
        "nested": GGUFValue([[1, 2], [3]], T.ARRAY),
        "mixed": GGUFValue([1, "a"], T.ARRAY),
        "empty": GGUFValue([], T.ARRAY),
    }
    writer = GGUFWriter(None, "llama")
    for key, value in fields.items():
        try:
            want = writer._pack_val(key, T.STRING, add_vtype=False) + writer._pack_val(
                value.value, value.type, add_vtype=True, sub_type=value.sub_type
            )
        except ValueError as refused:
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                pack_field(writer, key, value)
            continue
        assert pack_field(writer, key, value) == want, key

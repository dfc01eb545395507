"""verify checks the output's files as transformers finds them, not only its tensors: a sharded output has its index,
mapping exactly its tensors to the files that hold them (with their total size), a single file is model.safetensors,
no other weight file stands beside them, and every file the conversion carries over is there with the source's bytes.

Each case edits a copy of an output that verifies OK, so a failure can only come from the edit."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.errors import ArgumentError, CheckpointError
from nf4convert.verification.verify import verify

from fixtures.checkpoints import build

INDEX = "model.safetensors.index.json"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A 4-bit source with files to carry (one in a subfolder), converted sharded and into one file; both verify OK."""
    root = tmp_path_factory.mktemp("verify-extra")
    source = build(root / "src-bnb-4bit", "llama-nf4-dq", seed=21)
    (source / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    (source / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (source / "extra").mkdir()
    (source / "extra" / "notes.txt").write_text("kept as is\n")
    outputs = {}
    for layout, size in (("sharded", "200KB"), ("single", "5GB")):
        outputs[layout] = root / layout
        run(source, "-o", outputs[layout], "-q", "--device", "cpu", "--max-shard-size", size)
        assert "OK: bit-exact" in run("verify", outputs[layout], source, "-q", "--device", "cpu")
    assert (
        len(list(outputs["sharded"].glob("model-*-of-*.safetensors"))) >= 3 and (outputs["sharded"] / INDEX).is_file()
    )
    assert [p.name for p in outputs["single"].glob("*.safetensors*")] == ["model.safetensors"]
    return source, outputs


def problems(output, source) -> list[str]:
    report = verify(output, str(source), device="cpu")
    assert report.checked > 0
    return report.problems


def copy_of(converted, layout, tmp_path):
    source, outputs = converted
    out = tmp_path / layout
    shutil.copytree(outputs[layout], out, symlinks=True)
    return source, out


def edit_index(out, edit):
    index = json.loads((out / INDEX).read_text())
    edit(index)
    (out / INDEX).write_text(json.dumps(index))


def test_a_sharded_output_without_its_index_fails(converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    shards = len(list(out.glob("*.safetensors")))
    (out / INDEX).unlink()
    assert problems(out, source) == [
        f"{INDEX}: missing; transformers loads none of the output's {shards} shards without it"
    ]
    output = run("verify", out, source, "-q", "--device", "cpu", code=1)
    assert f"MISMATCH {INDEX}: missing" in output and "FAILED: 1 problem" in output


def test_an_index_under_another_name_fails(converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    (out / INDEX).rename(out / "weights.safetensors.index.json")
    assert problems(out, source) == [
        f"{INDEX}: missing (the output's index is named weights.safetensors.index.json, "
        "which transformers does not look for)"
    ]


@pytest.mark.parametrize("case", ["total-size", "no-total-size", "no-metadata"])
def test_the_index_metadata_is_checked(case, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    if case == "total-size":
        edit_index(out, lambda index: index["metadata"].update(total_size=total + 2))
        expected = f"{INDEX}: metadata.total_size is {total + 2}, the shards hold {total} bytes of tensors"
    elif case == "no-total-size":
        edit_index(out, lambda index: index["metadata"].pop("total_size"))
        expected = f"{INDEX}: metadata.total_size is None, the shards hold {total} bytes of tensors"
    else:
        edit_index(out, lambda index: index.pop("metadata"))
        expected = f"{INDEX}: no 'metadata' object (transformers' loader reads it)"
    assert problems(out, source) == [expected]


@pytest.mark.parametrize("case", ["left-out", "wrong-file"])
def test_an_index_that_does_not_map_the_output_exactly_is_refused(case, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    name, file = sorted(weight_map.items())[0]
    other = next(f for f in sorted(set(weight_map.values())) if f != file)
    if case == "left-out":
        edit_index(out, lambda index: index["weight_map"].pop(name))
        words = f"{out / file}: holds tensor '{name}', which the index does not list"
    else:
        edit_index(out, lambda index: index["weight_map"].update({name: other}))
        words = f"{out / file}: holds tensor '{name}', which the index lists under '{other}'"
    with pytest.raises(CheckpointError) as caught:
        verify(out, str(source), device="cpu")
    assert str(caught.value) == words
    result = CliRunner().invoke(main, ["verify", str(out), str(source), "-q", "--device", "cpu"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [f"Error: {words}"], result.output


@pytest.mark.parametrize("stray", ["model.safetensors", "extra.safetensors"])
def test_another_weight_file_beside_the_shards_fails(stray, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    shutil.copy(next(out.glob("model-*.safetensors")), out / stray)
    expected = {
        "model.safetensors": "model.safetensors: beside the index; transformers loads it and ignores the shards",
        "extra.safetensors": "extra.safetensors: a .safetensors file the index does not name",
    }[stray]
    assert problems(out, source) == [expected]


def test_a_single_file_output_must_be_named_model_safetensors(converted, tmp_path):
    source, out = copy_of(converted, "single", tmp_path)
    (out / "model.safetensors").rename(out / "weights.safetensors")
    assert problems(out, source) == [
        "weights.safetensors: a single-file output must be named model.safetensors "
        "(the only name transformers looks for)"
    ]


@pytest.mark.parametrize("layout", ["sharded", "single"])
@pytest.mark.parametrize(
    "file",
    ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "extra/notes.txt"],
)
@pytest.mark.parametrize("how", ["missing", "changed"])
def test_every_carried_file_must_be_there_with_the_source_bytes(layout, file, how, converted, tmp_path):
    source, out = copy_of(converted, layout, tmp_path)
    if how == "missing":
        (out / file).unlink()
        expected = f"{file}: carried over from the source, missing from the output"
    else:  # the same size, one byte changed: compared by content, not by size or time
        data = bytearray((out / file).read_bytes())
        data[len(data) // 2] ^= 0x20
        (out / file).write_bytes(bytes(data))
        expected = f"{file}: differs from the source's"
    assert problems(out, source) == [expected]


def test_the_model_card_is_not_compared(converted, tmp_path):
    """README.md is written anew (the source's card made true for the dense model): not a carried file."""
    source, out = copy_of(converted, "sharded", tmp_path)
    assert (out / "README.md").read_text() != (source / "README.md").read_text()
    (out / "README.md").write_text("# another card\n")
    assert problems(out, source) == []


@pytest.mark.parametrize("stray", ["adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin"])
def test_files_no_conversion_writes_fail(stray, converted, tmp_path):
    # an adapter's files make transformers load the base they name plus the adapter; a .bin is another copy of weights
    source, out = copy_of(converted, "single", tmp_path)
    (out / stray).write_text("{}")
    found = problems(out, source)
    assert any(p.startswith(f"{stray}: in the output, but no conversion writes it") for p in found), found


@pytest.mark.parametrize("edit", [("num_hidden_layers", 2.0), ("tie_word_embeddings", 0), ("vocab_size", None)])
def test_config_values_are_compared_as_json_not_as_python(converted, tmp_path, edit):
    # 2 == 2.0 and False == 0 in Python; transformers refuses a float layer count or an int tie_word_embeddings
    source, out = copy_of(converted, "single", tmp_path)
    config = json.loads((out / "config.json").read_text())
    key, value = edit
    config[key] = float(config[key]) if value is None else value
    (out / "config.json").write_text(json.dumps(config))
    assert problems(out, source) == [f"config.json: differs from the source's made dense (in {key})"]


@pytest.mark.parametrize("text", ["[]", "null", "5", '"s"'])
def test_a_config_that_is_json_but_not_an_object_is_a_finding(converted, tmp_path, text):
    source, out = copy_of(converted, "single", tmp_path)
    (out / "config.json").write_text(text)
    kind = type(json.loads(text)).__name__
    assert problems(out, source) == [f"config.json: not a JSON object (a {kind})"]
    output = run("verify", out, source, "-q", "--device", "cpu", code=1)
    assert "Traceback" not in output and "FAILED: 1 problem" in output


def test_an_output_config_for_a_source_without_one_is_a_finding(converted, tmp_path):
    # a bitsandbytes config.json dropped in would make transformers load the dense weights as 4-bit ones
    source, out = copy_of(converted, "single", tmp_path)
    bare = tmp_path / "bare-bnb-4bit"
    shutil.copytree(source, bare)
    (bare / "config.json").unlink()
    run(bare, "-o", tmp_path / "bare-out", "-q", "--device", "cpu", "--allow-no-config")
    assert not (tmp_path / "bare-out" / "config.json").exists() and problems(tmp_path / "bare-out", bare) == []
    shutil.copy(source / "config.json", tmp_path / "bare-out" / "config.json")
    assert problems(tmp_path / "bare-out", bare) == [
        "config.json: in the output, but the source has none (a conversion writes none)"
    ]


def test_files_the_source_never_had_are_findings(converted, tmp_path):
    # a generation_config.json, a chat template or remote code changes what the loaded model does
    source, out = copy_of(converted, "sharded", tmp_path)
    (out / "processor_config.json").write_text("{}")
    (out / "extra" / "modeling_evil.py").write_text("import os\n")
    (out / "sub").mkdir()
    (out / "sub" / "model.safetensors").write_bytes(b"x")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # git's own: not a finding
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    never = "in the output, but not in the source, and a conversion writes no such file"
    assert problems(out, source) == [
        f"extra/modeling_evil.py: {never}",
        f"processor_config.json: {never}",
        f"sub/model.safetensors: {never}",
    ]


def test_links_in_the_output_are_findings(converted, tmp_path):
    # OUT must be self-contained: a link changes with (or breaks with) what it points to
    source, out = copy_of(converted, "single", tmp_path)
    outside = tmp_path / "outside-config.json"
    shutil.copy(out / "config.json", outside)
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(outside)
    (out / "generation_config.json").unlink()
    (out / "generation_config.json").symlink_to(source / "generation_config.json")
    found = problems(out, source)
    assert found == [
        f"config.json: a link (to {outside}); a conversion writes files, and the output would change with what the "
        "link points to",
        f"generation_config.json: a link (to {source / 'generation_config.json'}); a conversion writes files, and the "
        "output would change with what the link points to",
    ]


@pytest.mark.parametrize("metadata", [{"format": "tf"}, {"format": "garbage"}, {}, None])
def test_the_shards_metadata_is_what_a_conversion_writes(converted, tmp_path, metadata):
    # transformers 4.x refuses a format other than pt, tf and flax, and loads tf or flax through those frameworks
    import struct

    source, out = copy_of(converted, "single", tmp_path)
    path = out / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if metadata is None:
        del header["__metadata__"]
    else:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    assert problems(out, source) == [
        f'model.safetensors: __metadata__ is {json.dumps(metadata or {})}, a conversion writes {{"format": "pt"}}'
    ]


def test_a_total_size_that_is_not_an_integer_is_a_finding(converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    edit_index(out, lambda index: index["metadata"].update(total_size=float(index["metadata"]["total_size"])))
    assert len(problems(out, source)) == 1 and "metadata.total_size is" in problems(out, source)[0]


def test_a_quant_state_shape_the_model_does_not_load_is_a_finding(tmp_path, monkeypatch):
    # the quant state's recorded shape decides the output's; a flattened one would verify bit-exact, but transformers
    # cannot load it: convert refuses it, and of an output written so all the same verify asks transformers' model
    # what shape it loads there
    import struct

    from nf4convert import plan

    source = build(tmp_path / "flat-bnb-4bit", "llama-nf4-dq", seed=5)
    name = "model.layers.1.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"
    path = source / json.loads((source / INDEX).read_text())["weight_map"][name]
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    begin, end = header[name]["data_offsets"]
    start = 8 + length + begin
    state = json.loads(bytes(data[start : 8 + length + end]))
    rows, columns = state["shape"]
    flat = json.dumps({**state, "shape": [rows * columns]}).encode()
    flat += b" " * (end - begin - len(flat))  # the same byte count: the header stays as it is
    assert len(flat) == end - begin
    data[start : 8 + length + end] = flat
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    refused = CliRunner().invoke(main, [str(source), "-o", str(out), "-q", "--device", "cpu"])
    assert refused.exit_code == 1 and "the checkpoint does not fit the model of its config.json" in refused.output
    assert f"q_proj.weight: [{rows * columns}] from the checkpoint" in refused.output and not out.exists()
    monkeypatch.setattr(plan, "check_fits", lambda *args: None)
    run(source, "-o", out, "-q", "--device", "cpu")
    assert problems(out, source) == [
        f"model.layers.1.self_attn.q_proj.weight: [{rows * columns}] from the source, transformers' model "
        f"loads [{rows}, {columns}] there"
    ]


def test_verify_without_its_reference_libraries_is_one_error_not_a_list_of_mismatches(converted, monkeypatch):
    # a missing bitsandbytes (or peft for an adapter) says nothing about the weights
    import sys

    from nf4convert.errors import DependencyError

    source, outputs = converted
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(
        DependencyError,
        match=r"^verify recomputes the weights \(bitsandbytes' dequantization\) with bitsandbytes, "
        r"which cannot be imported \(ModuleNotFoundError: .*\); install it: pip install bitsandbytes$",
    ):
        verify(outputs["single"], str(source), device="cpu")
    result = CliRunner().invoke(main, ["verify", str(outputs["single"]), str(source), "--device", "cpu", "-q"])
    assert (
        result.exit_code == 1
        and result.output.count("\n") == 1
        and result.output.startswith("Error: verify recomputes")
    )


def test_verify_leaves_the_loggers_as_it_found_them(converted):
    import logging

    source, outputs = converted
    loggers = [logging.getLogger(name) for name in ("peft", "bitsandbytes.backends.cpu.ops")]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    assert verify(outputs["single"], str(source), device="cpu").ok
    assert [logger.level for logger in loggers] == [logging.INFO, logging.INFO]


def test_verify_builds_the_layer_the_model_has_whatever_the_adapter_holds():
    # verify's stand-in layer came from the adapter's kind of LoRA tensors: linear-style tensors on an embedding that
    # convert cannot know by name (openai-gpt's tokens_embed) stood in a Linear, so peft merged them as convert did,
    # where peft on the real model (an Embedding LoRA layer) loads none of them
    from types import SimpleNamespace

    import torch

    from nf4convert.verification.reference.merge_lora import _skeleton_module

    info = lambda *shape: SimpleNamespace(shape=shape)  # noqa: E731
    linear = SimpleNamespace(
        module="transformer.tokens_embed", kind="linear", tensors={"lora_A": info(4, 64), "lora_B": info(40, 4)}
    )
    adapter = SimpleNamespace(targets={"transformer.tokens_embed.weight": linear})
    weight = torch.zeros(40, 64)
    references = {"transformer.tokens_embed.weight": weight}
    layer = _skeleton_module("transformer.tokens_embed", adapter, "cpu", torch.float32, references, torch.nn.Embedding)
    assert type(layer) is torch.nn.Embedding and tuple(layer.weight.shape) == (40, 64)
    layer = _skeleton_module("transformer.tokens_embed", adapter, "cpu", torch.float32, references, None)  # no model
    assert type(layer) is torch.nn.Linear
    layer = _skeleton_module(
        "transformer.tokens_embed", adapter, "cpu", torch.float32, {}, torch.nn.Embedding
    )  # no weight
    assert type(layer) is torch.nn.Embedding and tuple(layer.weight.shape) == (40, 64)
    embedding = SimpleNamespace(
        module="h.0.q", kind="embedding", tensors={"lora_embedding_A": info(4, 40), "lora_embedding_B": info(64, 4)}
    )
    adapter = SimpleNamespace(targets={"h.0.q.weight": embedding})
    layer = _skeleton_module("h.0.q", adapter, "cpu", torch.float32, {"h.0.q.weight": weight}, torch.nn.Linear)
    assert type(layer) is torch.nn.Linear and (layer.in_features, layer.out_features) == (64, 40)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_nans_in_a_cast_plain_tensor_are_canonical_and_verify_ok(tmp_path, dtype):
    # A plain tensor holding NaNs (payloads of all kinds), cast to another dtype: each becomes CUDA's canonical NaN
    # on the CPU route (torch's NaN bits depend on the CPU), and verify's reference says the same
    import torch
    from safetensors.torch import load_file, save_file

    source = build(tmp_path / "src-bnb-4bit", "llama-nf4-dq", seed=22)
    shard = next(p for p in sorted(source.glob("*.safetensors")) if any("norm" in k for k in load_file(p)))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("norm.weight") and tensors[k].dtype == torch.bfloat16)
    bits = tensors[name].clone().view(torch.int16)
    bits[:4] = torch.tensor([0x7FC0, -0x0040, 0x7F81, 0x7FFF], dtype=torch.int16)  # quiet, negative, signalling, max
    tensors[name] = bits.view(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    run(source, "-o", out, "-q", "--device", "cpu", "--dtype", dtype)
    written = next(load_file(p)[name] for p in out.glob("*.safetensors") if name in load_file(p))
    integer = {"fp16": torch.int16, "fp32": torch.int32}[dtype]
    assert written[:4].view(integer).tolist() == [0x7FFF if dtype == "fp16" else 0x7FFFFFFF] * 4
    assert not written[4:].isnan().any()
    assert "OK: bit-exact" in run("verify", out, source, "-q", "--device", "cpu")


def test_dtype_is_a_gguf_option_and_a_folder_refuses_another_than_its_own(converted):
    """verify's dtype says what a GGUF's tensors were made in; a folder's tensors say theirs: another is refused in one
    line, before anything is recomputed, and its own is what verify uses anyway."""
    source, outputs = converted
    result = CliRunner().invoke(main, ["verify", str(outputs["single"]), str(source), "--dtype", "fp16", "-q"])
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == (
        f"Error: {outputs['single']}: its tensors are bfloat16, not float16 (dtype is a GGUF's: the dtype its tensors "
        "were made in; a folder's tensors say their own) (see --dtype)\n"
    )
    assert "OK: bit-exact" in run("verify", outputs["single"], source, "--dtype", "bf16", "-q", "--device", "cpu")
    with pytest.raises(ArgumentError, match=r"its tensors are bfloat16, not float32 \(dtype is a GGUF's"):
        verify(outputs["sharded"], str(source), device="cpu", dtype="fp32")

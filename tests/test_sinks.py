"""The sinks' registry: which output the options ask for, each sink's own options checked, and an output format added by
one module (here, a scratch sink defined in this file) that the conversion then writes through, with nothing else
changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nf4convert.dtypes import output_dtype
from nf4convert.errors import ArgumentError
from nf4convert.options import ConvertOptions
from nf4convert.pipeline.core import Pipeline
from nf4convert.sinks import base as sinks
from nf4convert.sinks import output as lifecycle

from fixtures.checkpoints import build


@pytest.mark.parametrize(
    ("given", "chosen"),
    [
        (dict(), "safetensors"),
        (dict(output="out"), "safetensors"),
        (dict(output="out.GGUF"), "gguf"),
        (dict(gguf_type="q8_0"), "gguf"),
        (dict(output="x.gguf", gguf_type="BF16"), "gguf"),
    ],
)
def test_the_options_choose_the_sink(given, chosen):
    assert sinks.sink_for(ConvertOptions.parse(**given)).name == chosen


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(output="out", gguf_type="q8_0"), "gguf_type 'q8_0' writes one GGUF file: give an output ending in .gguf"),
        (dict(output="x.gguf", gguf_type="q4_k"), "GGUF type 'q4_k' is not one of f32, f16, bf16, q8_0"),
    ],
)
def test_a_sink_checks_the_options_it_owns(given, message):
    with pytest.raises(ArgumentError, match=message) as refused:
        sinks.sink_for(ConvertOptions.parse(**given))
    assert refused.value.option == "gguf_type"


class _Raw:
    """One file of every tensor's bytes, one after another in plan order: the writer the pipeline writes pieces
    through (``write(name, data, offset)``, offsets within each tensor)."""

    def __init__(self, path: Path, plan):
        self.descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.starts, start = {}, 0
        for tensor in plan.tensors:
            self.starts[tensor.name] = start
            start += tensor.nbytes

    def write(self, name, data, offset):
        from nf4convert.safetensors_io.read import as_array

        os.pwrite(self.descriptor, memoryview(as_array(data).reshape(-1)), self.starts[name] + offset)


@pytest.fixture
def raw_sink():
    """A scratch output format, registered as any sink module registers its class, and unregistered after."""

    @sinks.register
    class RawFile(sinks.Sink):
        name = "raw"
        file = True

        @classmethod
        def claims(cls, options) -> bool:
            return options.output is not None and options.output.suffix == ".raw"

        def default_output(self, output_dir, stem):
            return Path(output_dir or ".") / f"{stem}.raw"

        def size_bound(self):
            return self.plan.tensor_bytes

        def what(self, planned=False):
            return f"raw {self.plan.dtype.name}"

        def label(self):
            return "raw"

        def write(self, staging, output, reader, route, *, card, settings, progress, tensor_done):
            raw = _Raw(staging / output.name, self.plan)
            try:
                with Pipeline(route, reader, progress, writers=2) as pipeline:
                    for tensor in self.plan.tensors:
                        for piece in tensor.recipe.produce(tensor, reader, route):
                            pipeline.push(raw, tensor.name, piece)
                    pipeline.drain()
            finally:
                os.close(raw.descriptor)
            return sinks.Written(len(self.plan.tensors))

        def place(self, staging, output, *, overwrite):
            lifecycle.move_file_into_place(staging, output, overwrite=overwrite)
            return output.stat().st_size

    yield RawFile
    del sinks.SINKS[RawFile.name]


def test_an_output_format_is_one_module_registered(raw_sink, tmp_path):
    from nf4convert import convert

    source = build(tmp_path / "llama-bnb-4bit", "llama-nf4-dq", seed=7)
    dense = convert(source, tmp_path / "dense", device="cpu", progress=False)
    made = convert(source, tmp_path / "x.raw", device="cpu", progress=False)
    assert made.sink == "raw" and made.made == "raw bfloat16"
    expected = {}
    for shard in sorted(dense.output.glob("*.safetensors")):
        expected.update(load_file(shard))
    from nf4convert.plan import make_plan

    plan = make_plan(source, dtype=output_dtype("bf16"))
    raw = (tmp_path / "x.raw").read_bytes()
    start = 0
    for tensor in plan.tensors:
        got = raw[start : start + tensor.nbytes]
        assert got == expected[tensor.name].contiguous().view(torch.uint8).numpy().tobytes(), tensor.name
        start += tensor.nbytes
    assert start == len(raw)

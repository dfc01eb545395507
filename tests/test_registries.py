"""The registries: source formats and tensor kinds register where they are defined and the planner, the routes and
verify find them there. A format and a kind defined in a test alone are planned and converted; every registered kind
has its reference; routes have no method of their own for any format; what the rest asks of all formats at once
means what it meant when bitsandbytes was assumed."""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nf4convert.dtypes import output_dtype
from nf4convert.errors import CheckpointError
from nf4convert.formats import base as formats_base
from nf4convert.formats.base import SourceFormat, all_formats
from nf4convert.kinds import base as kinds_base
from nf4convert.kinds.base import Planning, Recipe, all_kinds
from nf4convert.pipeline.piece import Piece
from nf4convert.pipeline.routes import base as routes_base
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.pipeline.routes.cuda import CudaRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.sinks.safetensors import write_shards
from nf4convert.verification.reference.base import reference_for

from fixtures.processes import package_env

# --- a format and a kind that exist in this file alone ------------------------------------------------------------


class Scaled(SourceFormat):
    """Int8 codes ``X.qweight`` [rows, columns] with one fp32 scale per row ``X.qscale``: ``X.weight`` is their
    product."""

    name: ClassVar[str] = "scratch-scaled"
    family: ClassVar[str] = "scratch"
    title: ClassVar[str] = "scratch scaled int8"
    quant_methods: ClassVar[tuple[str, ...]] = ("scratch",)
    name_suffix: ClassVar[str] = r"scaled"
    plan_reads: ClassVar[re.Pattern] = re.compile(r"\.qscale$")
    marks: ClassVar[str] = "a scratch scale"

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.endswith((".qweight", ".qscale"))

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        return "Every scratch weight is its codes times its row's scale."


def _scaled_on_host(codes, out, *, scales, columns: int) -> None:
    rows = codes.size // columns
    product = codes.view(np.int8).reshape(rows, columns).astype(np.float32) * scales[:, None]
    out.view(np.float32)[:] = product.reshape(-1)


def _scaled_kind():
    """The kind of Scaled weights, made when the registry it joins is a scratch copy."""

    @kinds_base.register
    @dataclass(frozen=True)
    class ScratchScaled(Recipe):
        kind: ClassVar[str] = "scratch_scaled"
        label: ClassVar[str] = "scaled from scratch int8"
        format: ClassVar[type[SourceFormat]] = Scaled
        order: ClassVar[int] = 15
        is_quantized: ClassVar[bool] = True
        codes: object
        scales: object

        @classmethod
        def plan_source(cls, planning: Planning) -> None:
            claimed = {}
            for name, info in planning.tensors.items():
                if name.endswith(".qweight"):
                    claimed[name] = cls(info, planning.tensors[name.removesuffix("qweight") + "qscale"])
            planning.claim(claimed)

        @property
        def sources(self) -> tuple:
            return (self.codes, self.scales)

        def output(self, dtype):
            return self.codes.name.removesuffix("qweight") + "weight", dtype.code, self.codes.shape

        def exceeds_fp16(self) -> bool:
            return True

        @property
        def source_format(self) -> str:
            return self.format.name

        def produce(self, tensor, reader, route):
            assert tensor.dtype == "F32", "the scratch kind writes fp32 only"
            rows, columns = self.codes.shape
            scales = reader.array(self.scales).view(np.float32)  # bytes as read
            step = max(1, route.piece_bytes // (4 * columns))
            for first in range(0, rows, step):
                count = min(step, rows - first)
                host = functools.partial(_scaled_on_host, scales=scales[first : first + count], columns=columns)
                yield Piece(
                    first * columns * 4, count * columns * 4, self.codes, first * columns, count * columns,
                    route.make(host), on_device=True,
                )  # fmt: skip

    return ScratchScaled


@pytest.fixture
def scratch():
    """Scaled and its kind registered; the registries as they were once the test ends."""
    kept = (formats_base._REGISTRY, kinds_base._REGISTRY)
    registries = [(registry, dict(registry.discovered())) for registry in kept]
    formats_base.register(Scaled)
    try:
        yield _scaled_kind()
    finally:
        for registry, saved in registries:
            registry.clear()
            registry.update(saved)


def _scaled_checkpoint(folder, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for index, (rows, columns) in enumerate([(37, 129), (5, 1031), (64, 3)]):
        codes = torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=generator)
        scales = torch.rand(rows, generator=generator) * 5 + 1e-3
        tensors[f"layers.{index}.qweight"], tensors[f"layers.{index}.qscale"] = codes, scales
        expected[f"layers.{index}.weight"] = codes.float() * scales[:, None]
    tensors["norm.weight"] = torch.randn(77, generator=generator).bfloat16()
    expected["norm.weight"] = tensors["norm.weight"].float()
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "scratch"}}))
    return expected


class SmallPieces(CpuRoute):
    piece_bytes = 4096  # several pieces per weight


@pytest.mark.parametrize("processes", [0, 2])
def test_a_format_and_kind_defined_in_a_test_alone_are_planned_and_converted(tmp_path, scratch, processes):
    expected = _scaled_checkpoint(tmp_path / "src", seed=processes + 1)
    plan = make_plan(tmp_path / "src", dtype=output_dtype("fp32"))
    kinds = {tensor.name: tensor.recipe.kind for tensor in plan.tensors}
    assert kinds == {**dict.fromkeys([f"layers.{i}.weight" for i in range(3)], scratch.kind), "norm.weight": "copy"}
    assert plan.source_formats == ["scratch-scaled"] and plan.n_dequantized == 3
    (tmp_path / "out").mkdir()
    with TensorReader() as reader, SmallPieces(processes=processes) as route:
        write_shards(plan, tmp_path / "out", reader, route, progress=lambda n: None)
        if processes:
            assert route._workers._handed > 0  # its pieces were made in the worker processes
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as file:
        assert sorted(file.keys()) == sorted(expected)
        for name, want in expected.items():
            got = file.get_tensor(name)
            assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def test_what_is_asked_of_all_formats_takes_in_a_format_defined_in_a_test(tmp_path, scratch):
    assert formats_base.families() == "AWQ, bitsandbytes, compressed-tensors, FP8, GPTQ, ModelOpt, MXFP4 or scratch"
    assert formats_base.config_reason({"quantization_config": {"quant_method": "scratch"}}) is None
    assert formats_base.quantization_key("layers.0.qscale") is Scaled
    assert formats_base.plan_reads().search("layers.0.qscale")
    assert formats_base.name_suffix().sub("", "org/Llama-Scaled") == "org/Llama"
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file({"norm.weight": torch.ones(3)}, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        make_plan(folder)
    assert str(refused.value) == (
        f"{folder}: no quantized weights of a format nf4convert reads (AWQ, bitsandbytes, compressed-tensors, FP8, "
        "GPTQ, ModelOpt, MXFP4 or scratch): nothing to convert"
    )


def test_a_weight_two_formats_claim_is_refused_naming_both(tmp_path, scratch):
    # An 8-bit weight that a second scratch kind, planned after the 8-bit one, claims too.
    @kinds_base.register
    @dataclass(frozen=True)
    class Greedy(scratch):
        kind: ClassVar[str] = "scratch_greedy"
        order: ClassVar[int] = 30

        @classmethod
        def plan_source(cls, planning: Planning) -> None:
            planning.claim({"x.weight": cls(planning.tensors["x.weight"], planning.tensors["x.qscale"])})

    folder = tmp_path / "src"
    folder.mkdir()
    tensors = {"x.weight": torch.randint(-128, 128, (4, 8), dtype=torch.int8), "x.SCB": torch.ones(4)}
    tensors["x.qscale"] = torch.ones(4)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        make_plan(folder)
    assert str(refused.value) == (
        f"{folder / 'model.safetensors'}: tensor 'x.weight' has both an 8-bit SCB and a scratch scale; "
        "it is one or the other"
    )


def test_a_wrapping_kind_defined_in_a_test_alone_changes_the_outputs_config_and_files(tmp_path, scratch):
    """What a kind changes beside the tensors (config.json, the files carried or added) is its own hooks' to say: the
    plan, the folder's side files and verify's audit take them in without naming the kind."""
    from nf4convert.sinks.side_files import write_side_files
    from nf4convert.verification import audit

    _scaled_checkpoint(tmp_path / "src", seed=5)
    (tmp_path / "src" / "config.json").write_text(
        json.dumps({"model_type": "scratch", "quantization_config": {"quant_method": "scratch"}})
    )
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    notice = tmp_path / "notes" / "NOTICE.txt"
    notice.parent.mkdir()
    notice.write_text("scratch notes\n")

    @kinds_base.register
    @dataclass(frozen=True)
    class Noted(Recipe):
        kind: ClassVar[str] = "scratch_noted"
        label: ClassVar[str] = "noted"
        order: ClassVar[int] = 150
        base: Recipe

        @classmethod
        def plan_output(cls, planning: Planning) -> None:
            planning.recipes = {
                anchor: cls(recipe) if recipe.kind == scratch.kind else recipe
                for anchor, recipe in planning.recipes.items()
            }

        @classmethod
        def plan_config(cls, planning: Planning, config: dict) -> dict:
            return {**config, "noted": planning.dtype.short}

        @classmethod
        def plan_files(cls, planning: Planning, files: kinds_base.SideFiles) -> kinds_base.SideFiles:
            added = {Path("NOTICE.txt"): kinds_base.Added(notice, "the notes' file", "the notes'")}
            return kinds_base.SideFiles([], {**files.added, **added})  # the source's tokenizer not carried

        @property
        def sources(self) -> tuple:
            return self.base.sources

        def output(self, dtype):
            return self.base.output(dtype)

    plan = make_plan(tmp_path / "src", dtype=output_dtype("fp32"))
    assert sorted({tensor.recipe.kind for tensor in plan.tensors}) == ["copy", "scratch_noted"]
    assert plan.config["noted"] == "fp32" and "quantization_config" not in plan.config
    assert plan.side_files == [] and list(plan.added_files) == [Path("NOTICE.txt")]
    assert plan.side_bytes == len("scratch notes\n") and plan.merged is None
    out = tmp_path / "out"
    out.mkdir()
    write_side_files(plan, out)
    assert (out / "NOTICE.txt").read_text() == "scratch notes\n" and json.loads((out / "config.json").read_text()) == {
        **plan.config
    }
    assert audit.carried_problems(plan, out) == [] and audit.unexpected_files(plan, out, {}) == []
    (out / "NOTICE.txt").write_text("other notes\n")
    (out / "tokenizer.json").write_text("{}")
    assert audit.carried_problems(plan, out) == ["NOTICE.txt: differs from the notes'"]
    assert [line.split(":")[0] for line in audit.unexpected_files(plan, out, {})] == ["tokenizer.json"]
    (out / "NOTICE.txt").unlink()
    assert audit.carried_problems(plan, out) == ["NOTICE.txt: the notes' file, missing from the output"]


def test_a_kind_of_output_defined_in_a_test_alone_is_the_one_verify_checks(tmp_path):
    from nf4convert.errors import ArgumentError
    from nf4convert.verification import outputs
    from nf4convert.verification.verify import verify

    saved = dict(outputs.OUTPUTS.discovered())
    try:

        @outputs.register
        class Scratch(outputs.Output):
            name = "scratch"

            @staticmethod
            def claims(output: str) -> bool:
                return output.endswith(".scratch")

            def __init__(self, output: Path):
                raise ArgumentError(f"{output}: a scratch output, checked by its own kind")

        assert outputs.output_for("model.gguf").name == "gguf" and outputs.output_for("model").name == "folder"
        with pytest.raises(ArgumentError, match=r"x\.scratch: a scratch output, checked by its own kind"):
            verify(tmp_path / "x.scratch", str(tmp_path / "source"))
    finally:
        outputs.OUTPUTS.clear()
        outputs.OUTPUTS.update(saved)
    assert set(outputs.OUTPUTS.discovered()) == {"folder", "gguf"}


def test_the_registries_hold_what_is_defined_and_nothing_after_a_scratch_test():
    assert list(all_formats()) == [
        "awq",
        "bnb-4bit",
        "bnb-8bit",
        "compressed-int",
        "compressed-tensors-fp8",
        "compressed-tensors-nvfp4",
        "deepseek-v4-fp4",
        "fp8",
        "gptq",
        "modelopt-fp8",
        "modelopt-nvfp4",
        "mxfp4",
    ]
    assert set(all_kinds()) == {
        "copy", "dequantize_4bit", "dequantize_8bit", "dequantize_gptq", "dequantize_awq", "dequantize_compressed_int",
        "dequantize_fp8", "dequantize_compressed_fp8", "dequantize_mxfp4", "dequantize_nvfp4", "transpose", "untied",
        "merge_lora", "dequantize_modelopt_nvfp4", "dequantize_modelopt_fp8",
        "dequantize_deepseek_fp4",
    }  # fmt: skip
    order = [kind.order for kind in all_kinds().values()]
    assert order == sorted(order) and list(all_kinds())[-2:] == ["copy", "merge_lora"]


def test_importing_the_planner_imports_every_kind_and_format_module():
    # The CPU route's workers are forked before a plan is made and must unpickle a kind's computation without an import.
    import pkgutil
    import subprocess
    import sys

    import nf4convert.formats
    import nf4convert.kinds
    import nf4convert.plan

    code = "import sys, nf4convert.plan; print(nf4convert.plan.__file__, ' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=package_env())
    where, *loaded = result.stdout.split()
    assert where == str(Path(nf4convert.plan.__file__))
    for package in (nf4convert.kinds, nf4convert.formats):
        modules = {f"{package.__name__}.{module.name}" for module in pkgutil.iter_modules(package.__path__)}
        assert modules and modules <= set(loaded), modules - set(loaded)
    assert "torch" not in loaded


# --- every kind has its reference; every format its kind ---------------------------------------------------------


@pytest.mark.parametrize("name", list(all_kinds()))
def test_every_registered_kind_has_its_reference_module_of_the_same_name(name):
    kind = all_kinds()[name]
    assert kind.__module__ == f"nf4convert.kinds.{name}"
    reference = reference_for(name)
    assert reference.__name__ == f"nf4convert.verification.reference.{name}"
    for function in ("slices", "reference", "against"):
        assert callable(getattr(reference, function, None)), (name, function)
    assert list(inspect.signature(reference.slices).parameters) == [
        "tensor", "reader", "device", "context", "piece_bytes"
    ]  # fmt: skip


def test_every_registered_format_is_the_format_of_a_kind():
    dequantized = {kind.format for kind in all_kinds().values() if kind.format is not None}
    assert set(all_formats().values()) <= dequantized
    for source_format in all_formats().values():
        for name in ("family", "title", "quant_methods", "name_suffix", "plan_reads", "marks"):
            assert getattr(source_format, name, None), (source_format.name, name)


# --- routes are generic --------------------------------------------------------------------------------------------


ROUTE_METHODS = {"pool", "warm", "maker_started", "make", "make_into", "pieces_of"}


@pytest.mark.parametrize("route", [CpuRoute, CudaRoute])
def test_no_route_has_a_method_of_its_own_for_a_format_or_kind(route):
    public = {name for name, value in vars(route).items() if callable(value) and not name.startswith("_")}
    assert public == ROUTE_METHODS
    assert isinstance(route.piece_bytes, int) and not {"cast", "state_4bit", "dequantize_4bit"} & set(dir(route))
    protocol = {name for name, value in vars(routes_base.Route).items() if callable(value) and not name.startswith("_")}
    assert protocol == ROUTE_METHODS
    assert route.gpu is (route is CudaRoute)


def test_the_cpu_route_makes_a_host_computation_here_or_in_a_worker():
    def here(read, out):
        out[:] = read + 1

    with CpuRoute(processes=0) as threads:
        assert threads.make(here) is here  # no workers: on the maker thread as it is
    with CpuRoute(processes=1) as processes:
        read, out = processes._workers.slot(8)[:8], np.zeros(8, dtype=np.uint8)
        read[:] = np.arange(8, dtype=np.uint8)
        processes.make(here)(read, out)  # ``out`` is not in the shared mapping: made here
        assert out.tolist() == list(range(1, 9))


# --- what is asked of all formats means what it meant ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config,reason",
    [
        ({}, "config.json has no quantization_config: the weights are not quantized (already dense?)"),
        (
            {"quantization_config": {"quant_method": "hqq", "nbits": 4}},
            "config.json's quantization_config has quant_method 'hqq', which nf4convert does not read (it reads "
            "AWQ, bitsandbytes, compressed-tensors, FP8, GPTQ, ModelOpt or MXFP4)",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "x"}},
            "config.json: quantization_config checkpoint_format 'x' is not a GPTQ layout this reads (gptq, gptq_v2)",
        ),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, None),
        (
            {"text_config": {"quantization_config": {"load_in_8bit": True, "llm_int8_has_fp16_weight": True}}},
            "saved with llm_int8_has_fp16_weight=True, so its weights are dense fp16 already (bitsandbytes never "
            "quantized them): remove quantization_config from config.json and load it as a dense model",
        ),
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, None),
        ({"quantization_config": {"load_in_8bit": True}}, None),  # older transformers: no quant_method
        ({"quantization_config": {"quant_method": "BitsAndBytes_8bit"}}, None),
        (  # one config of several holds 8-bit weights
            {
                "quantization_config": {"load_in_8bit": True, "llm_int8_has_fp16_weight": True},
                "vision_config": {"quantization_config": {"load_in_8bit": True}},
            },
            None,
        ),
        ({"quantization_config": {"load_in_8bit": True, "load_in_4bit": True, "llm_int8_has_fp16_weight": True}}, None),
    ],
)
def test_a_config_is_refused_for_the_reasons_it_was_when_bitsandbytes_was_assumed(config, reason):
    assert formats_base.config_reason(config) == reason
    problem = reason if reason and ("llm_int8_has_fp16_weight" in reason or "GPTQ layout" in reason) else None
    assert formats_base.config_problem(config) == problem


@pytest.mark.parametrize(
    "name,stem",
    [
        ("org/Llama-3.2-1B-Instruct-bnb-4bit", "org/Llama-3.2-1B-Instruct"),
        ("Qwen-NF4", "Qwen"),
        ("m-fp4", "m"),
        ("m-BNB-8BIT", "m"),
        ("m-int8", "m"),
        ("m-bnb-int8", "m"),
        ("m-4bit-x", "m-4bit-x"),
        ("m-bnb", "m-bnb"),
        ("m-int4", "m-int4"),
        ("mint8", "mint8"),
    ],
)
def test_the_name_suffix_is_what_a_quantized_name_ends_in(name, stem):
    assert formats_base.name_suffix().sub("", name) == stem


@pytest.mark.parametrize(
    "name,quantized",
    [
        ("a.weight.quant_state.bitsandbytes__nf4", True),
        ("a.weight.quant_state.bitsandbytes__fp4", True),
        ("a.weight.absmax", True),
        ("a.weight.quant_map", True),
        ("a.weight.nested_absmax", True),
        ("a.weight.nested_quant_map", True),
        ("a.SCB", True),
        ("a.weight_format", True),
        ("a.weight", False),
        ("absmax", False),
        ("a.scb", False),
        ("a.weight.quant_state", False),
    ],
)
def test_a_quantization_key_is_any_format_s(name, quantized):
    assert (formats_base.quantization_key(name) is not None) is quantized


def test_the_plan_reads_the_formats_small_tensors_and_not_the_weights():
    reads = formats_base.plan_reads()
    assert all(reads.search(f"a.weight.{part}") for part in ("quant_map", "nested_absmax", "nested_quant_map"))
    assert reads.search("a.weight.quant_state.bitsandbytes__nf4") and reads.search("a.SCB")
    assert reads.search("a.weight_format")
    assert not any(reads.search(name) for name in ("a.weight", "a.weight.absmax", "a.bias"))

"""verify for a GGUF OUT: llama.cpp's converter run again, on the reference, and its file compared with OUT.

Every tensor is recomputed by its reference (``reference/``: bitsandbytes' dequantization, peft's merge) and handed to
the converter (``sinks/gguf/converter.py``) as the dense checkpoint's, in the dense dtype the GGUF was made from; the
converter's own graph then converts or quantizes it with gguf-py (never the conversion's fast paths). The file it would
write is compared with OUT: the header and every metadata field byte for byte, every tensor's name, type, shape and
place, and every tensor's bytes, one tensor at a time. The fields the converter derives from the model's name
(``converter.NAME_FIELDS``) are named in a note where they differ: a SOURCE given under another name makes another
name, not other weights.

The front door (``verify.py``) has resolved SOURCE, chosen the device, checked the reference libraries and planned the
source; this runs the converter on the references and compares.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..dtypes import DTYPES
from ..errors import ArgumentError, CheckpointError, SourceNotFoundError
from ..hub.names import model_stem
from ..sinks.card import card_for_plan
from ..sinks.gguf.converter import (
    FLOAT_TYPES,
    GGUF_TYPES,
    IMPORTS,
    NAME_FIELDS,
    QUANT_TYPES,
    converter_errors,
    converter_model,
    dense_dtype,
    installed,
    is_quantized,
    quiet_converter,
    staged,
    tensors_of,
)
from ..sinks.gguf.typeplan import FILE_TYPES
from ..sinks.scratch import scratch_folder
from . import hints, llama_quantize
from .finite import made_by_merge
from .outputs import Output, register
from .reference.base import against

HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the reader's names for the header's words


@register
class GgufCheck(Output):
    """A GGUF output checked by verify: read (and its type known) before SOURCE is fetched."""

    name = "gguf"
    gguf = True
    imports = IMPORTS  # the converter's, begun on the side

    @staticmethod
    def claims(output: str) -> bool:
        """An OUT named ``.gguf``, or a regular file that begins as a GGUF does (``--to gguf`` names it freely)."""
        if output.lower().endswith(".gguf"):
            return True
        path = os.path.expanduser(output)
        try:
            if not os.path.isfile(path):
                return False
            with open(path, "rb") as file:
                return file.read(4) == b"GGUF"
        except OSError:
            return False

    def __init__(self, output: Path):
        if not output.is_file():
            found = "a folder, not a GGUF file" if output.is_dir() else "not a regular file"
            raise SourceNotFoundError(f"{output}: {found if os.path.lexists(output) else 'no such file'}")
        self.output = output
        installed()
        import gguf

        self.gguf_module = gguf
        self.actual = _read(self.gguf_module, output)
        self.gguf_type = _gguf_type(self.gguf_module, self.actual, output)
        self.dtype_given = False  # plan_dtype says
        self.imatrix = None  # the importance matrix a file of llama-quantize's types records it was made with
        self.quantize = None  # and llama.cpp's quantizer, to make it again
        if is_quantized(self.gguf_type):
            field = self.actual.fields.get("quantize.imatrix.file")
            if field is not None:
                self.imatrix = os.fsdecode(bytes(field.parts[field.data[0]]))
                if not os.path.isfile(self.imatrix):
                    raise ArgumentError(
                        f"{output} was made with the importance matrix {self.imatrix} (its quantize.imatrix.file), "
                        "which is not here: verify reads it from there"
                    )
            self.quantize = llama_quantize.find(self.gguf_type, self.imatrix is not None)

    def plan_dtype(self, dtype):
        """The dtype the source is planned in (a ``DType``; None: auto): ``dtype`` as the conversion's ``--dtype``
        (None: as a conversion to this GGUF type chooses)."""
        self.dtype_given = dtype is not None
        return dense_dtype(dtype, self.gguf_type)

    def check(self, report, plan, context, source_reader, device, *, progress: bool, source, revision, resolved):
        """Run llama.cpp's converter on the references of the planned tensors and compare the file it would write with
        the GGUF: header, metadata, tensor infos, then each tensor's bytes; what differs goes in ``report``."""
        import torch
        from tqdm.auto import tqdm

        output, gguf, actual = self.output, self.gguf_module, self.actual
        card = card_for_plan(
            plan,
            base=resolved.base,
            adapter=resolved.adapter,
            revision=revision if resolved.base == source else None,
            title=output.name,
        )
        planned = context.planned
        recomputed = []
        non_finite: dict[str, str] = {}  # what merges made NaN or ±inf, where their base holds none

        def reference(name: str):
            tensor = planned[name]
            recomputed.append(tensor)
            made = context.recompute(tensor, source_reader, device).to("cpu")
            if tensor.recipe.merges_adapter and name not in non_finite:
                problem = made_by_merge(tensor, made, source_reader, device, context)
                if problem:
                    non_finite[name] = problem
            return made.to(DTYPES[tensor.dtype].torch).reshape(tensor.shape)

        if self.quantize is not None:
            report.requantized = True
            with (
                scratch_folder("verify") as scratch,
                staged(plan.folder, plan.config or {}, card.text, model_stem(source)) as stage,
                converter_errors(plan.folder),
                quiet_converter(),
                torch.inference_mode(),
            ):
                expected = self._requantized(plan, stage, reference, scratch, report)
            for tensor in recomputed:
                report.dequantized += not tensor.recipe.plain
                report.merged += tensor.recipe.merges_adapter
                report.compared_against[tensor.name] = against(tensor, device)
            report.problems += [f"{name}: {problem}" for name, problem in non_finite.items()]
            report.notes += hints.gguf_hints(
                report.problems, adapter_given=resolved.adapter_folder is not None, dtype_given=self.dtype_given
            )
            return
        with (
            scratch_folder("verify") as scratch,
            staged(plan.folder, plan.config or {}, card.text, model_stem(source)) as stage,
            converter_errors(plan.folder),
            quiet_converter(),
            torch.inference_mode(),
        ):
            model = converter_model(stage, tensors_of(plan), reference, scratch / "expected.gguf", self.gguf_type)
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
            expected = _read(gguf, _header_file(model.gguf_writer, scratch / "expected.gguf"))
            report.problems += _field_problems(expected, actual, report.notes)
            report.problems += _layout_problems(expected, actual)
            found = {tensor.name: tensor for tensor in actual.tensors}
            written = [(name, info) for split in model.gguf_writer.tensors for name, info in split.items()]
            for name, info in tqdm(
                written, desc=f"verifying {output.name}", unit="tensor", disable=not progress, dynamic_ncols=True
            ):
                if name not in found:
                    continue
                report.checked += 1
                del recomputed[:]
                problem = _data_problem(gguf, info, found[name])
                info.tensor = None  # the converter's graph for it, and the reference it holds, go
                for tensor in recomputed:
                    report.dequantized += not tensor.recipe.plain
                    report.merged += tensor.recipe.merges_adapter
                    report.compared_against[tensor.name] = against(tensor, device)
                if problem:
                    sources = ", ".join(sorted({against(tensor, device) for tensor in recomputed})) or "the reference"
                    report.problems.append(f"{name}: {problem} (llama.cpp's converter on {sources})")
            report.problems += [f"{name}: {problem}" for name, problem in non_finite.items()]
        elsewhere = hints.not_from_source(
            {tensor.name: tuple(tensor.shape) for tensor in expected.tensors},
            {tensor.name: tuple(tensor.shape) for tensor in actual.tensors},
            report.problems,
        )
        if elsewhere is not None:
            report.notes.append(elsewhere)
        else:
            report.notes += hints.gguf_hints(
                report.problems,
                adapter_given=resolved.adapter_folder is not None,
                dtype_given=self.dtype_given,
            )

    def _requantized(self, plan, stage: Path, reference, scratch: Path, report):
        """llama.cpp's converter on the references writes llama-quantize's input in the dense dtype's float type;
        llama.cpp's own quantizer makes the file of it; that file is compared with the GGUF, field by field and
        tensor by tensor."""
        gguf, actual = self.gguf_module, self.actual
        source = scratch / "input.gguf"
        model = converter_model(stage, tensors_of(plan), reference, source, FLOAT_TYPES[plan.dtype.short])
        model.prepare_tensors()
        model.prepare_metadata(vocab_only=False)
        writer = model.gguf_writer
        writer.write_header_to_file(path=source)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
        made = scratch / "expected.gguf"
        try:
            self.quantize(source, made, self.imatrix)
        except llama_quantize.QuantizeFailed as error:
            report.problems.append(f"llama.cpp's quantizer could not make the file again: {error}")
            return None
        source.unlink()
        expected = _read(gguf, made)
        report.problems += _field_problems(expected, actual, report.notes)
        report.problems += _layout_problems(expected, actual)
        found = {tensor.name: tensor for tensor in actual.tensors}
        for tensor in expected.tensors:
            if tensor.name not in found:
                continue
            report.checked += 1
            want, got = (bytes(memoryview(item.data).cast("B")) for item in (tensor, found[tensor.name]))
            if want != got:
                differ = sum(a != b for a, b in zip(want, got)) + abs(len(want) - len(got))
                report.problems.append(f"{tensor.name}: {differ} of {len(want)} bytes differ (llama-quantize's)")
        return expected


def _read(gguf, path: Path):
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001  (whatever a file that is not GGUF makes the reader raise)
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: not a readable GGUF file ({text})") from None


def _gguf_type(gguf, reader, output: Path) -> str:
    """The --gguf-type a GGUF was written as (from its general.file_type)."""
    field = reader.fields.get("general.file_type")
    value = int(field.contents()) if field is not None else None
    names = {int(gguf.LlamaFileType[name]): gguf_type for gguf_type, name in GGUF_TYPES.items()}
    names |= {FILE_TYPES[name][0]: gguf_type for gguf_type, name in QUANT_TYPES.items()}
    if value not in names:
        raise ArgumentError(
            f"{output}: general.file_type {value} is not a type nf4convert writes "
            f"({', '.join((*GGUF_TYPES, *QUANT_TYPES))})"
        )
    return names[value]


def _header_file(writer, path: Path) -> Path:
    """The converter's file without its tensors' bytes: header, metadata and tensor infos written, then the data
    section left as a hole of its size (a sparse file), so that gguf's reader reads it as the whole file."""
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    (out,) = writer.fout
    writer.write_padding(out, out.tell())
    size = out.tell() + sum(writer.ggml_pad(info.nbytes, writer.data_alignment) for info in writer.tensors[0].values())
    out.truncate(size)
    writer.close()
    return path


def _field_bytes(field) -> bytes:
    return b"".join(part.tobytes() for part in field.parts)


def _field_problems(expected, actual, notes: list[str]) -> list[str]:
    problems = []
    for key in [key for key in expected.fields if key not in actual.fields]:
        problems.append(f"metadata {key}: missing from the GGUF")
    for key in [key for key in actual.fields if key not in expected.fields]:
        problems.append(f"metadata {key}: in the GGUF, not written by llama.cpp's converter")
    common = [key for key in expected.fields if key in actual.fields]
    if [key for key in actual.fields if key in expected.fields] != common:
        problems.append("metadata: its fields are not in the order llama.cpp's converter writes them")
    for key in common:
        want, got = expected.fields[key], actual.fields[key]
        if key in HEADER_FIELDS or _field_bytes(want) == _field_bytes(got):
            continue
        text = f"metadata {key}: {_shown(got)} in the GGUF, {_shown(want)} from llama.cpp's converter"
        if key in NAME_FIELDS:
            notes.append(f"{text} (derived from the model's name, not checked)")
        else:
            problems.append(text)
    return problems


def _shown(field) -> str:
    try:
        value = field.contents()
    except Exception:  # noqa: BLE001  (a field the reader cannot decode: its bytes are what differ)
        return f"{len(_field_bytes(field))} bytes"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _layout_problems(expected, actual) -> list[str]:
    """The tensor infos: the same tensors, in the same order, with the same types, shapes and places."""
    want = {tensor.name: tensor for tensor in expected.tensors}
    got = {tensor.name: tensor for tensor in actual.tensors}
    problems = [f"{name}: written by llama.cpp's converter, missing from the GGUF" for name in want if name not in got]
    problems += [f"{name}: in the GGUF, not written by llama.cpp's converter" for name in got if name not in want]
    if [name for name in got if name in want] != [name for name in want if name in got]:
        problems.append("tensors: not in the order llama.cpp's converter writes them")
    for name in [name for name in want if name in got]:
        a, b = want[name], got[name]
        if (a.tensor_type, list(a.shape), a.n_bytes) != (b.tensor_type, list(b.shape), b.n_bytes):
            problems.append(
                f"{name}: {b.tensor_type.name} {list(b.shape)} in the GGUF, {a.tensor_type.name} {list(a.shape)} "
                "from llama.cpp's converter"
            )
        elif a.data_offset != b.data_offset:
            problems.append(f"{name}: at byte {b.data_offset} of the GGUF, {a.data_offset} from llama.cpp's converter")
    return problems


def _data_problem(gguf, info, found) -> str | None:
    """What is wrong with a GGUF tensor's bytes against the converter's for it (its lazy graph, evaluated here)."""
    import numpy as np

    made = gguf.LazyNumpyTensor.to_eager(info.tensor) if isinstance(info.tensor, gguf.LazyBase) else info.tensor
    want = np.ascontiguousarray(made).reshape(-1).view(np.uint8)
    got = np.ascontiguousarray(found.data).reshape(-1).view(np.uint8)
    if want.size != got.size:
        return f"{got.size} bytes in the GGUF, {want.size} from llama.cpp's converter"
    differ = int(np.count_nonzero(want != got))
    return f"{differ} of {want.size} bytes differ" if differ else None

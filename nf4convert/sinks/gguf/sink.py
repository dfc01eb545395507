"""The GGUF sink: one ``.gguf`` file, written by llama.cpp's converter (``converter.py``) from the plan's tensors.

No dense checkpoint is written. Once the converter has prepared its tensors, the file's layout is known but for where
the data begins; a feed (``feed.py``) then makes them through the pipeline in the file's order while the converter
writes the metadata. Where a tensor's graph allows, a fast path (``fast.py``) gives the same bytes as the converter's
graph without its fp32 round trip: written piece by piece at their places by the pipeline's writers where the
converter's layout steps keep the values' order (``streamed.py``; the embedding and the head are never whole), else
from the tensor made whole. The converter still decides everything else: names, types, shapes, order, metadata, the
tokenizer.

Which GGUF type: ``--gguf-type``, or the dense dtype's own float type (bf16 -> bf16, fp16 -> f16, fp32 -> f32); with
``--dtype auto`` a float ``--gguf-type`` makes the dense tensors in that type, so they need no conversion. One of
llama-quantize's types (q4_k_m...) is the file ``llama-quantize`` writes from the converter's file in the dense
dtype's own float type, made in the same pass (``requant.py``), with ``--imatrix`` its importance matrix.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...errors import ArgumentError
from ...sizes import DEFAULT_SHARD_BYTES
from .. import output as lifecycle
from ..base import Sink, Written, register
from ..naming import default_output
from .converter import (
    ALL_TYPES,
    FLOAT_TYPES,
    QUANT_TYPES,
    check,
    converter,
    dense_dtype,
    installed,
    is_quantized,
    staged,
    start_importing,
    tensors_of,
)
from .filewrite import GgufWritten, write_gguf
from .requant import Requantization, file_size

__all__ = ["GgufFile", "GgufWritten", "write_gguf"]

GGUF_SUFFIX = ".gguf"


@register
class GgufFile(Sink):
    """One GGUF file, as llama.cpp's converter writes it from the dense output: an OUT ending in ``.gguf``, or a
    ``gguf_type`` with no OUT (then named ``<stem>-<type>.gguf``)."""

    name = "gguf"
    file = True
    exact_size = False

    @classmethod
    def claims(cls, options) -> bool:
        named = options.output is not None and str(options.output).lower().endswith(GGUF_SUFFIX)
        return named or (options.output is None and options.gguf_type is not None)

    @classmethod
    def check_options(cls, options, *, claimed: bool) -> None:
        gguf_type = options.gguf_type
        if gguf_type is not None and gguf_type not in ALL_TYPES:
            raise ArgumentError(f"GGUF type {gguf_type!r} is not one of {', '.join(ALL_TYPES)}", option="gguf_type")
        if gguf_type is not None and not claimed:
            raise ArgumentError(
                f"gguf_type {gguf_type!r} writes one GGUF file: give an output ending in .gguf", option="gguf_type"
            )
        imatrix = getattr(options, "imatrix", None)
        if imatrix is not None and not is_quantized(gguf_type):
            raise ArgumentError(
                f"imatrix is llama-quantize's: give it with a --gguf-type of {', '.join(QUANT_TYPES)}", option="imatrix"
            )

    @classmethod
    def adjusted(cls, options):
        """The tensors made in the GGUF type's own float dtype where ``dtype`` is auto, laid out in the default dense
        output's shards (whose order the converter's tensor order is)."""
        return options.replace(dtype=dense_dtype(options.dtype, options.gguf_type), max_shard_size=DEFAULT_SHARD_BYTES)

    @classmethod
    def check_ready(cls) -> None:
        installed()  # read, not imported: its import begins with the command (begin_imports) or where first needed

    @classmethod
    def begin_imports(cls) -> None:
        """The converter's import begun on the preload thread, while the command resolves and plans."""
        start_importing()

    @classmethod
    def batch_output(cls, output_root, stem: str, options) -> str:
        """``<stem>-<type>.gguf``; with no ``gguf_type`` (``to``), the dtype's float type, or ``<dtype>`` standing for
        the one the plan decides."""
        if options.gguf_type is not None or options.dtype is not None:
            own = options.gguf_type or FLOAT_TYPES[options.dtype.short]
            return str(default_output(output_root, stem, f"{own}{GGUF_SUFFIX}"))
        longest = max(FLOAT_TYPES.values(), key=len)
        placed = default_output(output_root, stem, f"{longest}{GGUF_SUFFIX}")
        return str(placed.with_name(f"{stem}-<dtype>{GGUF_SUFFIX}"))

    def __init__(self, options, plan, name: str):
        super().__init__(options, plan, name)
        self.type = self.own_type = (
            options.gguf_type or FLOAT_TYPES[plan.dtype.short]
        )  # --dtype's float type by default
        # what the converter writes: for llama-quantize's types, its input (the dense dtype's own float type)
        self.converter_type = FLOAT_TYPES[plan.dtype.short] if is_quantized(self.type) else self.type
        self._vocabulary = None  # what the check recorded of the converter's vocabulary
        self._imatrix = None
        self._retyped = None  # what the check planned of llama-quantize's step: name -> requant.Retyped
        self._file_size = None  # and the file's size, so

    def requantization(self) -> Requantization | None:
        """llama-quantize's step after the converter, for llama-quantize's types (the importance matrix read once)."""
        if not is_quantized(self.type):
            return None
        path = getattr(self.options, "imatrix", None)
        if path is not None and self._imatrix is None:
            from .imatrix import Imatrix

            self._imatrix = Imatrix.read(path)
        return Requantization(self.type, self._imatrix)

    def default_output(self, output_dir, stem: str) -> Path:
        return default_output(output_dir, stem, f"{self.type}{GGUF_SUFFIX}")

    def check_plan(self) -> None:
        """What llama.cpp's converter refuses of this plan (architecture, tensor names, config fields, tokenizer),
        found without reading a weight (``converter.check``)."""
        plan = self.plan
        requant = self.requantization()

        def planned(model):
            gguf, _ = converter()
            self._retyped = requant.apply(model.gguf_writer, gguf)
            self._file_size = file_size(model.gguf_writer)

        inspect = planned if requant is not None else None
        with staged(plan.folder, plan.config or {}, None, self.model) as stage:
            self._vocabulary = check(stage, tensors_of(plan), self.converter_type, plan.folder, inspect)

    def size_bound(self) -> int:
        """At most the bytes of the GGUF: each tensor at the type's size (one-dimensional ones in fp32, as the converter
        writes them), padding, and the side files' bytes again for the metadata (the vocabulary)."""
        plan = self.plan
        if self._retyped is not None:  # planned: the tensors' sizes are known
            values = sum(tensor.nbytes for tensor in self._retyped.values())
            return values + 32 * len(self._retyped) + plan.side_bytes + (1 << 20)
        per_value = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}[self.converter_type]
        values = sum(math.prod(tensor.shape) * (4 if len(tensor.shape) <= 1 else per_value) for tensor in plan.tensors)
        return int(values) + 32 * len(plan.tensors) + plan.side_bytes + (1 << 20)

    def what(self, planned: bool = False) -> str:
        if planned:
            return f"GGUF {self.type}, from {self.plan.dtype.name} tensors"
        return f"GGUF {self.type} (made from {self.plan.dtype.name})"

    def label(self) -> str:
        return f"GGUF {self.type}"

    def plan_lines(self) -> list[str]:
        architecture = (self.plan.config or {}).get("architectures", ["?"])[0]
        converter = f"llama.cpp's converter: takes {architecture}, its tensors and its tokenizer"
        lines = [f"{converter} (model name {self.model!r})"]
        if not is_quantized(self.type):
            return lines
        step = f"then llama-quantize's {self.type.upper()} of its {self.converter_type} file"
        if self._imatrix is not None:
            step += f", with the importance matrix {self._imatrix.path}"
        lines.append(step)
        if self._retyped is None:
            return [*lines, "  (each tensor's type is known once the converter has read the weights it decides by)"]
        width = max(len(name) for name in self._retyped)
        for tensor in self._retyped.values():
            shape = ", ".join(str(size) for size in tensor.ne[: max(1, _n_dims(tensor.ne))])
            lines.append(f"  {tensor.name:<{width}}  [{shape}]  {tensor.source} -> {tensor.target}")
        lines.append(f"GGUF file: {self._file_size} bytes ({self._file_size / (1 << 20):.2f} MiB)")
        return lines

    def write(self, staging, output, reader, route, *, card, settings, progress, tensor_done) -> Written:
        return write_gguf(
            self.plan,
            staging / output.name,
            reader,
            route,
            gguf_type=self.converter_type,
            requant=self.requantization(),
            name=self.model,
            card=card(),
            settings=settings,
            progress=progress,
            vocabulary=self._vocabulary,
        )

    def place(self, staging: Path, output: Path, *, overwrite: bool) -> int:
        size = (staging / output.name).stat().st_size
        lifecycle.move_file_into_place(staging, output, overwrite=overwrite)
        return size

    def pushed_card(self, card: str, output: Path) -> str:
        """The dense card (the one the converter read the metadata from), with a section on the file first."""
        from .converter import CONVERTER, CONVERTER_VERSION

        file_name = output.name
        section = (
            f"## GGUF\n\n`{file_name}` is a GGUF file of type {self.type}, written in one pass by nf4convert with "
            f"llama.cpp's converter ({CONVERTER} {CONVERTER_VERSION}): the file `convert_hf_to_gguf.py --outtype "
            f"{self.type}` writes from the dense weights this card describes, byte for byte, without a dense copy "
            "written in between."
        )
        if is_quantized(self.type):
            imatrix = f" --imatrix {self._imatrix.path}" if self._imatrix is not None else ""
            section = (
                f"## GGUF\n\n`{file_name}` is a GGUF file of type {self.type.upper()}, written in one pass by "
                f"nf4convert: the file `llama-quantize{imatrix} IN {file_name} {self.type.upper()}` writes (llama.cpp "
                f"as llama-cpp-python 0.3.36 vendors it, built for x86-64) when IN is the {self.converter_type} file "
                f"llama.cpp's converter ({CONVERTER} {CONVERTER_VERSION}) writes from the dense weights this card "
                "describes, byte for byte, without either written in between."
            )
        closing = card.find("\n---\n", 3) if card.startswith("---\n") else -1
        if closing != -1:
            end = closing + len("\n---\n")
            return f"{card[:end]}\n{section}\n\n{card[end:].lstrip(chr(10))}"
        return f"{section}\n\n{card}"

    @classmethod
    def push(cls, output, repo_id, *, card, private, token, revision, progress) -> str:
        from ...hub.upload import push_file_to_hub

        return push_file_to_hub(
            output, repo_id, card=card, private=private, token=token, revision=revision, progress=progress
        )

    @classmethod
    def push_again(cls, output, repo_id, *, card, private, branch) -> str:
        """The file, then its model card (the push's README.md), written beside it as ``<stem>.README.md`` since the
        card lives nowhere else; a file of that name that is not this card is left as it is."""
        from ...hub.upload import upload_command

        output = Path(output)
        file = upload_command(repo_id, output, output.name, private=private, branch=branch)
        if card is None:
            return f"push it again with: {file}"
        kept = output.with_name(f"{output.stem}.README.md")
        try:
            if not kept.exists():
                _write_new(kept, card.encode("utf-8"))
            elif kept.read_bytes() != card.encode("utf-8"):
                return f"push it again with: {file} (its model card was not kept: {kept} is another file)"
        except OSError as error:
            return f"push it again with: {file} (its model card could not be kept: {error.strerror or error})"
        readme = upload_command(repo_id, kept, "README.md", private=private, branch=branch)
        return f"its model card is kept as {kept}; push both again with: {file} && {readme}"


def _n_dims(ne) -> int:
    return next((index + 1 for index in range(len(ne) - 1, 0, -1) if ne[index] > 1), 1)


def _write_new(path: Path, data: bytes) -> None:
    """``data`` as the new file ``path``, whole or not at all (OSError)."""
    handle = open(path, "xb")  # a file there already is not ours: FileExistsError
    try:
        with handle:
            handle.write(data)
    except OSError:
        path.unlink(missing_ok=True)
        raise

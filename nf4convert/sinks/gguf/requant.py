"""The step ``llama-quantize IN OUT TYPE`` takes after the converter, taken in the same pass: IN is the converter's
GGUF in the dense dtype's own float type, OUT the file llama-quantize writes from it, byte for byte.

What llama-quantize does to IN (``llama_model_quantize_impl`` in src/llama-quant.cpp at the pinned llama.cpp), done
here to the converter's writer before it writes (``Requantization.apply``):

- the metadata: every field of IN in its order, then ``general.quantization_version`` and ``general.file_type``
  removed and added again at the end (``gguf_set_val_u32`` removes a key and appends it), the split fields removed,
  then with an importance matrix ``quantize.imatrix.file``, ``.dataset``, ``.entries_count`` and ``.chunks_count``
  as llama-quantize's command line adds them (``imatrix.py``);
- the tensors: in llama-quantize's order (``typeplan.weight_order``: by layer, then by name), each of the type the
  plan gives it (``typeplan.type_plan``), its dimensions counted as ggml counts them (trailing ones dropped), at
  offsets aligned to 32;
- each tensor whose type changes: its IN values (bf16, f16 or f32, widened to float32 exactly) quantized row by row
  with ``quants.quant_type(T).quantize(rows, imatrix)``, an expert's rows with that expert's slice of the importance
  matrix (``Retyped.quantize``). The others are IN's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import ArgumentError, CheckpointError
from .converter import QUANT_TYPES
from .typeplan import FILE_TYPES, Hparams, PlanError, Tensor, type_plan

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION in ggml.h at the pinned llama.cpp
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_TOKEN_EMBEDDINGS = ("token_embd.weight", "per_layer_token_embd.weight")
_ITEM = {"F32": 4, "F16": 2, "BF16": 2}  # bytes per value of the types IN holds


@dataclass
class Retyped:
    """One tensor of the file: its name, ggml ``ne``, the type IN holds it in (``source``) and the one OUT does
    (``target``), and the importance weights its rows are quantized with (float32, ``ne[0]`` per expert), if any.
    ``device``: a torch device its rows are quantized on (the GPU route's), else None (numpy, on the calling thread)."""

    name: str
    ne: tuple
    source: str
    target: str
    imatrix: np.ndarray | None = None
    device: object = None

    @property
    def changed(self) -> bool:
        return self.source != self.target

    @property
    def row_values(self) -> int:
        return self.ne[0]

    @property
    def source_row_bytes(self) -> int:
        return self.ne[0] * _ITEM[self.source]

    @property
    def row_bytes(self) -> int:
        from .quants import quant_type

        return quant_type(self.target).row_size(self.ne[0]) if self.changed else self.source_row_bytes

    @property
    def n_rows(self) -> int:
        return math.prod(self.ne[1:])

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes

    def quantize(self, raw, first_row: int = 0) -> np.ndarray:
        """IN's bytes of whole rows ``first_row``... (a uint8 array, any shape) -> OUT's bytes of them (uint8)."""
        from .quants import quant_type

        raw = np.ascontiguousarray(raw).reshape(-1)
        if self.device is not None:
            rows = _widened_on(raw, self.source, self.device).reshape(-1, self.ne[0])
        else:
            rows = widened(raw, self.source).reshape(-1, self.ne[0])
        kind = quant_type(self.target)
        if self.imatrix is None:
            return _host(kind.quantize(rows)).reshape(-1)
        per_expert = self.ne[1]
        parts, row = [], 0
        while row < len(rows):  # an expert's rows with its own slice of the matrix
            expert = (first_row + row) // per_expert
            stop = min(len(rows), (expert + 1) * per_expert - first_row)
            weights = self.imatrix[expert * self.ne[0] : (expert + 1) * self.ne[0]]
            parts.append(_host(kind.quantize(rows[row:stop], weights)).reshape(-1))
            row = stop
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def widened(raw: np.ndarray, source: str) -> np.ndarray:
    """IN's bytes of ``source`` values (uint8) as float32, exactly as ggml widens them (bf16: the high half word)."""
    raw = raw.view(np.uint8)
    if source == "F32":
        return raw.view(np.float32)
    if source == "F16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _widened_on(raw: np.ndarray, source: str, device):
    """IN's bytes as float32 values of a torch tensor on ``device`` (exact from bf16 and f16, as ``widened``)."""
    import torch

    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[source]
    return torch.from_numpy(raw).to(device).view(dtype).float()


def _host(made) -> np.ndarray:
    """Quantized bytes as numpy, from numpy or a torch tensor on any device."""
    return made if isinstance(made, np.ndarray) else made.cpu().numpy()


class Requantization:
    """llama-quantize's file type ``gguf_type`` (a ``QUANT_TYPES`` name) applied to the converter's writer, with the
    importance matrix ``imatrix`` (an ``imatrix.Imatrix``) or none."""

    def __init__(self, gguf_type: str, imatrix=None):
        self.gguf_type = gguf_type
        self.file_type = QUANT_TYPES[gguf_type]
        self.imatrix = imatrix
        self.tensors: dict[str, Retyped] = {}

    def plan(self, infos: dict, fields: dict, gguf) -> dict[str, Retyped]:
        """Each tensor's ``Retyped``, in OUT's order. ``infos``: the converter's tensors (name -> gguf-py
        TensorInfo); ``fields``: its metadata (key -> value).

        Raises:
            CheckpointError: llama-quantize would refuse the model.
            ArgumentError: the importance matrix does not fit the model.
        """
        tensors = []
        for name, info in infos.items():
            ne = tuple(reversed(info.shape)) + (1,) * (4 - len(info.shape))
            tensors.append(Tensor(name, ne, gguf.GGMLQuantizationType(info.dtype).name))
        try:
            hparams = Hparams.of(fields)
            plan = type_plan(tensors, hparams, self.file_type, has_imatrix=self.imatrix is not None)
        except (PlanError, KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"llama-quantize cannot make {self.gguf_type} of this model: {error}") from None
        by_name = {tensor.name: tensor for tensor in tensors}
        retyped = {}
        for name, target in plan.items():
            tensor = by_name[name]
            if tensor.type not in _ITEM and target != tensor.type:
                raise CheckpointError(f"{name}: the converter wrote it as {tensor.type}, which is not requantized")
            retyped[name] = Retyped(name, tensor.ne, tensor.type, target)
        if self.imatrix is not None:
            self.imatrix.match(retyped)
        self.tensors = retyped
        return retyped

    def apply(self, writer, gguf) -> dict[str, Retyped]:
        """The writer's tensors replaced by OUT's (order, types, shapes, sizes: its lazy tensors kept) and its metadata
        by OUT's; returns the ``Retyped`` of each tensor."""
        (infos,) = writer.tensors
        (fields,) = writer.kv_data
        retyped = self.plan(infos, {key: value.value for key, value in fields.items()}, gguf)
        reordered = {}
        for name, tensor in retyped.items():
            info = infos[name]
            shape = list(info.shape)
            while len(shape) > 1 and shape[0] == 1:  # ggml_n_dims: trailing dimensions of 1 are not written
                shape.pop(0)
            dtype = gguf.GGMLQuantizationType[tensor.target]
            reordered[name] = type(info)(shape=shape, dtype=dtype, nbytes=tensor.nbytes, tensor=info.tensor)
        infos.clear()
        infos.update(reordered)
        self.retype_fields(fields, gguf)
        return retyped

    def retype_fields(self, fields: dict, gguf) -> None:
        """The metadata llama-quantize writes from IN's ``fields`` (key -> GGUFValue), in place."""
        kinds = gguf.GGUFValueType
        added = [
            ("general.quantization_version", QUANTIZATION_VERSION, kinds.UINT32),
            ("general.file_type", FILE_TYPES[self.file_type][0], kinds.UINT32),
        ]
        for key, value, kind in added:
            fields.pop(key, None)
            fields[key] = gguf.GGUFValue(value=value, type=kind)
        for key in _SPLIT_KEYS:
            fields.pop(key, None)
        if self.imatrix is not None:
            for key, value, kind in self.imatrix.fields(kinds):
                fields.pop(key, None)
                fields[key] = gguf.GGUFValue(value=value, type=kind)


def check_imatrix_sizes(retyped: dict[str, Retyped], entries: dict, path) -> None:
    """What llama-quantize refuses of an importance matrix: an entry of the wrong length for a tensor it quantizes
    (the token embeddings excepted, which it quantizes without one)."""
    for name, tensor in retyped.items():
        weights = entries.get(name)
        if weights is None or not tensor.changed:
            continue
        want = tensor.ne[0] * tensor.ne[2]
        if weights.size == want:
            tensor.imatrix = weights
        elif name not in _TOKEN_EMBEDDINGS:
            raise ArgumentError(
                f"{path}: its entry for {name} has {weights.size} values, the tensor {want} (ne[0] x experts): "
                "an importance matrix of another model?",
                option="imatrix",
            )


def file_size(writer) -> int:
    """The bytes of the file ``writer`` (gguf-py's, its metadata and tensor infos final) writes: header, metadata,
    tensor infos, padding, each tensor padded to the alignment."""
    from .metadata import pack_field

    (fields,) = writer.kv_data
    (infos,) = writer.tensors
    meta = 4 + 4 + 8 + 8 + sum(len(pack_field(writer, key, value)) for key, value in fields.items())
    meta += sum(8 + len(name.encode()) + 4 + 8 * len(info.shape) + 4 + 8 for name, info in infos.items())
    return writer.ggml_pad(meta, writer.data_alignment) + sum(
        writer.ggml_pad(info.nbytes, writer.data_alignment) for info in infos.values()
    )

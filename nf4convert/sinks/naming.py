"""Where an output goes when the user does not say: ``<output_dir or .>/<name>-<dtype>``, the model's name without
its quantization suffix; a batch's names, made distinct."""

from __future__ import annotations

from pathlib import Path

from ..dtypes import OUTPUT_DTYPES, DType
from ..errors import ArgumentError
from ..hub.names import looks_like_repo_id, model_stem
from ..paths import expanded, expanded_output
from .output import placed


def output_stem(source: str, *, qualified: bool = False) -> str:
    """The default output's name before ``-<dtype>``: the model's name, a quantization suffix dropped
    (org/Llama-bnb-4bit -> Llama); ``qualified`` puts the owner (or parent folder) first: org--Llama."""
    name = model_stem(source)
    if qualified:
        parent = (
            source.rstrip("/").split("/")[-2]
            if looks_like_repo_id(source)
            else expanded(source, "source").resolve().parent.name
        )
        name = f"{parent}--{name}" if parent else name
    return name


def batch_stems(sources: list[str]) -> list[str]:
    """Distinct output stems for a batch: a name that two sources share (case-insensitively, as some file
    systems compare) is qualified with each one's owner; the same source twice is an ArgumentError (a local
    folder, as ``hub.resolve`` takes it first, is the same source under any spelling of its path)."""
    seen = {}
    for source in sources:
        local = expanded(source, "source")
        key = str(local.resolve()) if local.is_dir() or not looks_like_repo_id(source) else source.rstrip("/")
        if key in seen:
            raise ArgumentError(f"{source}: given twice (as {seen[key]!r} too)")
        seen[key] = source
    plain = [output_stem(source).lower() for source in sources]
    stems = [output_stem(source, qualified=plain.count(stem) > 1) for source, stem in zip(sources, plain)]
    lowered = [stem.lower() for stem in stems]
    for source, stem in zip(sources, lowered):
        if lowered.count(stem) > 1:
            others = [other for other, s in zip(sources, lowered) if s == stem and other != source]
            raise ArgumentError(
                f"{source} and {others[0]} would both be written to '{stem}-<dtype>'; convert them apart with -o"
            )
    return stems


def check_batch_root(output_root, folders) -> None:
    """ArgumentError if a batch's output root is one of the local ``folders`` (its SOURCEs, its ADAPTER) or inside one:
    every output would be written into a source. A root that holds them is fine: the outputs go beside them."""
    root = expanded_output(output_root, "output")
    for name in folders:
        folder = expanded(name, "source") if name is not None else None
        if folder is None or not folder.is_dir():
            continue  # a Hub repo id (or a missing folder, which its conversion reports)
        where = placed(root, folder)
        if where in ("is", "inside"):
            raise ArgumentError(
                f"-o {output_root}: is {'' if where == 'is' else 'inside '}the source folder {name}; "
                "outputs are never written into a source (choose another output root)"
            )


def batch_output(output_root, stem: str, dtype: DType | None) -> str:
    """Where batch writes ``stem``'s output folder, with ``<dtype>`` standing for the dtype while it is auto (None: the
    plan decides it). The name is checked as it will be, with the longest dtype the plan may choose, not the
    placeholder."""
    if dtype is not None:
        return str(default_output(output_root, stem, dtype.short))
    longest = max((choice.short for choice in OUTPUT_DTYPES.values()), key=len)
    return str(default_output(output_root, stem, longest).with_name(f"{stem}-<dtype>"))


def default_output(output_dir, stem: str, short_dtype: str) -> Path:
    """The default output: ``<output_dir or .>/<stem>-<dtype>``, ``~`` expanded."""
    return expanded_output(expanded(output_dir or ".", "output_dir") / f"{stem}-{short_dtype}", "output_dir")

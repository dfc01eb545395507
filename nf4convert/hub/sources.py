"""SOURCE and ADAPTER, as a user names them, resolved to folders of files: a local folder, a Hub repo (``download.py``
fetches only what a conversion reads; ``weights.py`` streams its weights), or a repo already in the Hub cache; a SOURCE
that is itself a peft adapter stands for the base its config names. Refused here, as early as can be known: an empty
name, an adapter given twice, a Hub checkpoint whose config.json names no format nf4convert reads (before its weights
are fetched). Convert and verify both start here."""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..adapters.config import CONFIG_NAME, is_adapter_folder
from ..errors import ArgumentError, CheckpointError
from ..formats.base import config_reason
from ..model.config import read_config
from ..options import HubOptions
from ..paths import expanded

if TYPE_CHECKING:
    from ..adapters.lora import Adapter


class Resolved(NamedTuple):
    """SOURCE and ADAPTER resolved: the folders to read, and the names a card and a GGUF's metadata give them."""

    folder: Path  # the checkpoint's files (the base's, for an adapter given as SOURCE)
    adapter_folder: Path | None  # the adapter's files, or None
    base: str  # the checkpoint as the user named it (SOURCE, or the base an adapter SOURCE names)
    adapter: str | None  # the adapter as named (a local one as its resolved folder), or None
    loaded_adapter: Adapter | None = None  # the adapter read (its config and header), which the plan merges


def as_text(name):
    """A source or adapter as the API takes it (a str or an os.PathLike) in the str the rest of the code reads."""
    return os.fspath(name) if name is not None else None


def named_sources(source, adapter) -> tuple[str, str | None]:
    """``source`` and ``adapter`` as the API takes them (str or os.PathLike) in the str the rest of the code reads;
    ArgumentError for an empty one, which would otherwise be the current folder."""
    source, adapter = as_text(source), as_text(adapter)
    for name, value in (("source", source), ("adapter", adapter)):
        if value is not None and not value.strip():
            raise ArgumentError(
                f"{name} is empty; give a folder or a Hub repo id" + ("" if name == "source" else ", or None"),
                option=name,
            )
    return source, adapter


def _refuse_early(folder: Path, *, source: str) -> None:
    """A Hub SOURCE's precheck, on its config files alone: refuse before downloading weights when its config.json
    says it holds nothing a registered format dequantizes. An adapter (its base is checked when fetched), a repo without
    config.json and a config.json that does not parse are left to the weights and the plan, as local folders are."""
    if is_adapter_folder(folder) or not (folder / "config.json").is_file():
        return

    try:
        config = read_config(folder)  # strict and depth-limited, as the plan reads it
    except CheckpointError:
        return
    reason = config_reason(config) if config is not None else None
    if reason is not None:
        raise CheckpointError(f"{source}: not a checkpoint nf4convert reads: {reason}; its weights were not downloaded")


def resolve_source(
    source: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    hub: HubOptions = HubOptions(),
    *,
    progress=True,
    headers=None,
) -> Resolved:
    """SOURCE resolved, and ADAPTER (a :class:`Resolved`), from the Hub as ``hub`` says; a SOURCE that is itself a peft
    adapter (``adapter_config.json``, no ADAPTER given) stands for the base its config names, with it merged (a folder
    that also holds model weights is a checkpoint). ``hub.revision`` applies to SOURCE only; a Hub checkpoint whose
    config.json names no format nf4convert reads is refused before its weights are fetched; ``progress=False`` hides
    download bars; ``headers`` (a ``hub.HeadersOnly``): the checkpoint's weights are not downloaded, its folder is their
    copy for a plan (a ``hub.weights.HubWeights``: streamed as a conversion reads them, or read from the Hub cache)."""
    from ..adapters import lora as peft_lora
    from ..errors import SourceNotFoundError
    from .download import resolve

    source, adapter = as_text(source), as_text(adapter)
    folder = resolve(source, hub, progress=progress, precheck=partial(_refuse_early, source=source), headers=headers)
    others = dataclasses.replace(hub, revision=None)  # the adapter's, and the base an adapter SOURCE names
    to_adapter = headers.for_adapter() if headers is not None else None
    adapter_folder = resolve(adapter, others, progress=progress, headers=to_adapter) if adapter is not None else None
    as_adapter = is_adapter_folder(folder)
    if adapter_folder is not None and as_adapter:
        raise ArgumentError(
            f"{source} is a peft adapter (it has {CONFIG_NAME} and no model weights) and an "
            "adapter is given too: give the base checkpoint as SOURCE",
            option="adapter",
        )
    if as_adapter:
        loaded = peft_lora.load_adapter(folder)  # read once: the plan merges this
        base = loaded.base_model_name_or_path
        if not base:
            raise SourceNotFoundError(
                f"{folder / CONFIG_NAME}: an adapter whose base_model_name_or_path is "
                "not set; name the base as SOURCE and this as the adapter",
                option="adapter",
            )
        try:
            base_folder = resolve(
                base, others, progress=progress, precheck=partial(_refuse_early, source=base), headers=headers
            )
        except SourceNotFoundError as error:  # the user never typed this name: say where it came from
            raise SourceNotFoundError(
                f"{error} (the base that {folder / CONFIG_NAME} names in base_model_name_or_path; give "
                "the base as SOURCE and this folder as --adapter)",
                option=error.option,
            ) from None
        adapter_folder, folder = folder, base_folder
        return Resolved(
            folder,
            adapter_folder,
            base,
            str(adapter_folder.resolve()) if expanded(source, "source").exists() else source,
            loaded,
        )
    if adapter is not None and expanded(adapter, "adapter").exists():
        adapter = str(expanded(adapter, "adapter").resolve())  # a folder, never mistaken for a Hub repo id
    loaded = peft_lora.load_adapter(adapter_folder) if adapter_folder is not None else None  # read once
    return Resolved(folder, adapter_folder, source, adapter, loaded)

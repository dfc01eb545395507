"""The files of a converted folder beside its weights: the carried files, config.json (dense), the model card and,
for several shards, the index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..files import INDEX_NAME


def index_json(plan) -> dict:
    """model.safetensors.index.json for a sharded output, as transformers writes it."""
    weight_map = {tensor.name: tensor.shard for tensor in plan.tensors}
    return {"metadata": {"total_size": plan.tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}


def write_side_files(plan, folder: Path, card: str | None = None) -> None:
    """Carried files, config.json (dense), the model card and, for several shards, the index."""
    for relative in plan.side_files:
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.folder / relative, target)
    for relative, added in plan.added_files.items():  # a kind's, in place of the source's (the adapter's tokenizer)
        shutil.copy2(added.path, folder / relative)
    if plan.config is not None:
        (folder / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    if card is not None:
        (folder / "README.md").write_text(card, encoding="utf-8")
    if len(plan.shards) > 1:
        (folder / INDEX_NAME).write_text(json.dumps(index_json(plan), indent=2) + "\n")

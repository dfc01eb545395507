"""Repeat launches: dequantizing the same weight again (every forward pass of a QLoRA layer) replays the last
launch for its quant state, skipping argument checks and Triton's Python launch path.

A replay is only taken when the call is provably the same launch: the same packed tensor (pointer and size),
the same shape, dtype, blocksize and quant type, the very same absmax / nested tensors (weak references, so a
replaced tensor is launched afresh), and the same launch config override.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch


class LaunchKey(NamedTuple):
    data_ptr: int
    numel: int
    device: torch.device
    shape: tuple
    dtype: torch.dtype
    blocksize: int
    quant_type: str

    @classmethod
    def of(cls, packed: torch.Tensor, quant_state: Any) -> "LaunchKey":
        return cls(
            packed.data_ptr(),
            packed.numel(),
            packed.device,
            tuple(quant_state.shape),
            quant_state.dtype,
            quant_state.blocksize,
            quant_state.quant_type,
        )


def _state_tensors(quant_state: Any) -> tuple:
    nested = quant_state.state2 if quant_state.nested else None
    if nested is None:
        return (quant_state.absmax,)
    return quant_state.absmax, nested.absmax, nested.code, quant_state.offset


class _Entry(NamedTuple):
    key: LaunchKey
    tensors: tuple  # weak references to the quant state's tensors the launch read
    replay: Callable[[torch.Tensor], bool]
    config: Any  # the launch config override in force at the launch


class ReplayCache:
    """Replays by ``id(quant_state)``, each entry dropped when its quant state is garbage-collected."""

    def __init__(self):
        self._entries: dict[int, _Entry] = {}
        self._configs = None  # nf4convert.kernels.configs, once a launch was remembered

    def __contains__(self, quant_state) -> bool:
        return id(quant_state) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()  # finalizers of dropped entries then pop nothing

    def replay(self, packed: torch.Tensor, quant_state: Any) -> Optional[torch.Tensor]:
        """A fresh output filled by replaying the launch, or None when this is not provably the same launch."""
        entry = self._entries.get(id(quant_state))
        if entry is None or entry.config is not self._configs.current_override():
            return None
        key = entry.key
        if not (
            key.data_ptr == packed.data_ptr()
            and key.numel == packed.numel()
            and key.shape == tuple(quant_state.shape)
            and key.dtype is quant_state.dtype
            and key.blocksize == quant_state.blocksize
            and key.quant_type == quant_state.quant_type
        ):
            return None
        current = _state_tensors(quant_state)
        if len(current) != len(entry.tensors) or any(
            ref() is not tensor for ref, tensor in zip(entry.tensors, current)
        ):
            return None
        result = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        return result if entry.replay(result) else None

    def remember(self, packed: torch.Tensor, quant_state: Any, replay: Callable[[torch.Tensor], bool]) -> None:
        # Imported by the first launch, not with this module: the launch configs need Triton, which the CPU path
        # runs without.
        from . import configs

        self._configs = configs
        state_id = id(quant_state)
        try:
            tensors = tuple(weakref.ref(tensor) for tensor in _state_tensors(quant_state))
            if state_id not in self._entries:  # an entry under this id means this very object is alive: one finalizer
                weakref.finalize(quant_state, self._entries.pop, state_id, None)
        except TypeError:  # an object that takes no weak references: no replays for it
            return
        self._entries[state_id] = _Entry(LaunchKey.of(packed, quant_state), tensors, replay, configs.current_override())

"""JSON as the checkpoint's own readers take it, and stricter: what every config, index, quant state and adapter
config read here goes through, so that a malformed one is one line naming the file, never a traceback.

serde_json's rules (safetensors, tokenizers): no NaN/Infinity, no lone surrogates, bounded nesting; refused beyond
them: duplicate keys (a parser keeps the last one silently) and nesting deeper than ``JSON_DEPTH``.
"""

from __future__ import annotations

import json

from .errors import CheckpointError

_SHOWN_CHARS = 120  # a hostile name or value is shortened in messages, so an error stays one readable line


def shown(value) -> str:
    """``value`` for a one-line message: quoted if a printable name, else its ascii() repr; shortened."""
    text = f"'{value}'" if isinstance(value, str) and value.isprintable() else ascii(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 5] + "...'"


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str):
    # serde_json reads "-0" as a negative integer, which no usize field takes; int() would make it a plain 0.
    return -0.0 if text == "-0" else int(text)


JSON_DEPTH = 64  # nesting that JSON read here may have (configs nest 4 or 5 deep; code walking them recurses)


def _depth_within(value, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` lists/objects deep (walked without recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [
            item
            for node in level
            if isinstance(node, (dict, list))
            for item in (node.values() if isinstance(node, dict) else node)
        ]
        if not level:
            return True
    return False


def strict_json(raw: bytes, where: str):
    """Parse ``raw`` as serde_json would, and refuse duplicate keys and nesting past JSON_DEPTH; CheckpointError
    ``where: ...`` if not."""
    try:
        value = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_refuse_constant, parse_int=_parse_int
        )
        if not _depth_within(value, JSON_DEPTH):
            raise RecursionError
        return value
    except _DuplicateKey as error:
        raise CheckpointError(f"{where}: key {shown(error.args[0])} appears twice") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: not UTF-8") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{where}: not JSON ({error.msg} at character {error.pos})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: not JSON that can be read (nested too deeply)") from None
    except ValueError as error:  # NaN/Infinity, or an integer of thousands of digits
        raise CheckpointError(f"{where}: not JSON that can be read ({str(error).split(';')[0]})") from None

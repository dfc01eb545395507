"""The GGUF's metadata fields written as gguf-py's writer writes them (``GGUFWriter.write_kv_data_to_file``), the
arrays packed in one call where gguf-py packs item by item.

A vocabulary is arrays of 100 000 and more tokens, scores and types; gguf-py packs each item on its own (a struct
format string built, a bytearray grown), which takes about a second for a Llama 3 vocabulary, while no tensor's bytes
can be placed before the metadata's size is known. An array of strings or of one numeric type is packed here in one
pass to the same bytes (each string its uint64 length and UTF-8 bytes; numbers little-endian, as ``struct`` packs them
one by one); anything else (a nested array, a big-endian file) is packed by gguf-py itself.
"""

from __future__ import annotations

import struct


def pack_field(writer, key: str, value) -> bytes:
    """One metadata field (``key``, a ``GGUFValue``) as ``writer`` packs it: the key, the value's type, the value."""
    gguf = _gguf()
    head = writer._pack_val(key, gguf.GGUFValueType.STRING, add_vtype=False)
    if value.type != gguf.GGUFValueType.ARRAY or writer.endianess != gguf.GGUFEndian.LITTLE:
        return head + writer._pack_val(value.value, value.type, add_vtype=True, sub_type=value.sub_type)
    packed = _pack_array(writer, value.value, value.sub_type)
    if packed is None:
        return head + writer._pack_val(value.value, value.type, add_vtype=True, sub_type=value.sub_type)
    return head + packed


def _pack_array(writer, values, sub_type) -> bytes | None:
    """An array field's type word and value as gguf-py packs it, or None where gguf-py is left to pack it."""
    from collections.abc import Sequence

    gguf = _gguf()
    kinds = gguf.GGUFValueType
    if not isinstance(values, Sequence) or len(values) == 0:
        return None  # gguf-py's own error
    if sub_type is not None:
        item_type = sub_type
    elif isinstance(values, bytes):
        item_type = kinds.UINT8
    else:
        item_type = kinds.get_type(values[0])
        # gguf-py asks each item's type; an item's answer depends on its class alone: one item of each class asked
        if not all(kinds.get_type(item) is item_type for item in dict(zip(map(type, values), values)).values()):
            return None  # gguf-py's own error
    head = struct.pack("<I", kinds.ARRAY) + struct.pack("<I", item_type) + struct.pack("<Q", len(values))
    if item_type == kinds.STRING:
        length = struct.Struct("<Q").pack
        encoded = [item.encode("utf-8") if isinstance(item, str) else item for item in values]
        return head + b"".join(part for item in encoded for part in (length(len(item)), item))
    code = writer._simple_value_packing.get(item_type)
    if code is None:
        return None  # arrays of arrays
    return head + struct.pack(f"<{len(values)}{code}", *values)


def write_kv_data_to_file(writer) -> None:
    """``writer.write_kv_data_to_file()``, the same bytes."""
    gguf = _gguf()
    if writer.state is not gguf.WriterState.HEADER:
        raise ValueError(f"Expected output file to contain the header, got {writer.state}")
    for out, fields in zip(writer.fout, writer.kv_data):
        out.write(b"".join(pack_field(writer, key, value) for key, value in fields.items()))
    writer.flush()
    writer.state = gguf.WriterState.KV_DATA


def _gguf():
    from .converter import converter

    gguf, _ = converter()
    return gguf

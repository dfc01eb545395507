"""Which ggml type each tensor of a GGUF gets when llama.cpp's ``llama-quantize IN OUT FTYPE`` quantizes it: a port of
``llama_tensor_get_type`` and what ``llama_model_quantize_impl`` does around it (src/llama-quant.cpp at the pinned
llama.cpp), as plain data.

- which tensors are quantized at all (``allows_quantization``: 2-D and 3-D weights, not norms, expert gates, ...);
- the file type's default type, then the mixture's rules (``_mixture``: attn_v, ffn_down, attn_output, output, the MoE
  and 70B rules, ``use_more_bits``), which count tensors across layers in the order llama-quantize visits them
  (``weight_order``: by layer, then by name);
- the fallback where a row is not a multiple of the type's block (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K and
  Q3_K -> Q4_0, IQ4_XS -> IQ4_NL; F16 where that does not divide either).

Shapes are ggml's ``ne`` (``ne[0]`` the row length), types ggml's names upper-cased ("Q4_K", "F16").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# llama-quantize's file types: name -> (enum llama_ftype, the default tensor type)
FILE_TYPES = {
    "F32": (0, "F32"),
    "F16": (1, "F16"),
    "Q4_0": (2, "Q4_0"),
    "Q4_1": (3, "Q4_1"),
    "Q8_0": (7, "Q8_0"),
    "Q5_0": (8, "Q5_0"),
    "Q5_1": (9, "Q5_1"),
    "Q2_K": (10, "Q2_K"),
    "Q3_K_S": (11, "Q3_K"),
    "Q3_K_M": (12, "Q3_K"),
    "Q3_K_L": (13, "Q3_K"),
    "Q4_K_S": (14, "Q4_K"),
    "Q4_K_M": (15, "Q4_K"),
    "Q5_K_S": (16, "Q5_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
    "IQ2_XXS": (19, "IQ2_XXS"),
    "IQ2_XS": (20, "IQ2_XS"),
    "Q2_K_S": (21, "Q2_K"),
    "IQ3_XS": (22, "IQ3_S"),
    "IQ3_XXS": (23, "IQ3_XXS"),
    "IQ1_S": (24, "IQ1_S"),
    "IQ4_NL": (25, "IQ4_NL"),
    "IQ3_S": (26, "IQ3_S"),
    "IQ3_M": (27, "IQ3_S"),
    "IQ2_S": (28, "IQ2_XS"),
    "IQ2_M": (29, "IQ2_S"),
    "IQ4_XS": (30, "IQ4_XS"),
    "IQ1_M": (31, "IQ1_M"),
    "BF16": (32, "BF16"),
    "TQ1_0": (36, "TQ1_0"),
    "TQ2_0": (37, "TQ2_0"),
    "MXFP4_MOE": (38, "MXFP4"),
}

# values per block of each ggml type a plan can name (ggml_blck_size)
BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32}
BLOCK |= {"MXFP4": 32, "Q2_0": 32}  # ggml's 32-value types
BLOCK |= dict.fromkeys(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "TQ1_0", "TQ2_0"), 256)
BLOCK |= dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"), 256)
FLOAT = frozenset({"F32", "F16", "BF16"})

_FALLBACK = dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL")
_FALLBACK |= dict.fromkeys(("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0"), "Q4_0")
_FALLBACK |= {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# the architectures llama.cpp counts as 70B (LLM_TYPE_70B) at a number of layers; llama's only with grouped KV heads
_70B_LAYERS = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}

# names (substrings) of 2-D weights llama-quantize keeps as they are
_KEPT = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    *(f"time_mix_{part}.weight" for part in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2")),
    *(f"time_mix_{part}.weight" for part in ("g1", "g2", "decay_w1", "decay_w2", "lerp_fused")),
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
_KEPT_GLM5_NEXT = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate")
_KEPT_GLM5_NEXT += ("indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight")
_KEPT_GLM5_NEXT += ("ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")

_LAYER = re.compile(rb"blk\.([+-]?\d+)")


@dataclass(frozen=True)
class Hparams:
    """What of the model's hyperparameters the plan reads (llama.cpp's ``llama_hparams``, layer 0's head counts)."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @classmethod
    def of(cls, fields: dict) -> "Hparams":
        """From a GGUF's metadata (key -> value): ``general.architecture`` and its ``{arch}.*`` counts."""
        arch = fields["general.architecture"]

        def first(key, default):
            value = fields.get(f"{arch}.{key}", default)
            return int(value[0] if isinstance(value, (list, tuple)) else value)

        n_head = first("attention.head_count", 0)
        return cls(
            arch,
            first("block_count", 0),
            n_head,
            first("attention.head_count_kv", n_head),
            first("expert_count", 0),
        )

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        if self.arch == "llama" and (self.n_expert == 8 or self.n_head == self.n_head_kv):
            return False
        return _70B_LAYERS.get(self.arch) == self.n_layer


@dataclass(frozen=True)
class Tensor:
    """One tensor of the input GGUF: its name, ``ne`` (ggml's order) and ggml type."""

    name: str
    ne: tuple
    type: str

    @property
    def n_dims(self) -> int:
        """``ggml_n_dims``: trailing dimensions of 1 do not count."""
        for index in range(len(self.ne) - 1, 0, -1):
            if self.ne[index] > 1:
                return index + 1
        return 1


def layer_of(name: str) -> int:
    """``sscanf(name, "blk.%d.", &layer)``'s layer, -1 where the name does not start so."""
    found = _LAYER.match(name.encode())
    return int(found.group(1)) if found else -1


def weight_order(names) -> list[str]:
    """The order llama-quantize visits (and writes) tensors in: ``weight_name_comparer``, by layer, then by name."""
    return sorted(names, key=lambda name: (layer_of(name), name.encode()))


def allows_quantization(tensor: Tensor, arch: str) -> bool:
    """``tensor_allows_quantization`` with llama-quantize's defaults (output quantized, nothing copied only)."""
    name = tensor.name
    if tensor.n_dims < 2 or not name.endswith("weight"):
        return False
    if any(part in name for part in _KEPT) or name in ("position_embd.weight", "token_types.weight"):
        return False
    return not (arch == "glm5-next" and any(part in name for part in _KEPT_GLM5_NEXT))


def category(name: str) -> str:
    """``tensor_get_category``."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, kind in (
        ("attn_qkv.weight", "attn_qkv"),
        ("attn_kv_b.weight", "attn_kv_b"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return kind
    return "other"


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    eighth = _div(n_layers, 8)
    return i_layer < eighth or i_layer >= _div(7 * n_layers, 8) or _mod(i_layer - eighth, 3) == 2


def _div(a: int, b: int) -> int:
    """C's integer division (toward zero)."""
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b > 0) else -quotient


def _mod(a: int, b: int) -> int:
    return a - b * _div(a, b)


class PlanError(ValueError):
    """What llama-quantize refuses of a model (a tensor whose layer it cannot tell, a type with no fallback)."""


class _State:
    """``quantize_state_impl``: the counters the rules keep across tensors."""

    def __init__(self, hparams: Hparams, names, has_imatrix: bool):
        self.hparams, self.has_imatrix = hparams, has_imatrix
        self.n_attention_wv = sum(category(name) in ("attn_v", "attn_qkv", "attn_kv_b") for name in names)
        self.tied = "output.weight" not in names
        self.n_ffn = hparams.n_layer
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0

    def layer(self, i_layer: int, name: str) -> tuple[int, int]:
        """``layer_info``: with experts, the layer is read from the name."""
        if max(1, self.hparams.n_expert) > 1:
            found = _LAYER.match(name.encode())
            if not found:
                raise PlanError(f"{name}: llama-quantize cannot tell this tensor's layer")
            i_layer = int(found.group(1))
            if not 0 <= i_layer < self.n_ffn:
                raise PlanError(f"{name}: layer {i_layer} is not in [0, {self.n_ffn})")
        return i_layer, self.n_ffn


IQ_LOW = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")


def _mixture(qs: _State, new_type: str, tensor: Tensor, ftype: str, kind: str) -> str:
    """``llama_tensor_get_type_impl``: the mixture's rules for one tensor."""
    hp, name, arch = qs.hparams, tensor.name, qs.hparams.arch
    if arch == "glm5-next" and any(part in name for part in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        if new_type not in FLOAT:
            return "Q8_0"
    if kind == "output" or (qs.tied and kind == "token_embd"):
        if ftype == "MXFP4_MOE" or arch == "falcon" or tensor.ne[0] % BLOCK[new_type]:
            return "Q8_0"
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
            return "Q5_K"
        return new_type if new_type == "Q8_0" else "Q6_K"
    if ftype == "MXFP4_MOE":
        expert_role = kind in ("ffn_up", "ffn_gate", "ffn_down")
        experts = len(tensor.ne) > 2 and tensor.ne[2] > 1
        return "MXFP4" if experts and (arch != "bailingmoe3" or expert_role) else "Q8_0"
    if kind == "token_embd":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        if ftype in ("TQ1_0", "TQ2_0", "Q2_0"):
            return "Q4_K"
        return new_type
    attn_v = kind in ("attn_v", "attn_qkv", "attn_kv_b")
    if ftype in IQ_LOW:
        iq_s = ftype in ("IQ2_S", "IQ2_M")
        if attn_v:
            if hp.n_gqa >= 4 or hp.n_expert >= 4:
                new_type = "Q4_K"
            else:
                new_type = "IQ3_S" if iq_s else "Q2_K"
            qs.i_attention_wv += 1
        elif hp.n_expert == 8 and kind == "attn_k":
            new_type = "Q4_K"
        elif kind == "ffn_down":
            if qs.i_ffn_down < _div(qs.n_ffn, 8):
                new_type = "IQ3_S" if iq_s else "Q2_K"
            qs.i_ffn_down += 1
        elif kind == "attn_output":
            if hp.n_expert == 8:
                new_type = "Q5_K"
            elif ftype in ("IQ1_S", "IQ1_M"):
                new_type = "IQ2_XXS"
            elif iq_s:
                new_type = "IQ3_S"
        return new_type
    if attn_v:
        return _attn_v(qs, new_type, ftype)
    if kind == "attn_k":
        if hp.n_expert == 8:
            return "Q8_0"
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ftype, new_type)
    if kind == "attn_q":
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ftype, new_type)
    if kind == "ffn_down":
        i_layer, n_layer = qs.layer(qs.i_ffn_down, name)
        new_type = _ffn_down(qs, new_type, ftype, i_layer, n_layer)
        qs.i_ffn_down += 1
        return new_type
    if kind == "attn_output":
        if arch != "falcon":
            if hp.n_expert == 8:
                eight = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S")
                if ftype in (*eight, "IQ3_M", "IQ4_XS"):
                    new_type = "Q5_K"
            else:
                rules = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}
                new_type = rules.get(ftype, new_type)
        elif ftype == "Q3_K_L":
            new_type = "Q4_K"
        return new_type
    if kind in ("ffn_gate", "ffn_up"):
        counter = "i_ffn_gate" if kind == "ffn_gate" else "i_ffn_up"
        i_layer, n_layer = qs.layer(getattr(qs, counter), name)
        if ftype == "IQ3_XS" and _div(n_layer, 8) <= i_layer < _div(7 * n_layer, 8):
            new_type = "IQ3_XXS"
        setattr(qs, counter, getattr(qs, counter) + 1)
    return new_type


def _attn_v(qs: _State, new_type: str, ftype: str) -> str:
    hp = qs.hparams
    gqa4 = hp.n_gqa >= 4
    if ftype == "Q2_K":
        new_type = "Q4_K" if gqa4 else "Q3_K"
    elif ftype == "Q2_K_S" and gqa4:
        new_type = "Q4_K"
    elif ftype == "IQ3_XXS":
        new_type = "Q4_K" if gqa4 else ("IQ3_S" if not qs.has_imatrix else "IQ3_XXS")
    elif ftype in ("IQ3_XS", "IQ3_S") and gqa4:
        new_type = "Q4_K"
    elif ftype == "IQ3_M":
        new_type = "Q4_K"
    elif ftype == "Q3_K_M":
        new_type = "Q5_K" if qs.i_attention_wv < 2 else "Q4_K"
    elif ftype == "Q3_K_L":
        new_type = "Q5_K"
    elif ftype in ("IQ4_NL", "IQ4_XS") and gqa4:
        new_type = "Q5_K"
    elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
        new_type = "Q6_K"
    elif ftype == "Q4_K_S" and qs.i_attention_wv < 4:
        new_type = "Q5_K"
    if hp.is_70b and new_type in ("Q3_K", "Q4_K"):
        new_type = "Q5_K"  # its attn_v is 8x smaller than attn_q: more bits cost little
    if hp.n_expert == 8:
        new_type = "Q8_0"
    qs.i_attention_wv += 1
    return new_type


def _ffn_down(qs: _State, new_type: str, ftype: str, i_layer: int, n_layer: int) -> str:
    hp, falcon = qs.hparams, qs.hparams.arch == "falcon"
    eighth = i_layer < _div(n_layer, 8)
    if ftype == "Q2_K":
        return "Q3_K"
    if ftype == "Q2_K_S":
        return "Q4_K" if eighth else new_type
    if ftype == "IQ3_XXS" and not qs.has_imatrix:
        return "Q4_K" if eighth else "Q3_K"
    if ftype == "Q3_K_M":
        if i_layer < _div(n_layer, 16):
            return "Q5_K"
        return "Q4_K" if not falcon or _use_more_bits(i_layer, n_layer) else "Q3_K"
    if ftype == "IQ3_M" and (eighth or (hp.n_expert == 8 and _use_more_bits(i_layer, n_layer))):
        return "Q4_K"
    if ftype == "Q3_K_L":
        return "Q4_K" if falcon else "Q5_K"
    if ftype == "Q4_K_M":
        if falcon:
            if i_layer < _div(n_layer, 16):
                return "Q6_K"
            return "Q5_K" if _use_more_bits(i_layer, n_layer) else "Q4_K"
        return "Q6_K" if _use_more_bits(i_layer, n_layer) else new_type
    if eighth and ftype in ("IQ4_NL", "IQ4_XS") and not qs.has_imatrix:
        return "Q5_K"
    if ftype == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
        return "Q6_K"
    if ftype == "Q4_K_S" and not falcon and eighth:
        return "Q5_K"
    if ftype in ("Q4_0", "Q5_0") and qs.has_imatrix and eighth:
        return "Q4_1" if ftype == "Q4_0" else "Q5_1"  # the first ffn_down layers go wild even with an imatrix
    return new_type


def _fallback(qs: _State, tensor: Tensor, target: str) -> str:
    """``tensor_type_fallback``: a type whose block divides the rows."""
    ncols, block = tensor.ne[0], BLOCK[target]
    if ncols % block == 0:
        return target
    qs.n_fallback += 1
    if target in _FALLBACK:
        chosen = _FALLBACK[target]
    elif block <= 32:
        chosen = target
    else:
        raise PlanError(f"{tensor.name}: llama-quantize has no fallback for type {target}")
    return "F16" if ncols % BLOCK[chosen] else chosen


def type_plan(tensors: list[Tensor], hparams: Hparams, ftype: str, has_imatrix: bool = False) -> dict[str, str]:
    """Each tensor's name -> the ggml type llama-quantize gives it for file type ``ftype`` (a ``FILE_TYPES`` name),
    the tensors taken in llama-quantize's order (``weight_order``), whatever order they are given in.

    Raises:
        PlanError: llama-quantize would refuse the model (a tensor's layer unknown, a type without fallback).
    """
    ftype = ftype.upper()
    if ftype not in FILE_TYPES:
        raise PlanError(f"file type {ftype!r} is not one of llama-quantize's: {', '.join(FILE_TYPES)}")
    default = FILE_TYPES[ftype][1]
    by_name = {tensor.name: tensor for tensor in tensors}
    ordered = [by_name[name] for name in weight_order(by_name)]
    qs = _State(hparams, list(by_name), has_imatrix)
    plan = {}
    for tensor in ordered:
        if not allows_quantization(tensor, hparams.arch):
            plan[tensor.name] = tensor.type
            continue
        new_type = default
        if default not in FLOAT:
            new_type = _mixture(qs, new_type, tensor, ftype, category(tensor.name))
            new_type = _fallback(qs, tensor, new_type)
        plan[tensor.name] = new_type
    return plan


def requires_imatrix(name: str, target: str, ftype: str) -> bool:
    """``tensor_requires_imatrix``: the types llama-quantize refuses to make without an importance matrix."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if target in ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"):
        return True
    return target == "Q2_K" and ftype.upper() == "Q2_K_S"

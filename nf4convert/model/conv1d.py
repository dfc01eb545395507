"""transformers' Conv1D layers (GPT-2 and its kin): which weights a dense checkpoint stores (in, out).

transformers' ``Conv1D`` holds its weight as (in_features, out_features), the transpose of ``nn.Linear``'s. When
transformers quantizes such a layer with bitsandbytes, 4-bit or 8-bit, it transposes the weight first
(``transformers/integrations/bitsandbytes.py``: ``if issubclass(module.source_cls, Conv1D): value = value.T``), so
the quantized checkpoint holds it (out, in) like a Linear's, and the dense checkpoint must hold it (in, out) again.
peft merges into a Conv1D weight with ``fan_in_fan_out`` (``peft_checks.validate`` tells it from the shapes).

The architectures of transformers that use ``Conv1D``, and their ``Conv1D`` modules (``pytorch_utils.Conv1D`` in
their modeling files; every other linear layer of theirs is an ``nn.Linear``). ``verify`` checks the rule against
the model transformers itself builds from the config, so a miss here is a verification failure, not a silent one.
"""

from __future__ import annotations

MODEL_TYPES = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp", "clvp_decoder")
MODULES = ("c_attn", "q_attn", "c_proj", "c_fc")


def _model_types(node) -> set:
    """Every ``model_type`` in a config, nested configs (an encoder-decoder's decoder, a text config) included."""
    found = set()
    if isinstance(node, dict):
        if isinstance(node.get("model_type"), str):
            found.add(node["model_type"])
        for value in node.values():
            found |= _model_types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _model_types(value)
    return found


def uses_conv1d(config: dict | None) -> bool:
    """Whether the model of this config.json has transformers' Conv1D layers."""
    return bool(_model_types(config or {}) & set(MODEL_TYPES))


def is_conv1d_weight(name: str, config: dict | None) -> bool:
    """Whether tensor ``name`` is the weight of a Conv1D layer in the model of ``config``."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in MODULES and uses_conv1d(config)

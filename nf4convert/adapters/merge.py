"""The merge of one LoRA target into its base tensor, bit for bit as peft merges it.

The reference is ``PeftModel.from_pretrained(dense, ADAPTER).merge_and_unload()`` (peft 0.21), where ``dense`` is
the dense checkpoint loaded in the output dtype. What that does, step by step, and what this module reproduces:

- Loading. Each targeted module gets LoRA parameters created in the base dtype, then ``autocast_adapter_dtype``
  (on by default) upcasts every fp16/bf16 adapter parameter to **fp32**, then ``load_state_dict`` copies the saved
  tensors into them. So whatever dtype the file stores, the LoRA factors, DoRA magnitudes and ``lora_B.bias`` are
  fp32 on the base weight's device when merging, and peft's "upcast bf16/fp16 to fp32 on the CPU" branch of
  ``get_delta_weight`` never runs. Saved keys that are not LoRA parameters (a ``modules_to_save`` module's weights,
  biases saved with ``bias="all"|"lora_only"``, an embedding's ``base_layer.weight`` saved with
  ``save_embedding_layers``) are copied into the base parameters: the saved tensor cast to the output dtype.
- ``scaling = lora_alpha / r``, or ``lora_alpha / math.sqrt(r)`` with rsLoRA, Python floats; ``r`` and
  ``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` (the first key, in file order, that matches the
  module path as ``(.*\\.)?(key)$``), else from ``r`` / ``lora_alpha``.
- Linear (``Linear.get_delta_weight`` and ``merge``): ``delta = transpose(B @ A, fan_in_fan_out) * scaling`` in
  fp32, then ``weight += delta``: an in-place add of an fp32 tensor into the bf16/fp16 weight, computed in fp32
  and rounded once. peft forces ``fan_in_fan_out`` to match the layer (True for GPT-2's ``Conv1D``, False for
  ``nn.Linear``) whatever the config says; without the model we read it from the base weight's shape (see
  ``peft_checks.validate`` for square weights).
- Embedding (``Embedding.get_delta_weight`` and ``merge``): ``delta = (B @ A).T * scaling`` in fp32, then
  ``weight += delta.to(weight.dtype)``: rounded to the output dtype *before* the add (twice rounded, unlike Linear).
- DoRA (``DoraLinearVariant.merge_unsafe``, ``DoraLinearLayer.get_weight_norm``): with ``delta`` as above,
  ``norm = linalg.norm(transpose(W, fifo) + 1 * transpose(delta, fifo), dim=1)`` (fp32, W the unmerged weight),
  ``factor = transpose((magnitude / norm).view(-1, 1), fifo)``, ``W' = (factor * (W + delta)).to(W.dtype)``.
  Embeddings: ``norm`` over ``W.T + 1 * delta.T``, ``factor = (magnitude / norm).view(1, -1)``.
- ``lora_bias``: ``bias += lora_B.bias * scaling`` (in place, fp32 compute).
- A parameter (``target_parameters``; ``ParamWrapper.get_delta_weight`` and ``merge``, ``peft_params.py`` says which
  parameter and how it is laid out): with ``A = lora_A.reshape(experts, rank, in)`` and
  ``B = lora_B.reshape(out, rank, experts)``, ``delta = einsum("o r e, e r i -> e i o", B, A) * scaling`` in fp32
  (``"... -> e o i"`` for a parameter that is not ``is_transposed``), then ``delta.to(weight.dtype)`` and
  ``weight += delta``: rounded to the output dtype *before* the add, as for embeddings.
- Trainable tokens (``trainable_token_indices``; ``TrainableTokensLayer.merge``): ``W.index_copy(0, indices,
  delta.to(W))``: the saved rows replace those rows of the embedding (or head), each cast once to the output dtype.
  A list names the input embeddings; on a tied model peft gives the head a token adapter tied to the embedding's
  (same rows, same values), a dict whose tied layers have other indices gives each its own.

Every step is the same torch op on tensors of the same shape, dtype and strides as peft's, on the same device,
so reductions (the matmul, the norm) run in the same order: the merge is bit for bit, not just close.
"""

from __future__ import annotations

from .lora import LoraTarget


def read_lora(target: LoraTarget, reader) -> dict:
    """The adapter tensors of one target, as stored (CPU tensors), read with a checkpoint.TensorReader."""
    return {role: reader.tensor(info) for role, info in target.tensors.items()}


def _transpose(weight, fan_in_fan_out: bool):
    return weight.T if fan_in_fan_out else weight  # peft.utils.other.transpose


ADD_BYTES = 1 << 24  # bytes of an fp32 delta added at a time in host memory


def _add_into(weight, delta, *, rounded_first: bool = False):
    """``weight += delta`` in place, ``delta`` cast to ``weight``'s dtype first where ``rounded_first`` (peft's
    Embedding and ParamWrapper merges), else added in fp32 and rounded once (Linear.merge). In host memory a run of
    rows at a time: the same elementwise arithmetic, without the whole-tensor copies torch makes on a CPU for an add
    of two dtypes (the sum in fp32) or for the cast."""
    if weight.device.type != "cpu" or weight.dim() == 0 or weight.shape[0] == 0:
        weight += delta.to(weight.dtype) if rounded_first else delta
        return weight
    rows = max(1, ADD_BYTES // max(1, 4 * weight[0].numel()))
    for first in range(0, weight.shape[0], rows):
        part = delta[first : first + rows]
        weight[first : first + rows] += part.to(weight.dtype) if rounded_first else part
    return weight


def merge(target: LoraTarget, base_weight, lora: dict, *, inplace: bool = False):
    """The merged tensor for ``target``: bit for bit what peft's ``merge_and_unload`` gives.

    ``base_weight`` is the dense base tensor in the output dtype on the conversion's device; ``lora`` holds the
    target's adapter tensors as stored (any device, any float dtype; see :func:`read_lora`). With ``inplace`` a
    plain LoRA delta is added into ``base_weight`` itself (saves a copy of a large embedding); otherwise
    ``base_weight`` is left as it was. The result has ``base_weight``'s dtype, shape and device. Peak memory:
    the weight plus one fp32 copy of it (the delta), and on a GPU the sum's fp32 copy too.

    Where this departs from peft's literal code it is only to save memory, with the same bits: an in-place
    ``mul_`` for ``x * scaling`` (the same elementwise kernel), ``x.mul_(factor)`` for ``factor * x``
    (IEEE multiplication commutes), no ``1 * x`` (exact, and its result has ``x``'s strides, so the norm
    reduces in the same order), and in host memory the delta added a run of rows at a time (``_add_into``).
    """
    import torch

    out_dtype, device = base_weight.dtype, base_weight.device

    def fp32(role):  # autocast_adapter_dtype: every adapter parameter is fp32 on the base weight's device
        return lora[role].to(device=device, dtype=torch.float32)

    if "base" in lora:
        # load_state_dict copies the saved tensor into the base parameter: a cast to its dtype
        weight = lora["base"].to(device=device, dtype=out_dtype)
        owned = weight is not lora["base"]
    else:
        weight, owned = base_weight, inplace

    def writable():
        return weight if owned else weight.clone()

    if target.kind == "replace":
        return writable()
    if target.kind == "tokens":  # TrainableTokensLayer.merge: a new tensor with the saved rows copied in
        index = torch.tensor(target.indices).to(device)
        return weight.index_copy(0, index, lora["trainable_tokens_delta"].to(weight))
    if target.kind == "bias":
        merged = writable()
        merged += fp32("lora_B.bias") * target.scaling  # not mul_: fp32() may return the caller's tensor
        return merged

    if target.kind == "param":  # the same einsum on the same shapes as peft's, so its reduction runs in its order
        lora_a, lora_b = fp32("lora_A"), fp32("lora_B")
        lora_a = lora_a.reshape(target.experts, -1, lora_a.shape[-1])
        lora_b = lora_b.reshape(lora_b.shape[0], -1, target.experts)
        equation = "o r e, e r i -> e i o" if target.transposed else "o r e, e r i -> e o i"
        delta = torch.einsum(equation, lora_b, lora_a) * target.scaling
        return _add_into(writable(), delta, rounded_first=True)

    if target.kind == "linear":
        fan_in_fan_out = target.fan_in_fan_out
        delta = _transpose(fp32("lora_B") @ fp32("lora_A"), fan_in_fan_out).mul_(target.scaling)
        if not target.use_dora:
            return _add_into(writable(), delta)  # Linear.merge: fp32 delta into the low-precision weight, one rounding
        # DoraLinearVariant.merge_unsafe; get_weight_norm gets the delta (scaling already in it) with scaling=1
        weight_sum = _transpose(weight, fan_in_fan_out) + _transpose(delta, fan_in_fan_out)
        weight_norm = torch.linalg.norm(weight_sum, dim=1).to(weight_sum.dtype)
        del weight_sum
        dora_factor = fp32("lora_magnitude_vector") / weight_norm
        dora_factor = _transpose(dora_factor.view(-1, 1), fan_in_fan_out)
        return delta.add_(weight).mul_(dora_factor).to(out_dtype)

    # embedding: Embedding.get_delta_weight is transpose(B @ A, True) * scaling
    delta = (fp32("lora_embedding_B") @ fp32("lora_embedding_A")).T.mul_(target.scaling)
    if not target.use_dora:
        return _add_into(writable(), delta, rounded_first=True)  # Embedding.merge casts the delta first, unlike Linear
    # DoraEmbeddingVariant.merge_unsafe: DoraEmbeddingLayer has fan_in_fan_out=True and gets delta.T
    weight_sum = weight.T + delta.T
    weight_norm = torch.linalg.norm(weight_sum, dim=1).to(weight_sum.dtype)
    del weight_sum
    dora_factor = (fp32("lora_magnitude_vector") / weight_norm).view(1, -1)
    return delta.add_(weight).mul_(dora_factor).to(out_dtype)

"""The LoRA merge against peft itself: merge() per tensor == PeftModel.from_pretrained(dense).merge_and_unload().

Each case builds a tiny seeded model (Llama-like, or GPT-2 for Conv1D's fan_in_fan_out), saves it in the output
dtype, makes a peft adapter of one kind, overwrites every saved adapter tensor with fresh random values (peft
initializes lora_B to zero, and saved replacements equal the base until changed), stores it in some dtype, and
compares every tensor of peft's merged model with ours, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from nf4convert.adapters import checks as peft_checks
from nf4convert.adapters import config as peft_config
from nf4convert.adapters import lora as peft_lora
from nf4convert.adapters import merge as peft_merge
from nf4convert.errors import CheckpointError
from nf4convert.safetensors_io.read import TensorReader

from fixtures.weights import bits

pytest.importorskip("peft")
warnings.filterwarnings("ignore", module="peft")
warnings.filterwarnings("ignore", module="transformers")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LLAMA = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA.update(vocab_size=97, tie_word_embeddings=False)
GPT2 = dict(n_embd=72, n_layer=2, n_head=4, n_positions=32, vocab_size=97)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# kind -> (model, LoraConfig arguments, stored adapter dtype)
KINDS = {
    "linear": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=ALL_LINEAR,
            rank_pattern={"q_proj": 6, "layers.1.mlp.down_proj": 3},
            alpha_pattern={"v_proj": 5},
        ),
        torch.float32,
    ),
    "rslora": (
        "llama",
        dict(
            r=3,
            lora_alpha=7,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "up_proj"],
            rank_pattern={"up_proj": 5},
        ),
        torch.bfloat16,
    ),
    "dora": (
        "llama",
        dict(r=4, lora_alpha=16, use_dora=True, target_modules=["q_proj", "k_proj", "down_proj"]),
        torch.float32,
    ),
    "embedding": ("llama", dict(r=5, lora_alpha=9, target_modules=["embed_tokens", "o_proj"]), torch.float16),
    "dora_embedding": (
        "llama",
        dict(r=3, lora_alpha=4, use_dora=True, target_modules=["embed_tokens", "gate_proj"]),
        torch.float32,
    ),
    "modules_to_save": (
        "llama",
        dict(r=2, lora_alpha=3, target_modules=["q_proj"], modules_to_save=["lm_head", "norm"]),
        torch.float32,
    ),
    # peft gives no LoRA layer to a module inside a saved one (down_proj in mlp): it saves the whole mlp instead
    "saved_ancestor": (
        "llama",
        dict(r=2, lora_alpha=3, target_modules=["q_proj", "down_proj"], modules_to_save=["mlp"]),
        torch.float32,
    ),
    "fan_in_fan_out": (
        "gpt2",
        dict(r=4, lora_alpha=6, fan_in_fan_out=True, target_modules=["c_attn", "c_proj", "c_fc"], bias="lora_only"),
        torch.bfloat16,
    ),
    "dora_fan_in_fan_out": (
        "gpt2",
        dict(r=3, lora_alpha=5, use_dora=True, fan_in_fan_out=True, target_modules=["c_attn", "c_fc"]),
        torch.float32,
    ),
    "lora_bias": (
        "gpt2",
        dict(r=4, lora_alpha=8, lora_bias=True, fan_in_fan_out=True, target_modules=["c_attn", "c_proj"]),
        torch.float32,
    ),
    # peft sets fan_in_fan_out from the layer class whatever the config says; square weights included
    "conv1d_config_false": ("gpt2", dict(r=4, lora_alpha=6, target_modules=["c_attn", "c_proj"]), torch.float16),
    "linear_config_true": (
        "llama",
        dict(r=4, lora_alpha=6, fan_in_fan_out=True, target_modules=["q_proj", "k_proj", "o_proj"]),
        torch.float32,
    ),
}
ONE_DTYPE = ("conv1d_config_false", "linear_config_true")
CASES = [(kind, dtype) for kind in KINDS for dtype in ("bf16", "fp16") if kind not in ONE_DTYPE or dtype == "bf16"]
CASES += [("linear", "fp32"), ("dora", "fp32")]


def _model(family: str):
    import transformers

    torch.manual_seed(1234)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(family, dtype name) -> a folder with the dense model saved in that dtype; made on first use."""
    root = tmp_path_factory.mktemp("dense")
    made = {}

    def get(family, dtype):
        if (family, dtype) not in made:
            folder = root / f"{family}-{dtype}"
            _model(family).to(DTYPES[dtype]).save_pretrained(folder)
            made[family, dtype] = folder
        return made[family, dtype]

    return get


def _randomize_adapter(folder: Path, stored_dtype, seed: int):
    """Fresh random values for every saved tensor, stored in ``stored_dtype``."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, saved in load_file(path).items():
        noise = torch.randn(saved.shape, generator=generator)
        if key.endswith("lora_magnitude_vector"):  # peft saved the norms; keep them positive and near
            value = saved.float() * (1 + 0.3 * noise.tanh())
        elif ".lora_" in key:
            value = 0.3 * noise / math.sqrt(saved.shape[-1])
        else:  # a replaced base tensor: must differ from the base to tell that peft (and we) took it
            value = saved.float() + 0.01 * noise
        tensors[key] = value.to(stored_dtype).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _make_adapter(tmp_path: Path, kind: str, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    family, arguments, stored_dtype = KINDS[kind]
    folder = tmp_path / f"adapter-{kind}"
    get_peft_model(_model(family), LoraConfig(**arguments)).save_pretrained(folder)
    # peft overwrote fan_in_fan_out in the config it saved with the last layer's class: keep what the user set
    _edit_config(folder, fan_in_fan_out=arguments.get("fan_in_fan_out", False))
    _randomize_adapter(folder, stored_dtype, seed)
    return folder


def _peft_merged(dense_folder: Path, adapter_folder: Path, dtype, device="cpu") -> dict:
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(dense_folder, dtype=dtype).to(device)
    merged = PeftModel.from_pretrained(model, adapter_folder).merge_and_unload()
    return {name: tensor.detach() for name, tensor in merged.state_dict().items()}


def _ours(dense_folder: Path, adapter_folder: Path, device="cpu") -> tuple[dict, dict]:
    from safetensors.torch import load_file

    base = load_file(dense_folder / "model.safetensors")
    shapes = {name: tuple(t.shape) for name, t in base.items()}
    adapter = peft_checks.validate(peft_lora.load_adapter(adapter_folder), shapes)
    reader = TensorReader()
    try:
        out = {}
        for name, tensor in base.items():
            target = adapter.targets.get(name)
            tensor = tensor.to(device)
            if target is None:
                out[name] = tensor
                continue
            lora = peft_merge.read_lora(target, reader)
            original = tensor.clone()
            out[name] = peft_merge.merge(target, tensor, lora)
            assert torch.equal(bits(tensor), bits(original)), f"{name}: merge() changed its input"
            in_place = peft_merge.merge(target, tensor, lora, inplace=True)
            assert torch.equal(bits(in_place), bits(out[name])), f"{name}: inplace=True gives other bits"
    finally:
        reader.close()
    return out, adapter.targets


def _compare(ours: dict, reference: dict, base_folder: Path, targets: dict):
    from safetensors.torch import load_file

    base = load_file(base_folder / "model.safetensors")
    assert targets and set(targets) <= set(ours)
    for name, tensor in ours.items():
        expected = reference[name]
        assert (tensor.dtype, tensor.shape, tensor.device) == (expected.dtype, expected.shape, expected.device), name
        differ = int((bits(tensor) != bits(expected)).sum())
        assert differ == 0, f"{name}: {differ} elements differ"
        changed = not torch.equal(bits(tensor.cpu()), bits(base[name]))
        assert changed == (name in targets), f"{name}: changed={changed}, targeted={name in targets}"


@pytest.mark.parametrize("kind,dtype", CASES)
def test_merge_matches_peft(kind, dtype, dense, tmp_path):
    seed = 7919 * (list(KINDS).index(kind) + 1) + list(DTYPES).index(dtype)
    adapter = _make_adapter(tmp_path, kind, seed)
    base_folder = dense(KINDS[kind][0], dtype)
    ours, targets = _ours(base_folder, adapter)
    _compare(ours, _peft_merged(base_folder, adapter, DTYPES[dtype]), base_folder, targets)

    kinds = {target.kind for target in targets.values()}
    expected_kinds = {
        "embedding": {"embedding", "linear"},
        "dora_embedding": {"embedding", "linear"},
        "lora_bias": {"linear", "bias"},
        "modules_to_save": {"linear", "replace"},
        "saved_ancestor": {"linear", "replace"},
        "fan_in_fan_out": {"linear", "replace"},
    }.get(kind, {"linear"})
    assert kinds == expected_kinds
    linear = [t for t in targets.values() if t.kind == "linear"]
    assert all(t.fan_in_fan_out == (KINDS[kind][0] == "gpt2") for t in linear)
    if kind == "embedding":  # peft saved the embedding's base weight (save_embedding_layers) and loads it
        assert "base" in targets["model.embed_tokens.weight"].tensors


@pytest.mark.parametrize("kind", ["linear", "fan_in_fan_out", "embedding", "rslora"])
def test_merge_in_runs_of_rows_matches_peft(kind, dense, tmp_path, monkeypatch):
    """On a CPU the delta is added a run of rows at a time (the run's size from ADD_BYTES); one row a run gives
    peft's bits too."""
    monkeypatch.setattr(peft_merge, "ADD_BYTES", 1)
    adapter = _make_adapter(tmp_path, kind, 104729)
    base_folder = dense(KINDS[kind][0], "bf16")
    ours, targets = _ours(base_folder, adapter)
    _compare(ours, _peft_merged(base_folder, adapter, DTYPES["bf16"]), base_folder, targets)


def test_patterns_and_scaling(tmp_path):
    folder = _make_adapter(tmp_path, "linear", 11)
    assert peft_lora.load_adapter(folder).base_model_name_or_path is None
    _edit_config(folder, base_model_name_or_path="org/model-bnb-4bit")
    adapter = peft_lora.load_adapter(folder)
    assert adapter.base_model_name_or_path == "org/model-bnb-4bit"
    q = adapter.targets["model.layers.1.self_attn.q_proj.weight"]
    v = adapter.targets["model.layers.0.self_attn.v_proj.weight"]
    down0 = adapter.targets["model.layers.0.mlp.down_proj.weight"]
    down1 = adapter.targets["model.layers.1.mlp.down_proj.weight"]
    assert (q.rank, q.alpha, q.scaling) == (6, 8, 8 / 6)
    assert (v.rank, v.alpha, v.scaling) == (4, 5, 5 / 4)
    assert (down0.rank, down1.rank, down1.scaling) == (4, 3, 8 / 3)
    rs = peft_lora.load_adapter(_make_adapter(tmp_path, "rslora", 12)).targets
    assert rs["model.layers.0.mlp.up_proj.weight"].scaling == 7 / math.sqrt(5)
    assert rs["model.layers.0.self_attn.q_proj.weight"].scaling == 7 / math.sqrt(3)


def test_merge_is_sensitive_to_rounding(tmp_path, dense):
    """Rounding the delta to bf16 before adding (as peft does for embeddings, not for linear layers) changes
    bits: the comparisons above tell the two apart."""
    adapter_folder = _make_adapter(tmp_path, "linear", 13)
    ours, targets = _ours(dense("llama", "bf16"), adapter_folder)
    adapter = peft_lora.load_adapter(adapter_folder)
    reader = TensorReader()
    from safetensors.torch import load_file

    base = load_file(dense("llama", "bf16") / "model.safetensors")
    differing = 0
    for name, target in adapter.targets.items():
        lora = peft_merge.read_lora(target, reader)
        delta = (lora["lora_B"].float() @ lora["lora_A"].float()) * target.scaling
        differing += int((bits(base[name] + delta.to(torch.bfloat16)) != bits(ours[name])).sum())
    reader.close()
    assert differing > 0


def test_config_defaults_are_peft_defaults():
    from peft import LoraConfig

    fields = dataclasses.fields(LoraConfig)
    defaults = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default) for f in fields}
    for name, value in peft_config.CONFIG_DEFAULTS.items():
        assert defaults[name] == value, name
    for name, is_set in peft_config.UNSUPPORTED_VARIANTS.items():
        assert not is_set(defaults[name]), name


# Error cases: one line naming the file and tensor or option.


def _error(call) -> str:
    with pytest.raises(CheckpointError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def linear_adapter(tmp_path_factory):
    return _make_adapter(tmp_path_factory.mktemp("linear"), "linear", 17)


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _edit_config(folder: Path, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit):
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _base_shapes():
    return {name: tuple(t.shape) for name, t in _model("llama").state_dict().items()}


def test_other_peft_types(tmp_path):
    from peft import IA3Config, get_peft_model

    folder = tmp_path / "ia3"
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(_model("llama"), config).save_pretrained(folder)
    assert "peft_type is 'IA3'" in _error(lambda: peft_lora.load_adapter(folder))
    for peft_type in ("LOHA", "LOKR", "VERA", "PROMPT_TUNING", "ADALORA"):
        _edit_config(folder, peft_type=peft_type)
        assert f"peft_type is '{peft_type}'" in _error(lambda: peft_lora.load_adapter(folder))
    assert "missing" in _error(lambda: peft_lora.load_adapter(tmp_path / "nowhere"))


def test_unsupported_configs(linear_adapter, tmp_path):
    folder = _copy(linear_adapter, tmp_path)
    for change, words in (
        (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights is 'pissa_niter_4'"),
        (dict(init_lora_weights="olora"), "init_lora_weights is 'olora'"),
        (dict(layer_replication=[[0, 2]]), "layer_replication is set"),
        # peft reads any layers_to_transform but null and [] as a restriction: an int is one layer, 0 and false too
        (dict(layers_to_transform=0), "layers_to_transform is set (0)"),
        (dict(layers_to_transform=False), "layers_to_transform is set (False)"),
        (dict(layers_pattern="layers"), "layers_pattern without layers_to_transform: peft refuses"),
        (
            dict(target_modules="model.*q_proj", layers_to_transform=[]),
            "layers_to_transform with a target_modules pattern",
        ),
        (dict(monteclora_config={}), "monteclora_config is set"),  # peft makes {} a MontecloraConfig
        (dict(velora_config=False), "velora_config is set"),  # peft: "must be a VeloraConfig, a dict, or None"
        # values peft fails on when loading
        (dict(modules_to_save="lm_head"), "modules_to_save is 'lm_head', not a list of module names"),
        (dict(modules_to_save=[3]), "modules_to_save is [3]"),
        (dict(modules_to_save=["q_proj("]), "modules_to_save entry 'q_proj(' is not a valid pattern"),
        (dict(bias=1), "bias is 1"),
        (dict(bias="some"), "bias is 'some'"),
        (dict(init_lora_weights=3), "init_lora_weights is 3"),
        (dict(init_lora_weights="uniform"), "init_lora_weights is 'uniform'"),
        (dict(use_dora="yes"), "use_dora is 'yes'"),
        (dict(r=5), "rank 5"),
        (dict(rank_pattern={"q_proj(": 2}), "not a valid regular expression"),
        (dict(lora_alpha="8"), "lora_alpha for"),
    ):
        _edit_config(folder, **json.loads((linear_adapter / "adapter_config.json").read_text()))
        _edit_config(folder, **change)
        message = _error(lambda: peft_lora.load_adapter(folder))
        assert words in message and "adapter_config.json" in message, change
    # what peft reads as unset, or as a plain LoRA, merges
    for change in (
        dict(layers_to_transform=[], layers_pattern="layers"),
        dict(exclude_modules=[], bias="lora_only"),
        dict(init_lora_weights="Gaussian"),
        dict(init_lora_weights="orthogonal"),
        dict(megatron_config={}),
        dict(init_lora_weights=0),
        dict(init_lora_weights=""),
        dict(modules_to_save=["lm_head", "mlp\\.x"]),
    ):
        _edit_config(folder, **json.loads((linear_adapter / "adapter_config.json").read_text()))
        _edit_config(folder, **change)
        assert peft_lora.load_adapter(folder).targets, change


def test_lora_under_a_saved_module(linear_adapter, tmp_path):
    # peft matches each modules_to_save entry as a pattern on whole path components (check_target_module_exists) and
    # gives no LoRA layer to a module in or under a saved one: its LoRA tensors would be unused, so they are refused
    folder = _copy(linear_adapter, tmp_path)
    for saved, words in (
        (["mlp"], r"mlp\.\w+_proj' has LoRA tensors and lies in 'mlp' of modules_to_save too"),
        ([r"layers\.1"], r"layers\.1\.\S+' has LoRA tensors and lies in 'layers\\\.1' of"),
        (["q_pro."], r"self_attn\.q_proj' has LoRA tensors and lies in 'q_pro\.' of"),
        (["o_proj"], r"self_attn\.o_proj' has LoRA tensors and is in modules_to_save too"),
    ):
        _edit_config(folder, modules_to_save=saved)
        message = _error(lambda: peft_lora.load_adapter(folder))
        assert re.search(words, message) and "adapter_model.safetensors" in message, (saved, message)


def _rename_lora(folder: Path, module: str, renames: dict):
    _edit_tensors(
        folder,
        lambda t: t.update(
            {
                f"base_model.model.{module}.{new}": t.pop(f"base_model.model.{module}.{old}")
                for old, new in renames.items()
            }
        ),
    )


def test_lora_tensors_of_the_other_layer_kind(linear_adapter, tmp_path, dense):
    # peft makes the LoRA layer that the module's class calls for and loads only its own kind of tensors: the others
    # are unexpected keys, and the module merges unchanged. Shapes alone fit here (q_proj is square).
    folder = _copy(linear_adapter, tmp_path)
    _rename_lora(
        folder,
        "model.layers.0.self_attn.q_proj",
        {"lora_A.weight": "lora_embedding_A", "lora_B.weight": "lora_embedding_B"},
    )
    base_folder = dense("llama", "bf16")
    config = json.loads((base_folder / "config.json").read_text())  # q_proj's class, from transformers' model
    message = _error(lambda: peft_checks.validate(peft_lora.load_adapter(folder), _base_shapes(), config=config))
    assert "'model.layers.0.self_attn.q_proj' are embedding-style (lora_embedding_A/B)" in message
    assert "is a Linear/Conv1D layer of the base model" in message
    message = _error(
        lambda: peft_checks.validate(peft_lora.load_adapter(folder), _base_shapes())
    )  # no config: no model
    assert "is not named like an embedding, and transformers cannot build the model from its config.json" in message
    from safetensors.torch import load_file

    merged = _peft_merged(base_folder, folder, torch.bfloat16)
    base = load_file(base_folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(bits(merged[name]), bits(base[name]))  # peft: unchanged
    assert not torch.equal(
        bits(merged["model.layers.1.self_attn.q_proj.weight"]), bits(base[name.replace(".0.", ".1.")])
    )

    folder = _make_adapter(
        tmp_path / "e", "embedding", 19
    )  # embed_tokens [97, 72]: lora_A [5, 97] fits it as (in, out)
    _rename_lora(
        folder, "model.embed_tokens", {"lora_embedding_A": "lora_A.weight", "lora_embedding_B": "lora_B.weight"}
    )
    message = _error(lambda: peft_checks.validate(peft_lora.load_adapter(folder), _base_shapes()))
    assert "'model.embed_tokens' are linear-style (lora_A/B)" in message and "is an embedding layer" in message
    merged = _peft_merged(base_folder, folder, torch.bfloat16)
    saved = load_file(folder / "adapter_model.safetensors")["base_model.model.model.embed_tokens.base_layer.weight"]
    assert torch.equal(bits(merged["model.embed_tokens.weight"]), bits(saved.to(torch.bfloat16)))  # no delta

    # "all-linear" gives embeddings no LoRA layer at all
    folder = _make_adapter(tmp_path / "a", "embedding", 23)
    _edit_config(folder, target_modules="all-linear")
    assert "which target_modules 'all-linear' does not name" in _error(lambda: peft_lora.load_adapter(folder))


def test_the_layer_kind_rule_refuses_only_what_it_knows():
    # embeddings are not all named like embed_tokens (openai-gpt's tokens_embed, CTRL's w): embedding-style LoRA on
    # such a name was refused, where peft merges it; the model's own class decides, and where it is unknown (a
    # remote-code model) the adapter is refused, not merged where peft might load nothing
    Target = type("Target", (), {})

    def target(kind, module):
        made = Target()
        made.kind, made.module = kind, module
        return made

    classes = {"transformer.tokens_embed": torch.nn.Embedding, "transformer.h.0.attn.c_attn": torch.nn.Linear}
    module_class = classes.get
    assert not peft_checks._other_kind(target("embedding", "transformer.tokens_embed"), module_class)
    assert peft_checks._other_kind(target("embedding", "transformer.h.0.attn.c_attn"), module_class)
    assert peft_checks._other_kind(target("embedding", "transformer.unknown"), module_class)  # no model: nothing tells
    assert peft_checks._other_kind(target("linear", "model.embed_tokens"), module_class)  # by name, no model asked
    assert not peft_checks._other_kind(target("linear", "transformer.h.0.attn.c_attn"), module_class)
    assert not peft_checks._other_kind(target("embedding", "model.embed_tokens"), lambda module: 1 / 0)  # not asked


def test_shape_mismatch(linear_adapter, tmp_path):
    folder = _copy(linear_adapter, tmp_path)
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(40, 4)}))
    message = _error(lambda: peft_checks.validate(peft_lora.load_adapter(folder), _base_shapes()))
    assert key in message and "[40, 4]" in message and "[36, 72]" in message


def test_rank_mismatch_between_factors(linear_adapter, tmp_path):
    folder = _copy(linear_adapter, tmp_path)
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(3, 72)}))
    assert key in _error(lambda: peft_lora.load_adapter(folder))


def test_target_missing_from_base(linear_adapter):
    shapes = _base_shapes()
    del shapes["model.layers.1.mlp.up_proj.weight"]
    message = _error(lambda: peft_checks.validate(peft_lora.load_adapter(linear_adapter), shapes))
    assert "'model.layers.1.mlp.up_proj.weight', which the base checkpoint does not have" in message
    # an adapter trained on the bare LlamaModel, against a causal LM checkpoint
    bare = {name.removeprefix("model."): shape for name, shape in _base_shapes().items()}
    message = _error(lambda: peft_checks.validate(peft_lora.load_adapter(linear_adapter), bare))
    assert "was the adapter trained on another model class" in message


def test_extra_keys(linear_adapter, tmp_path):
    folder = _copy(linear_adapter, tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight"
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(4, 72)}))
    assert key in _error(lambda: peft_lora.load_adapter(folder))

    folder = _copy(linear_adapter, tmp_path / "b")
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"  # lora_B stays
    _edit_tensors(folder, lambda t: t.pop(key))
    assert "has no lora_A" in _error(lambda: peft_lora.load_adapter(folder))

    folder = _copy(linear_adapter, tmp_path / "c")
    key = "base_model.model.model.layers.0.self_attn.q_proj.weight"  # peft only reads base_layer.weight there
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(72, 72)}))
    assert key in _error(lambda: peft_lora.load_adapter(folder))

    folder = _copy(linear_adapter, tmp_path / "d")
    key = "base_model.model.model.layers.0.mystery.weight"
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(3)}))
    assert key in _error(lambda: peft_checks.validate(peft_lora.load_adapter(folder), _base_shapes()))

    folder = _copy(linear_adapter, tmp_path / "e")
    key = "model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_tensors(folder, lambda t: t.update({key: torch.randn(6, 72)}))
    assert key in _error(lambda: peft_lora.load_adapter(folder))


def test_truncated_adapter_file(linear_adapter, tmp_path):
    folder = _copy(linear_adapter, tmp_path)
    path = folder / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert "truncated" in _error(lambda: peft_lora.load_adapter(folder))
    path.write_bytes(data[:50])
    assert str(path) in _error(lambda: peft_lora.load_adapter(folder))
    (folder / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json" in _error(lambda: peft_lora.load_adapter(folder))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in ONE_DTYPE])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_merge_matches_peft_cuda(kind, dtype, dense, tmp_path):
    seed = 104729 + list(KINDS).index(kind)
    adapter = _make_adapter(tmp_path, kind, seed)
    base_folder = dense(KINDS[kind][0], dtype)
    ours, targets = _ours(base_folder, adapter, device="cuda")
    _compare(ours, _peft_merged(base_folder, adapter, DTYPES[dtype], device="cuda"), base_folder, targets)

"""push_to_hub with the real huggingface_hub and hf_xet clients, against a local stand-in of the Hub
(tests/fixtures/fake_hub.py) that checks and keeps every byte it receives.

HF_ENDPOINT is read when huggingface_hub is imported, so each push runs in a subprocess with its own environment
(its own HF_HOME too, so that nothing is read from or written to the user's Hub cache or login).
"""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.fake_hub import GITATTRIBUTES, READ_TOKEN, WRITE_TOKEN, Fault, client_env, closed_port, serve


@pytest.fixture
def hub():
    with serve() as (endpoint, state):
        yield endpoint, state


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], rng: random.Random) -> bytes:
    """A safetensors file with random (never zero) contents: 8-byte header length, JSON header, data."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = itemsize[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = rng.randbytes(offset).replace(b"\x00", b"\x01")
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A small converted folder: two shards (several Xet chunks each, odd sizes), index, config, README."""
    from nf4convert.sinks.card import model_card

    rng = random.Random(20240613)
    folder = tmp_path_factory.mktemp("converted") / "tiny-llama-bf16"
    folder.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": ("BF16", [331, 397]),
            "model.layers.0.self_attn.q_proj.weight": ("BF16", [127, 331]),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.0.mlp.down_proj.weight": ("BF16", [331, 211]),
            "model.norm.weight": ("F32", [331]),
            "lm_head.weight": ("BF16", [97, 331]),
        },
    }
    for name, tensors in shards.items():
        (folder / name).write_bytes(safetensors_bytes(tensors, rng))
    weight_map = {tensor: name for name, tensors in shards.items() for tensor in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}))
    source_card = "---\nbase_model: meta-llama/Llama-3.2-1B\ntags:\n- unsloth\n- bitsandbytes\n- 4-bit\n---\n# Tiny\n"
    card = model_card(
        source_card,
        source_repo="test-org/tiny-llama-bnb-4bit",
        dtype="bf16",
        version="0.1.0",
        quant_format="bnb-4bit nf4",
    )
    (folder / "README.md").write_text(card.text, encoding="utf-8")
    return folder


PUSH = """
import json, sys
from huggingface_hub import HfApi
from huggingface_hub.utils import are_progress_bars_disabled
from nf4convert.errors import UploadError
from nf4convert.hub.upload import push_to_hub

upload_folder, seen = HfApi.upload_folder, {}
def watched_upload_folder(self, **kwargs):  # the real upload, noting whether progress bars were off during it
    seen["bars_off_during"] = are_progress_bars_disabled()
    return upload_folder(self, **kwargs)
HfApi.upload_folder = watched_upload_folder

args = dict(arg.split("=", 1) for arg in sys.argv[3:])
try:
    url = push_to_hub(sys.argv[1], sys.argv[2], private=args.get("private") == "1", token=args.get("token"),
                      revision=args.get("revision"), progress=args.get("progress") != "0")
except UploadError as error:
    print(f"Error: {error}", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"url": url, **seen, "bars_off_after": are_progress_bars_disabled()}))
"""


def push(folder, repo_id, *, endpoint, home, xet=True, **options):
    env = client_env(
        endpoint,
        home,
        HF_XET_XORB_COMPRESSION_POLICY="none",  # the stand-in reads chunks as they are (see fake_hub.py)
        HF_XET_CLIENT_RETRY_MAX_ATTEMPTS="1",
        HF_XET_CLIENT_RETRY_BASE_DELAY="100ms",  # fail fast, not in minutes
    )
    if not xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    args = [f"{key}={value}" for key, value in options.items() if value is not None]
    return subprocess.run(
        [sys.executable, "-c", PUSH, str(folder), repo_id, *args], capture_output=True, text=True, env=env, timeout=90
    )


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("xet,progress", [(True, "0"), (False, "1")], ids=["xet", "lfs"])
def test_push_puts_every_file_on_the_new_branch(hub, converted, tmp_path, xet, progress):
    if xet:
        pytest.importorskip("hf_xet")  # huggingface_hub installs it on x86-64 and arm64 only
    endpoint, state = hub
    result = push(
        converted,
        "me/tiny-llama-bf16",
        endpoint=endpoint,
        home=tmp_path / "home",
        xet=xet,
        token=WRITE_TOKEN,
        private="1",
        revision="dense-bf16",
        progress=progress,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["url"] == f"{endpoint}/me/tiny-llama-bf16/tree/dense-bf16"
    assert report["bars_off_during"] == (progress == "0") and report["bars_off_after"] is False

    repo = state.repos["me/tiny-llama-bf16"]
    assert repo["private"] is True
    expected = files_of(converted)
    assert repo["branches"]["dense-bf16"] == {".gitattributes": GITATTRIBUTES, **expected}  # byte for byte
    assert repo["branches"]["main"] == {".gitattributes": GITATTRIBUTES}  # the default branch untouched
    [commit] = state.commits
    assert commit["revision"] == "dense-bf16"
    # the weights went through the object store (Xet or LFS), never inline in the commit
    weights = {path for path in expected if path.endswith(".safetensors")}
    assert {path for path, how in commit["files"].items() if how == "object"} == weights
    assert bool(state.xorbs) == xet
    api = "POST /api/models/me/tiny-llama-bf16"
    assert state.requests.index(f"{api}/branch/dense-bf16") < state.requests.index(f"{api}/commit/dense-bf16")

    # Pushing again (an interrupted push is resumed the same way) sends no weights, commits nothing, changes nothing.
    before = len(state.requests)
    again = push(
        converted,
        "me/tiny-llama-bf16",
        endpoint=endpoint,
        home=tmp_path / "home",
        xet=xet,
        token=WRITE_TOKEN,
        private="1",
        revision="dense-bf16",
        progress=progress,
    )
    assert again.returncode == 0, again.stderr
    assert len(state.commits) == 1 and repo["branches"]["dense-bf16"] == {".gitattributes": GITATTRIBUTES, **expected}
    assert not [r for r in state.requests[before:] if r.startswith(("POST /cas/v1/xorbs/", "PUT /lfs-objects/"))]


def test_push_to_main_of_an_existing_repo(hub, converted, tmp_path):
    endpoint, state = hub
    state.add_repo("me/existing", private=False)
    state.repos["me/existing"]["branches"]["main"]["old.txt"] = b"kept"
    result = push(converted, "me/existing", endpoint=endpoint, home=tmp_path / "home", token=WRITE_TOKEN)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["url"] == f"{endpoint}/me/existing"
    main = state.repos["me/existing"]["branches"]["main"]
    assert main == {".gitattributes": GITATTRIBUTES, "old.txt": b"kept", **files_of(converted)}
    assert not [r for r in state.requests if "/branch/" in r]


@pytest.mark.parametrize("case", ["401", "403", "404", "refused", "storage-refused", "public"])
def test_push_errors_are_one_line_with_their_cause(hub, converted, tmp_path, case):
    endpoint, state = hub
    state.add_repo("me/public-model", private=False)
    options = {"token": WRITE_TOKEN}
    repo_id, expected = "me/tiny-llama-bf16", []
    if case == "401":
        options["token"] = "hf_not_a_token"
        expected = ["HTTP 401", "token was rejected", "Invalid credentials in Authorization header"]
    elif case == "403":
        repo_id, options["token"] = "me/public-model", READ_TOKEN
        expected = ["HTTP 403", "write access", "the token is read-only"]
    elif case == "404":
        options["revision"] = "refs/pr/9"
        expected = ["HTTP 404", "revision not found", "Invalid rev id: refs/pr/9"]
    elif case == "refused":
        port = closed_port()
        endpoint = f"http://127.0.0.1:{port}"
        expected = [f"connection refused by 127.0.0.1:{port}"]
    elif case == "storage-refused":  # the Hub answers, hf_xet cannot reach the storage it is sent to
        pytest.importorskip("hf_xet")
        port = closed_port()
        state.cas_url = f"http://127.0.0.1:{port}"
        expected = [f"network error with 127.0.0.1:{port}"]
    elif case == "public":
        repo_id, options["private"] = "me/public-model", "1"
        expected = ["exists and is public", "nothing was uploaded"]

    result = push(converted, repo_id, endpoint=endpoint, home=tmp_path / "home", **options)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {repo_id}: "), result.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    assert not state.commits and not state.objects


@pytest.mark.parametrize("case", ["401", "read-only", "refused"])
def test_a_push_the_hub_would_refuse_is_said_before_anything_is_converted(hub, tmp_path, case):
    # a bad token, a read-only one or a Hub out of reach was found only once the whole model was converted
    endpoint, state = hub
    token = {"401": "hf_not_a_token", "read-only": READ_TOKEN}.get(case, WRITE_TOKEN)
    expected = {"401": "HTTP 401", "read-only": "the token is read-only; nothing was converted"}
    if case == "refused":
        port = closed_port()
        endpoint, expected[case] = f"http://127.0.0.1:{port}", f"connection refused by 127.0.0.1:{port}"
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", str(example), "-o", str(out), "--device", "cpu", "-q"]
        + ["--push-to-hub", "me/tiny", "--token", token],
        capture_output=True,
        text=True,
        env=client_env(endpoint, tmp_path / "home", HF_HUB_DISABLE_XET="1"),
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: me/tiny: "), result.stderr
    assert expected[case] in lines[0], lines[0]
    assert not out.exists() and not state.repos.get("me/tiny")


def test_push_refuses_a_missing_or_empty_folder_without_asking_the_hub(hub, tmp_path):
    from nf4convert.errors import UploadError
    from nf4convert.hub.upload import push_to_hub

    endpoint, state = hub
    (tmp_path / "empty").mkdir()
    for folder, message in [(tmp_path / "missing", "no such folder"), (tmp_path / "empty", "the folder is empty")]:
        with pytest.raises(UploadError, match=message):
            push_to_hub(folder, "me/x", token=WRITE_TOKEN)
    assert not state.requests


@pytest.mark.parametrize(
    "repo_id, branch, message",
    [
        ("me/x", "0123456789abcdef0123456789abcdef01234567", "is a commit"),
        ("me/x.", None, "Repo id must use alphanumeric chars"),
        ("me/" + "x" * 97, None, "maximum length is 96"),
        ("me/x", "", "not a name git allows"),
        ("me/x", "bad..branch~", "not a name git allows"),
        ("me/x", "-x", "not a name git allows"),
        ("me/x", "a.lock", "not a name git allows"),
        ("me/x", "HEAD", "not a name git allows"),
        ("me/x", None, "HF_HUB_OFFLINE is set"),
    ],
)
def test_a_push_that_cannot_happen_is_refused_before_any_work(hub, tmp_path, repo_id, branch, message, monkeypatch):
    # each was found only after the whole conversion, as an upload failure (exit 1)
    from nf4convert.errors import ArgumentError
    from nf4convert.hub.upload import push_to_hub

    endpoint, state = hub
    if "OFFLINE" in message:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ArgumentError, match=message):
        push_to_hub(tmp_path / "out", repo_id, revision=branch, token=WRITE_TOKEN)
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    env = client_env(endpoint, tmp_path / "home", **({"HF_HUB_OFFLINE": "1"} if "OFFLINE" in message else {}))
    options = ["--push-branch", branch] if branch is not None else []
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nf4convert",
            str(example),
            "-o",
            str(tmp_path / "cli"),
            "-q",
            "--push-to-hub",
            repo_id,
            *options,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "cli").exists() and not state.requests


def test_cli_converts_verifies_then_pushes(hub, tmp_path):
    """nf4convert SOURCE --verify --push-to-hub: the finished, verified folder goes up, model card and all."""
    endpoint, state = hub
    root = Path(__file__).resolve().parents[1]
    example, out = root / "examples" / "tiny-llama-bnb-4bit", tmp_path / "out"
    # client_env puts this tree first on PYTHONPATH and keeps the rest (bitsandbytes may be found only there)
    env = client_env(endpoint, tmp_path / "home", HF_XET_XORB_COMPRESSION_POLICY="none", HF_HUB_DISABLE_XET="1")
    command = [
        sys.executable,
        "-m",
        "nf4convert",
        str(example),
        "-o",
        str(out),
        "--device",
        "cpu",
        "-q",
        "--verify",
        "--push-to-hub",
        "me/tiny-llama-bf16",
        "--private",
        "--token",
        WRITE_TOKEN,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (
        "OK: bit-exact with the CPU reference of bitsandbytes' CUDA arithmetic" in result.stdout
        and f"pushed to {endpoint}/me/tiny-llama-bf16" in result.stdout
    )
    repo = state.repos["me/tiny-llama-bf16"]
    assert repo["private"] is True and repo["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **files_of(out)}
    assert "How these weights were made" in files_of(out)["README.md"].decode()
    # --private without --push-to-hub is a usage error, before any work.
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", str(example), "--private"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2 and "go with --push-to-hub" in result.stderr


@pytest.mark.parametrize("branch", [None, "dense"])
def test_a_failed_push_says_the_output_is_kept_and_how_to_push_it_again(hub, tmp_path, branch):
    # the one line said why the upload failed, not that the converted folder stays nor how to push it
    endpoint, state = hub
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    out = tmp_path / "my out"
    env = client_env(endpoint, tmp_path / "home", HF_HUB_DISABLE_XET="1")
    options = ["--push-branch", branch] if branch else []
    state.upload_faults = [Fault("status", file="commit", status=403, times=99)]  # refused once the output is made
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", str(example), "-o", str(out), "--device", "cpu", "-q"]
        + ["--push-to-hub", "me/tiny", "--private", "--token", WRITE_TOKEN, *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    state.upload_faults = []
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and "me/tiny: upload failed: HTTP 403" in lines[0], lines
    again = f"hf upload me/tiny '{out}' ." + (f" --revision {branch}" if branch else "") + " --private"
    assert lines[0].endswith(f"; {out} is complete and kept; push it again with: {again}"), lines[0]
    assert (out / "model.safetensors").is_file() and not state.commits


def test_a_private_push_to_a_public_repo_is_refused_before_any_work(hub, tmp_path):
    # hf upload --private leaves an existing public repo public: it is no way to push again there
    endpoint, state = hub
    state.add_repo("me/public", private=False)
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", str(example), "-o", str(out), "--device", "cpu", "-q"]
        + ["--push-to-hub", "me/public", "--private", "--token", WRITE_TOKEN],
        capture_output=True,
        text=True,
        env=client_env(endpoint, tmp_path / "home", HF_HUB_DISABLE_XET="1"),
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0] == (
        "Error: me/public: the repository exists and is public; nothing was converted (make it private on the Hub "
        "first, or push without --private)"
    )
    assert not out.exists()  # found before any work


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    """The example converted twice: fp32 in one model.safetensors, bf16 in three shards with their index."""
    from nf4convert import convert

    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    root = tmp_path_factory.mktemp("outputs")
    single = convert(str(example), root / "fp32", dtype="fp32", device="cpu", progress=False).output
    sharded = convert(
        str(example), root / "bf16", dtype="bf16", device="cpu", max_shard_size="3MB", progress=False
    ).output
    assert "model.safetensors" in files_of(single) and "model.safetensors.index.json" in files_of(sharded)
    return {"fp32": single, "bf16-sharded": sharded}


@pytest.mark.parametrize(
    "first,second,xet",
    [("fp32", "bf16-sharded", True), ("bf16-sharded", "fp32", False)],
    ids=["single-then-sharded-xet", "sharded-then-single-lfs"],
)
def test_a_second_push_leaves_only_the_new_weights(hub, two_outputs, tmp_path, first, second, xet):
    if xet:
        pytest.importorskip("hf_xet")
    endpoint, state = hub
    state.add_repo("me/tiny", private=False)
    main = state.repos["me/tiny"]["branches"]["main"]
    kept = {
        "original/consolidated.00.pth": b"the owner's, in a subfolder",
        "tiny.Q4_K_M.gguf": b"read only when named",
        "notes.txt": b"not weights",
    }
    stale = {
        "pytorch_model.bin": b"an old copy",
        "adapter_config.json": b"{}",
        "adapter_model.safetensors": b"x",
        "weights [old].pt": b"a name that is a pattern",
    }
    main.update(kept | stale)

    for folder in (two_outputs[first], two_outputs[second]):
        before = len(state.commits)
        result = push(folder, "me/tiny", endpoint=endpoint, home=tmp_path / "home", xet=xet, token=WRITE_TOKEN)
        assert result.returncode == 0, result.stderr
        assert main == {".gitattributes": GITATTRIBUTES, **kept, **files_of(folder)}  # nothing else of the weights
        deleted = {
            path for commit in state.commits[before:] for path, how in commit["files"].items() if how == "deleted"
        }
        assert (
            deleted == set(stale)
            if folder == two_outputs[first]
            else set(files_of(two_outputs[first])) - set(files_of(folder))
        )
        # the deletions ride the first commit: no commit holds deletions alone, before the new files are there
        assert all(how != "deleted" for commit in state.commits[before + 1 :] for how in commit["files"].values())
        assert any(how != "deleted" for how in state.commits[before]["files"].values())
    loaded = json.loads(main["config.json"])
    assert loaded["dtype"] == {"fp32": "float32", "bf16-sharded": "bfloat16"}[second]


def test_stale_weights_are_the_root_weight_files_the_folder_lacks(tmp_path):
    from nf4convert.hub.upload import stale_weights

    (tmp_path / "model.safetensors").write_bytes(b"new")
    repo = [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tf_model.h5",
        "flax_model.msgpack",
        "pytorch_model.bin.index.json",
        "consolidated.pth",
        "adapter_config.json",
        "sub/model.safetensors",
        "model.gguf",
        "model.ckpt",
        "config.json",
        "README.md",
        "MODEL.SAFETENSORS",
    ]
    assert stale_weights(repo, tmp_path) == [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tf_model.h5",
        "flax_model.msgpack",
        "pytorch_model.bin.index.json",
        "consolidated.pth",
        "adapter_config.json",
    ]


def test_cli_converts_an_mxfp4_checkpoint_verifies_then_pushes(hub, tmp_path):
    """gpt-oss's MXFP4 experts: converted, verified against transformers, pushed with its card."""
    from fixtures import float_checkpoints as fc

    endpoint, state = hub
    source, out = fc.build_mxfp4(tmp_path / "tiny-gpt-oss"), tmp_path / "out"
    env = client_env(endpoint, tmp_path / "home", HF_XET_XORB_COMPRESSION_POLICY="none", HF_HUB_DISABLE_XET="1")
    command = [sys.executable, "-m", "nf4convert", str(source), "-o", str(out), "--device", "cpu", "-q", "--verify",
               "--push-to-hub", "me/tiny-gpt-oss-bf16", "--token", WRITE_TOKEN]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "OK: bit-exact with transformers" in result.stdout and "pushed to" in result.stdout, result.stdout
    repo = state.repos["me/tiny-gpt-oss-bf16"]
    assert repo["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **files_of(out)}
    assert "MXFP4 (OCP microscaling FP4)" in files_of(out)["README.md"].decode()

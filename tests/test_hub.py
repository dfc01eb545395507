"""The real huggingface_hub client against a small local endpoint that serves a repo the Hub's way.

HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_CACHE are read when huggingface_hub is imported, so each
case runs the CLI in a subprocess with its own environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from fixtures.checkpoints import _configs, build

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "test-org/tiny-llama-bnb-4bit"
GATED = "test-org/gated-bnb-4bit"
DENSE, GPTQ, FP16_WEIGHTS, ADAPTER = "test-org/dense", "test-org/gptq-4bit", "test-org/fp16w-8bit", "test-org/lora"


class FakeHub(BaseHTTPRequestHandler):
    repos: dict[str, dict[str, bytes]] = {}  # repo id -> its files
    requested: list[str] = []
    ranges: list[tuple[str, str, int, int]] = []  # (repo, file, first byte, end) of each range read
    range_answer = "206"  # or "whole" (a server that ignores ranges), "whole-later" (past byte 0), "no-content-range"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status, body=b"", headers=None, head=False):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, payload):
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _route(self, head):
        path = unquote(urlparse(self.path).path)
        self.requested.append(f"{'RANGE' if self.headers.get('Range') else self.command} {path}")
        if path.startswith((f"/api/models/{GATED}/", f"/{GATED}/")):
            return self._send(
                401,
                b"gated",
                {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted"},
                head,
            )
        for repo, files in self.repos.items():
            if path.startswith(f"/api/models/{repo}/revision/"):
                return self._json(
                    {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
                )
            if path.startswith(f"/api/models/{repo}/tree/"):
                return self._json(
                    [
                        {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in files.items()
                    ]
                )
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix) :].split("/", 1)[1]
                if name in files:
                    data = files[name]
                    headers = {
                        "X-Repo-Commit": COMMIT,
                        "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                        "Content-Type": "application/octet-stream",
                    }
                    wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                    whole = self.range_answer == "whole" or (
                        self.range_answer == "whole-later" and wanted and wanted[1] != "0"
                    )
                    if (
                        wanted and not head and not whole
                    ):  # as the Hub answers a range: 206, the bytes, their place, the size
                        first, last = int(wanted[1]), min(int(wanted[2]), len(data) - 1)
                        self.ranges.append((repo, name, first, last + 1))
                        if self.range_answer == "no-content-range":
                            return self._send(206, data[first : last + 1], headers)
                        return self._send(
                            206,
                            data[first : last + 1],
                            {**headers, "Content-Range": f"bytes {first}-{last}/{len(data)}"},
                        )
                    return self._send(200, data, headers, head)
                return self._send(404, b"no entry", {"X-Error-Code": "EntryNotFound"}, head)
        return self._send(
            404, b"not found", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, head
        )

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)


def downloaded(repo: str) -> list[str]:
    """The files of ``repo`` that were downloaded whole (GET without a range), in order."""
    prefix = f"GET /{repo}/resolve/"
    return [r[len(prefix) :].split("/", 1)[1] for r in FakeHub.requested if r.startswith(prefix)]


def lora_adapter(folder: Path, base: str) -> dict[str, bytes]:
    """The files of a peft LoRA adapter for the test Llama whose config names ``base``, plus a config.json of a dense
    model beside it (some adapter repos carry their base's): an adapter SOURCE all the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_configs()["llama"]())
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")}
    return {**files, "config.json": json.dumps(_configs()["llama"]().to_dict()).encode()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    source = build(tmp_path_factory.mktemp("hubrepo") / "repo", "llama-nf4-dq")
    files = {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    files["pytorch_model.bin"] = b"old weights that must not be downloaded"
    files["original/consolidated.pth"] = b"neither these"
    config = json.loads(files["config.json"])
    dense_config = {key: value for key, value in config.items() if key != "quantization_config"}
    weights = {name: data for name, data in files.items() if name.endswith(".safetensors")}  # stand-ins: never fetched
    fp16_weights = {
        **config["quantization_config"],
        "load_in_4bit": False,
        "load_in_8bit": True,
        "_load_in_4bit": False,
        "_load_in_8bit": True,
        "llm_int8_has_fp16_weight": True,
    }  # as transformers writes it
    FakeHub.repos = {
        REPO: files,
        DENSE: {"config.json": json.dumps(dense_config).encode(), **weights},
        GPTQ: {  # a quant_method no registered format reads
            "config.json": json.dumps({**config, "quantization_config": {"quant_method": "hqq", "nbits": 4}}).encode(),
            **weights,
        },
        FP16_WEIGHTS: {"config.json": json.dumps({**config, "quantization_config": fp16_weights}).encode(), **weights},
        ADAPTER: lora_adapter(tmp_path_factory.mktemp("adapter"), base=REPO),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", source
    server.shutdown()


def cli(*args, env, cwd, patch=""):
    """The CLI in a process of its own; ``patch``: Python run first in it (module constants changed for a test)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), full_env.get("PYTHONPATH", "")])
    command = (
        ["-m", "nf4convert.cli.commands"]
        if not patch
        else ["-c", f"import sys\n{patch}\nfrom nf4convert.cli.commands import main\nmain(sys.argv[1:])"]
    )
    return subprocess.run(
        [sys.executable, *command, *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=600
    )


def test_download_convert_then_offline(hub, tmp_path):
    endpoint, source = hub
    cache = tmp_path / "cache"
    FakeHub.requested.clear()
    result = cli(
        REPO,
        "-q",
        "--download",
        "--cache-dir",
        cache,
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "tiny-llama-bf16"
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    fetched = downloaded(REPO)
    assert fetched and not [f for f in fetched if f.endswith((".bin", ".pth"))]  # only what conversion needs
    assert "Fetching" not in result.stderr and "%|" not in result.stderr  # -q: huggingface_hub's bars too

    # Offline, from the cache alone (the endpoint is not even reachable).
    verify = cli(
        "verify",
        out,
        REPO,
        "--cache-dir",
        cache,
        env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"},
        cwd=tmp_path,
    )
    assert verify.returncode == 0 and "OK: bit-exact" in verify.stdout, verify.stderr
    again = cli(REPO, "-q", "-o", "offline-out", "--cache-dir", cache, env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "offline-out" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("route", ["streamed", "--download"])
@pytest.mark.parametrize(
    "repo,env,message",
    [
        ("test-org/missing-bnb-4bit", {}, "repository not found on the Hub"),
        (GATED, {}, "gated repository"),
        (REPO, {"HF_HUB_OFFLINE": "1"}, "not in the Hub cache"),
    ],
)
def test_hub_errors_are_one_line(hub, tmp_path, repo, env, message, route):
    endpoint, _ = hub
    result = cli(
        repo,
        "-q",
        *([route] if route != "streamed" else []),
        "--cache-dir",
        tmp_path / "empty-cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", **env},
        cwd=tmp_path,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip() and "kernels-community" not in line]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.stderr


@pytest.mark.parametrize("case", ["refused", "offline"])
def test_a_repo_the_cache_lacks_says_why_the_hub_was_not_reached(tmp_path, case):
    # a refused HF_ENDPOINT was reported as "offline (HF_HUB_OFFLINE is set or there is no network)"
    from fixtures.fake_hub import closed_port

    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", **({"HF_HUB_OFFLINE": "1"} if case == "offline" else {})}
    for extra in ([], ["--dry-run"]):
        result = cli(REPO, "-q", "--cache-dir", tmp_path / "empty-cache", *extra, env=env, cwd=tmp_path)
        lines = error_lines(result)
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        why = (
            f"the Hub at {endpoint} could not be reached: connection refused by {endpoint.removeprefix('http://')} "
            "(is the endpoint right, and the server up?)"
            if case == "refused"
            else "HF_HUB_OFFLINE is set, so the Hub was not asked"
        )
        assert lines[0] == f"Error: {REPO}: not in the Hub cache, and {why}", lines[0]


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip() and "kernels-community" not in line]


def test_q_hides_the_download_bars_and_the_library_puts_them_back(hub, tmp_path):
    endpoint, _ = hub
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
    shown = cli(REPO, "--dry-run", "--cache-dir", tmp_path / "cache-1", env=env, cwd=tmp_path)
    assert shown.returncode == 0 and "Fetching" in shown.stderr, shown.stderr  # without -q, huggingface_hub's bar
    quiet = cli(REPO, "--dry-run", "-q", "--cache-dir", tmp_path / "cache-2", env=env, cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr.strip() == "", quiet.stderr

    # convert(progress=False) turns huggingface_hub's bars off for the call only
    script = (
        "import json, sys; from huggingface_hub.utils import are_progress_bars_disabled; import nf4convert; "
        "nf4convert.convert(sys.argv[1], 'out', device='cpu', progress=False, cache_dir=sys.argv[2]); "
        "print(json.dumps(are_progress_bars_disabled()))"
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | env
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), full_env.get("PYTHONPATH", "")])
    library = subprocess.run(
        [sys.executable, "-c", script, REPO, str(tmp_path / "cache-3")],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=tmp_path,
        timeout=600,
    )
    assert library.returncode == 0, library.stderr
    assert json.loads(library.stdout) is False and "Fetching" not in library.stderr, library.stderr


@pytest.mark.parametrize("route", ["streamed", "--download"])
def test_revision_is_for_hub_repos_and_the_card_records_it(hub, tmp_path, route):
    endpoint, source = hub
    local = tmp_path / "local-bf16"
    assert cli(source, "-q", "-o", local, env={}, cwd=tmp_path).returncode == 0
    for args in [(source, "-o", tmp_path / "never"), ("verify", local, source), (source, "--dry-run")]:
        result = cli(*args, "--revision", "v2", env={}, cwd=tmp_path)
        lines = error_lines(result)
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert (
            lines[0].startswith(f"Error: {source}: a local folder has no revisions; revision 'v2'")
            and "--revision" in lines[0]
        )
    assert not (tmp_path / "never").exists()

    out = tmp_path / "from-hub"
    result = cli(
        REPO,
        "-q",
        *([route] if route != "streamed" else []),
        "--revision",
        "v2",
        "-o",
        out,
        "--cache-dir",
        tmp_path / "cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    card = (out / "README.md").read_text()
    assert f"a bitsandbytes 4-bit NF4 checkpoint (revision `v2`, commit `{COMMIT}`)" in card
    assert f"nf4convert {REPO} --revision v2 --dtype bf16 -o from-hub\n" in card


@pytest.mark.parametrize(
    "repo,says",
    [
        (DENSE, "config.json has no quantization_config"),
        (GPTQ, "quant_method 'hqq', which nf4convert does not read"),
        (FP16_WEIGHTS, "saved with llm_int8_has_fp16_weight=True, so its weights are dense fp16 already"),
    ],
)
def test_a_hub_repo_that_is_not_bitsandbytes_is_refused_before_its_weights(hub, tmp_path, repo, says):
    endpoint, _ = hub
    FakeHub.requested.clear()
    result = cli(
        repo,
        "-q",
        "--cache-dir",
        tmp_path / "cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: {repo}: not a checkpoint nf4convert reads: ")
    assert says in lines[0], lines[0]
    assert downloaded(repo) == ["config.json"]  # not the weights
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_a_local_checkpoint_saved_with_fp16_weights_says_why_it_has_nothing_to_convert(hub, tmp_path):
    """transformers saves a model loaded with llm_int8_has_fp16_weight=True as dense fp16 weights beside a
    bitsandbytes quantization_config: made here from a dense conversion and that config."""
    _, source = hub
    folder = tmp_path / "fp16w-8bit"
    assert cli(source, "-q", "--dtype", "fp16", "-o", folder, env={}, cwd=tmp_path).returncode == 0
    config = json.loads(FakeHub.repos[FP16_WEIGHTS]["config.json"])
    for has_fp16_weight, says in [
        (True, "saved with llm_int8_has_fp16_weight=True"),
        (False, "no quantized weights of a format nf4convert reads"),
    ]:
        config["quantization_config"]["llm_int8_has_fp16_weight"] = has_fp16_weight
        (folder / "config.json").write_text(json.dumps(config))
        result = cli(folder, "-q", "-o", tmp_path / "out", env={}, cwd=tmp_path)
        lines = error_lines(result)
        assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"Error: {folder}: "), result.stderr
        assert says in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


# compressed-tensors FP8 config groups (settings of the weights) that no format reads: each refused in the words of
# the format whose group it is, locally and before a Hub repo's weights are fetched.
CT_FP8_UNREAD = {
    "strategy-group": (
        {"strategy": "group", "group_size": 32},
        "quantizes FP8 weights by strategy 'group', not read yet",
    ),
    "asymmetric": ({"symmetric": False}, "quantizes FP8 weights asymmetrically (with zero points), not read yet"),
    "block-structure": ({"block_structure": [32]}, "has block_structure [32], not two positive integers"),
    "4-bit": ({"num_bits": 4}, "quantizes 4-bit float weights, not read yet"),
    "strategy-token": ({"strategy": "token"}, "quantizes FP8 weights by strategy 'token', not read yet"),
}


@pytest.fixture(scope="module")
def ct_fp8(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from fixtures import float_checkpoints as fc

    return fc.build_compressed(tmp_path_factory.mktemp("ct-fp8") / "ct-fp8", "qwen3-ct-fp8-block")


@pytest.mark.parametrize("case", list(CT_FP8_UNREAD))
def test_a_compressed_tensors_fp8_group_not_read_is_refused_in_its_formats_words(hub, ct_fp8, tmp_path, case):
    endpoint, _ = hub
    settings, says = CT_FP8_UNREAD[case]
    folder = tmp_path / f"ct-fp8-{case}"
    shutil.copytree(ct_fp8, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(settings)
    (folder / "config.json").write_text(json.dumps(config))
    local = cli(folder, "-q", "-o", tmp_path / "out", env={}, cwd=tmp_path)
    repo = f"test-org/{folder.name}"
    FakeHub.repos[repo] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    FakeHub.requested.clear()
    try:
        env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
        remote = cli(repo, "-q", "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path)
    finally:
        del FakeHub.repos[repo]
    begins = {"remote": f"Error: {repo}: not a checkpoint nf4convert reads: ", "local": f"Error: {folder}: "}
    for route, result in (("remote", remote), ("local", local)):
        lines = error_lines(result)
        assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(begins[route]), result.stderr
        assert f"config group 'group_0' {says}" in lines[0], (route, lines[0])
    assert downloaded(repo) == ["config.json"] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("route", ["streamed", "--download"])
def test_an_adapter_repo_as_source_is_resolved_to_its_base(hub, tmp_path, route):
    """Its config.json (a dense model's) does not make it refused: its adapter_config.json names the base, which is
    checked and fetched (its weights streamed, or downloaded)."""
    endpoint, _ = hub
    FakeHub.requested.clear()
    FakeHub.ranges.clear()
    out = tmp_path / "merged"
    result = cli(
        ADAPTER,
        "-q",
        *([route] if route != "streamed" else []),
        "-o",
        out,
        "--cache-dir",
        tmp_path / "cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "adapter_model.safetensors" in downloaded(ADAPTER) and "model.safetensors.index.json" in downloaded(REPO)
    weights_downloaded = "model-00001-of-00004.safetensors" in downloaded(REPO)
    assert weights_downloaded == (route == "--download") and bool(FakeHub.ranges) == (route == "streamed")
    assert f"[{ADAPTER}](https://huggingface.co/{ADAPTER}) was then merged" in (out / "README.md").read_text()


# Limits small enough for the test repo: its headers are over 1 KiB (a second request each), and its quant states are
# fetched one range each, not merged with their neighbours.
SMALL_LIMITS = "import nf4convert.hub.ranges as hub; hub._FIRST_BYTES = 1024; hub._GAP_BYTES = 0"


def plan_lines(result) -> list[str]:
    """A dry run's lines but where it names the source and output, and the free space (which moves meanwhile)."""
    return [
        line
        for line in result.stdout.splitlines()
        if not line.startswith(("source:", "weights:", "output:", "to write:"))
    ]


def test_a_hub_dry_run_reads_headers_and_quant_states_and_downloads_no_weights(hub, tmp_path):
    from nf4convert.formats.base import plan_reads
    from nf4convert.safetensors_io.read import read_header

    endpoint, source = hub
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", "TMPDIR": str(scratch)}
    local = cli(source, "--dry-run", "-q", "-o", tmp_path / "out", env={}, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    FakeHub.requested.clear()
    FakeHub.ranges.clear()
    remote = cli(
        REPO,
        "--dry-run",
        "-q",
        "-o",
        tmp_path / "out",
        "--cache-dir",
        tmp_path / "cache",
        env=env,
        cwd=tmp_path,
        patch=SMALL_LIMITS,
    )
    assert remote.returncode == 0, remote.stderr
    assert plan_lines(remote) == plan_lines(local)  # the same plan: tensors, recipes, shards, side files
    assert remote.stdout.splitlines()[0] == (
        f"source: {REPO}@{COMMIT[:12]} (its headers and quant states read from the Hub; no weights downloaded)"
    )
    assert not [name for name in downloaded(REPO) if name.endswith(".safetensors")]
    weights = sorted(name for name in FakeHub.repos[REPO] if name.endswith(".safetensors"))
    for name in weights:  # each file's header (its first 1 KiB), and beyond it only the tensors a plan reads
        tensors, _ = read_header(source / name)
        header_end = min(t.begin for t in tensors.values())
        reads = [(first, end) for repo, file, first, end in FakeHub.ranges if repo == REPO and file == name]
        covered = 0
        for first, end in sorted(reads):
            covered = max(covered, end) if first <= covered else covered
        assert covered >= header_end, (name, reads)
        wanted = [t for t in tensors.values() if plan_reads().search(t.name)]
        for first, end in reads:
            assert end <= max(header_end, 1024) or all(
                any(t.begin <= byte < t.end for t in wanted) for byte in (first, end - 1)
            ), (name, first, end)
        assert sum(end - first for first, end in reads) <= max(header_end, 1024) + sum(t.nbytes for t in wanted), (
            name,
            reads,
        )
    assert not list(scratch.iterdir()) and not (tmp_path / "out").exists()  # the copy removed, nothing written

    # The plan reads only what was fetched: with the quant states left out, the dry run stops (never reads zeros).
    tight = cli(
        REPO,
        "--dry-run",
        "-q",
        "--cache-dir",
        tmp_path / "cache",
        env=env,
        cwd=tmp_path,
        patch=SMALL_LIMITS + "; hub.PLAN_TENSOR_BYTES = 16",
    )
    lines = error_lines(tight)
    assert tight.returncode == 1 and len(lines) == 1, tight.stderr
    assert (
        lines[0].startswith(f"Error: {REPO}@{COMMIT[:12]}/")
        and "a dry run reads only headers and quant states" in lines[0]
    ), lines[0]
    assert str(scratch) not in lines[0] and not list(scratch.iterdir())

    # A conversion with --download after it downloads the weights; a dry run then plans from the cache, with no range
    # read.
    done = cli(
        REPO, "-q", "--download", "-o", tmp_path / "from-hub", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "model-00001-of-00004.safetensors" in downloaded(REPO)
    FakeHub.ranges.clear()
    again = cli(
        REPO, "--dry-run", "-q", "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path
    )
    assert again.returncode == 0 and plan_lines(again) == plan_lines(local), again.stderr
    snapshot = tmp_path / "cache" / f"models--test-org--tiny-llama-bnb-4bit/snapshots/{COMMIT}"
    assert again.stdout.startswith(f"source: {REPO}@{COMMIT[:12]} (from the Hub cache: {snapshot})\n")
    assert not FakeHub.ranges


def test_a_hub_dry_run_names_a_corrupt_header_by_the_repo(hub, tmp_path):
    endpoint, _ = hub
    files = dict(FakeHub.repos[REPO])
    name = "model-00002-of-00004.safetensors"
    files[name] = files[name][:8] + b"#" + files[name][9:]  # its header is not JSON
    FakeHub.repos["test-org/corrupt-bnb-4bit"] = files
    try:
        result = cli(
            "test-org/corrupt-bnb-4bit",
            "--dry-run",
            "-q",
            "--cache-dir",
            tmp_path / "cache",
            env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
            cwd=tmp_path,
        )
    finally:
        del FakeHub.repos["test-org/corrupt-bnb-4bit"]
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: test-org/corrupt-bnb-4bit@{COMMIT[:12]}/{name}: corrupt safetensors header"), (
        lines[0]
    )


def test_a_dry_run_of_an_adapter_repo_reads_its_bases_headers(hub, tmp_path):
    endpoint, _ = hub
    FakeHub.requested.clear()
    result = cli(
        ADAPTER,
        "--dry-run",
        "-q",
        "--cache-dir",
        tmp_path / "cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"source: {REPO}@{COMMIT[:12]} (its headers"), result.stdout
    assert "merged" in result.stdout, result.stdout
    assert "adapter_model.safetensors" in downloaded(ADAPTER)  # an adapter is read whole
    assert not [name for name in downloaded(REPO) if name.endswith(".safetensors")]


def test_an_offline_dry_run_plans_from_the_cache(hub, tmp_path):
    endpoint, _ = hub
    cache = tmp_path / "cache"
    assert (
        cli(
            REPO,
            "-q",
            "--download",
            "-o",
            tmp_path / "out",
            "--cache-dir",
            cache,
            env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
            cwd=tmp_path,
        ).returncode
        == 0
    )
    result = cli(REPO, "--dry-run", "-q", "--cache-dir", cache, env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    snapshot = cache / f"models--test-org--tiny-llama-bnb-4bit/snapshots/{COMMIT}"  # weights and all
    assert result.stdout.startswith(f"source: {REPO}@{COMMIT[:12]} (from the Hub cache: {snapshot})\n"), result.stdout


@pytest.mark.parametrize(
    "answer,says",
    [
        ("whole", "the Hub answered a request for bytes 0-99999 with status 200 and not the range (the whole file?)"),
        (
            "whole-later",
            "with status 200 and not the range (the whole file?): a dry run needs range requests; convert instead",
        ),
        ("no-content-range", "the Hub answered a request for bytes 0-99999 with no Content-Range"),
    ],
)
def test_a_dry_run_refuses_an_endpoint_that_does_not_answer_ranges_in_one_line(hub, tmp_path, answer, says):
    endpoint, _ = hub
    FakeHub.range_answer = answer
    try:
        result = cli(
            REPO,
            "--dry-run",
            "-q",
            "--cache-dir",
            tmp_path / "cache",
            env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
            cwd=tmp_path,
        )
    finally:
        FakeHub.range_answer = "206"
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: {REPO}: model-0000"), lines[0]
    assert says in lines[0], lines[0]


def test_a_dry_run_reads_only_the_files_the_plan_reads(hub, tmp_path):
    """Weight files beside the index's series (a consolidated copy, a subfolder's) are not the checkpoint's: the plan
    never reads them, so neither does a dry run (junk there fails neither)."""
    endpoint, _ = hub
    FakeHub.repos["test-org/extra-bnb-4bit"] = {
        **FakeHub.repos[REPO],
        "consolidated.safetensors": b"junk",
        "extra/other.safetensors": b"junk",
    }
    FakeHub.ranges.clear()
    try:
        result = cli(
            "test-org/extra-bnb-4bit",
            "--dry-run",
            "-q",
            "--cache-dir",
            tmp_path / "cache",
            env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
            cwd=tmp_path,
        )
    finally:
        del FakeHub.repos["test-org/extra-bnb-4bit"]
    assert result.returncode == 0, result.stderr
    assert {file for _, file, _, _ in FakeHub.ranges} == {
        name for name in FakeHub.repos[REPO] if name.endswith(".safetensors")
    }


def test_a_dry_run_without_room_for_its_copy_says_so_in_one_line(hub, tmp_path):
    endpoint, source = hub
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", "TMPDIR": str(tmp_path)}
    full = (
        "import errno, tempfile\nmade = tempfile.mkdtemp\ndef mkdtemp(*args, **kwargs):\n"
        "    if kwargs.get('prefix') == 'nf4convert-plan-':\n"
        "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    return made(*args, **kwargs)\ntempfile.mkdtemp = mkdtemp"
    )  # the dry run's copy finds the disk full
    assert (
        cli(source, "--dry-run", "-q", env=env, cwd=tmp_path, patch=full).returncode == 0
    )  # a local folder needs none
    result = cli(REPO, "--dry-run", "-q", "--cache-dir", tmp_path / "cache", env=env, cwd=tmp_path, patch=full)
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0] == (
        f"Error: {tmp_path}: cannot hold a dry run's copy of {REPO}'s headers (No space left on device); "
        "set TMPDIR to a writable folder"
    ), lines[0]


def test_a_batch_dry_run_of_hub_repos_downloads_no_weights(hub, tmp_path):
    endpoint, source = hub
    FakeHub.requested.clear()
    FakeHub.ranges.clear()
    result = cli(
        "batch",
        REPO,
        source,
        "-o",
        tmp_path / "root",
        "--dry-run",
        "-q",
        "--json",
        "--cache-dir",
        tmp_path / "cache",
        env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["status"] for row in rows] == ["planned", "planned"] and rows[0]["tensors"] == rows[1]["tensors"]
    assert not [name for name in downloaded(REPO) if name.endswith(".safetensors")] and FakeHub.ranges
    assert not (tmp_path / "root").exists()


def test_a_dry_run_plans_from_the_cache_only_when_it_holds_every_weight_file(hub, tmp_path):
    """A repo without an index: the plan reads every weight file at its top, so a cache that lost one of them is not
    taken for the checkpoint (that plan would lack the file's tensors): the headers are read from the Hub instead."""
    endpoint, _ = hub
    files = {name: data for name, data in FakeHub.repos[REPO].items() if name != "model.safetensors.index.json"}
    FakeHub.repos["test-org/noindex-bnb-4bit"] = files
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
    cache = tmp_path / "cache"
    try:
        full = cli("test-org/noindex-bnb-4bit", "--dry-run", "-q", "--cache-dir", cache, env=env, cwd=tmp_path)
        assert full.returncode == 0, full.stderr
        assert (
            cli(
                "test-org/noindex-bnb-4bit",
                "-q",
                "--download",
                "-o",
                tmp_path / "out",
                "--cache-dir",
                cache,
                env=env,
                cwd=tmp_path,
            ).returncode
            == 0
        )
        snapshot = next(cache.glob("models--test-org--noindex-bnb-4bit/snapshots/*"))
        (snapshot / "model-00002-of-00004.safetensors").unlink()  # the cache lost one
        FakeHub.ranges.clear()
        again = cli("test-org/noindex-bnb-4bit", "--dry-run", "-q", "--cache-dir", cache, env=env, cwd=tmp_path)
    finally:
        del FakeHub.repos["test-org/noindex-bnb-4bit"]
    assert again.returncode == 0, again.stderr
    assert plan_lines(again) == plan_lines(full) and FakeHub.ranges, again.stdout


def test_a_dry_run_refuses_what_the_conversion_would(hub, tmp_path):
    _, source = hub
    result = cli(source, "--dry-run", "--device", "tpu", env={}, cwd=tmp_path)
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) == 1 and "device 'tpu' is not cpu, cuda or cuda:N" in lines[0], (
        result.stderr
    )


# Checkpoints released as floats (FP8, compressed-tensors FP8, MXFP4): their repos' names as the Hub has them.
FLOAT_REPOS = {
    "gpt-oss": "test-org/tiny-gpt-oss-mxfp4",
    "qwen3-fp8-block128-bf16": "test-org/tiny-qwen3-FP8",
}


@pytest.mark.parametrize("variant", list(FLOAT_REPOS))
def test_float_checkpoints_from_the_hub_dry_run_then_convert_and_verify(hub, tmp_path, variant):
    """A dry run reads headers and the FP8 scales only (MXFP4's scales are read with their pieces: headers alone);
    the conversion downloads the weights, verifies, and is named without the quantization suffix."""
    from nf4convert.formats.base import plan_reads
    from nf4convert.safetensors_io.read import read_header

    from fixtures import float_checkpoints as fc

    if variant != "gpt-oss":
        pytest.importorskip("compressed_tensors")
    endpoint, _ = hub
    repo = FLOAT_REPOS[variant]
    source = tmp_path / "local" / repo.split("/")[1]
    if variant == "gpt-oss":
        fc.build_mxfp4(source)
    elif variant in fc.FP8_VARIANTS:
        fc.build_fp8(source, variant)
    else:
        fc.build_compressed(source, variant)
    FakeHub.repos[repo] = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
    local = cli(source, "--dry-run", "-q", "-o", tmp_path / "out", env={}, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    FakeHub.requested.clear()
    FakeHub.ranges.clear()
    cache = tmp_path / "cache"
    remote = cli(repo, "--dry-run", "-q", "-o", tmp_path / "out", "--cache-dir", cache, env=env, cwd=tmp_path,
                 patch=SMALL_LIMITS)  # fmt: skip
    assert remote.returncode == 0 and plan_lines(remote) == plan_lines(local), remote.stderr
    assert not [name for name in downloaded(repo) if name.endswith(".safetensors")]
    read_any = False
    for name in sorted(n for n in FakeHub.repos[repo] if n.endswith(".safetensors")):
        tensors, _ = read_header(source / name)
        header_end = min(t.begin for t in tensors.values())
        wanted = [t for t in tensors.values() if plan_reads().search(t.name)]
        for _, file, first, end in [r for r in FakeHub.ranges if r[:2] == (repo, name)]:
            beyond = end > max(header_end, 1024)
            read_any |= beyond
            inside = all(any(t.begin <= byte < t.end for t in wanted) for byte in range(max(first, header_end), end))
            assert not beyond or inside, (name, first, end)
    assert read_any == (variant != "gpt-oss")  # FP8 scales are read; MXFP4 plans from headers
    done = cli(repo, "-q", "--verify", "--device", "cpu", "--cache-dir", cache, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "OK: bit-exact" in done.stdout, done.stderr
    out = tmp_path / f"{repo.split('/')[1].split('-FP8')[0].removesuffix('-mxfp4')}-bf16"
    mine = cli(source, "-q", "--device", "cpu", "-o", tmp_path / "mine", env={}, cwd=tmp_path)
    assert mine.returncode == 0, mine.stderr
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "mine" / "model.safetensors").read_bytes()
    assert f"[{repo}](" in (out / "README.md").read_text()


BUILT_REPOS = {"modelopt-side": "test-org/tiny-qwen3-NVFP4", "deepseek-v4": "test-org/tiny-deepseek-v4"}


@pytest.mark.parametrize("variant", list(BUILT_REPOS))
def test_modelopt_and_deepseek_v4_from_the_hub(hub, tmp_path, variant):
    """A ModelOpt repo whose config.json has no quantization_config (its hf_quant_config.json says it: fetched with
    the config, before any weight), and a DeepSeek-V4-shaped one: the Hub dry run plans as the local one, the
    conversion verifies and writes the local conversion's bytes."""
    from fixtures import deepseek_v4_checkpoints as dc
    from fixtures import modelopt_checkpoints as mc

    endpoint, _ = hub
    repo = BUILT_REPOS[variant]
    source = tmp_path / "local" / repo.split("/")[1]
    if variant == "deepseek-v4":
        dc.build(source)
    else:
        mc.build(source, "qwen3-modelopt-nvfp4-side")
    FakeHub.repos[repo] = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}
    local = cli(source, "--dry-run", "-q", "-o", tmp_path / "out", env={}, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    cache = tmp_path / "cache"
    remote = cli(repo, "--dry-run", "-q", "-o", tmp_path / "out", "--cache-dir", cache, env=env, cwd=tmp_path)
    assert remote.returncode == 0 and plan_lines(remote) == plan_lines(local), remote.stderr
    assert not [name for name in downloaded(repo) if name.endswith(".safetensors")]
    done = cli(repo, "-q", "--verify", "--device", "cpu", "--cache-dir", cache, "-o", tmp_path / "out", env=env,
               cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "OK: bit-exact" in done.stdout, done.stderr
    mine = cli(source, "-q", "--device", "cpu", "-o", tmp_path / "mine", env={}, cwd=tmp_path)
    assert mine.returncode == 0, mine.stderr
    for file in (tmp_path / "mine").glob("*.safetensors"):
        assert (tmp_path / "out" / file.name).read_bytes() == file.read_bytes(), file.name
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()

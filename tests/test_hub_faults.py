"""The Hub as a hostile or broken endpoint meets it: a revision that is no git ref is refused before any request, as a
push's branch is, by the same rule; an endpoint that accepts connections and never answers ends a run within the
Hub's own timeouts (HF_HUB_ETAG_TIMEOUT), with one line and, under -q, none of huggingface_hub's retry lines; an
answer that is not the Hub API's is said as such."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.faulty_endpoint import ANSWERS, serve
from fixtures.processes import package_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
BAD_REVISIONS = ["../../etc", "main\nx", "a" * 4096, "", "x..y", "-x", "a b", "refs/heads/x.lock", "HEAD"]
GOOD_REVISIONS = ["main", "v1.0", "refs/pr/3", "0123456789abcdef0123456789abcdef01234567", "feature/x-1", "é"]


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


@pytest.fixture
def no_hub(monkeypatch):
    """Fails the test if SOURCE is resolved (a revision must be refused before the Hub is asked)."""
    from nf4convert.hub import download

    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(download, "resolve", refuse)


@pytest.mark.parametrize("revision", BAD_REVISIONS)
def test_a_revision_that_is_no_git_ref_is_one_line_before_any_request(tmp_path, no_hub, revision):
    from nf4convert import convert, verify
    from nf4convert.errors import ArgumentError
    from nf4convert.hub.upload import check_target
    from nf4convert.refs import ref_problem

    reason = ref_problem(revision)
    assert reason is not None
    for args in (
        ["org/model-bnb-4bit", "-o", tmp_path / "out", "--revision", revision],
        ["org/model-bnb-4bit", "--dry-run", "--revision", revision],
        ["verify", tmp_path, "org/model-bnb-4bit", "--revision", revision],
        ["batch", "org/model-bnb-4bit", "-o", tmp_path / "root", "--revision", revision],
    ):
        result = CliRunner().invoke(main, [str(arg) for arg in args])
        line = one_error_line(result.stderr)
        assert result.exit_code == 2 and f": {reason} (see --revision)" in line, line
        assert len(line) < 300  # a 4 KB name is shortened
    for call in (
        lambda: convert("org/model-bnb-4bit", revision=revision),
        lambda: verify(tmp_path, "org/m", revision=revision),
    ):
        with pytest.raises(ArgumentError, match="revision") as refused:
            call()
        assert refused.value.option == "revision" and reason in str(refused.value)
    with pytest.raises(ArgumentError) as pushed:  # a push's branch: the same rule
        check_target("me/model", revision)
    assert reason in str(pushed.value) and pushed.value.option == "push_branch"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("revision", GOOD_REVISIONS)
def test_branches_tags_pull_requests_and_commits_are_revisions(revision):
    from nf4convert.options import ConvertOptions, VerifyOptions

    assert ConvertOptions.parse(revision=revision).hub.revision == revision
    assert VerifyOptions.parse(revision=revision).hub.revision == revision


def _run(url: str, home: Path, *args, limit: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    env = package_env(
        HF_ENDPOINT=url,
        HF_HOME=str(home),
        HF_HUB_ETAG_TIMEOUT="1",
        HF_HUB_DOWNLOAD_TIMEOUT="1",
        HF_TOKEN="hf_write_token",
        NF4CONVERT_PROCESSES="0",
    )
    env.pop("HF_HUB_OFFLINE", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "nf4convert", *map(str, args)], env=env, capture_output=True, text=True, timeout=limit
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    "command",
    [
        ["org/model-bnb-4bit", "-o", "{tmp}/out", "-q"],
        ["org/model-bnb-4bit", "--dry-run", "-q"],
        ["verify", "{tmp}", "org/model-bnb-4bit", "-q"],
    ],
)
def test_an_endpoint_that_never_answers_ends_the_run_within_the_hubs_timeout(tmp_path, command):
    # the first request (the repo's info) had no timeout: the run waited for as long as the endpoint held it
    with serve("silent") as (url, requests):
        done, took = _run(url, tmp_path / "home", *(part.format(tmp=tmp_path) for part in command))
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and "timed out waiting for 127.0.0.1" in line and took < 45, (line, took)
    assert requests  # it was asked, and its silence ended the run


def test_a_file_request_that_never_ends_is_retried_quietly_under_q_and_ends(tmp_path):
    # the repo's info came, the files' metadata never: huggingface_hub retried with 60 s timeouts, and printed each
    # retry under -q (36 lines before the one error)
    with serve("silent", info=True) as (url, requests):
        done, took = _run(url, tmp_path / "home", "org/model-bnb-4bit", "-o", tmp_path / "out", "-q", limit=150)
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and "timed out" in line and took < 100, (line, took)
    assert sum(request.startswith("HEAD ") for request in requests) > 1  # retried, silently
    assert not (tmp_path / "out").exists()


def test_a_push_to_an_endpoint_that_never_answers_ends_before_anything_is_converted(tmp_path):
    with serve("silent") as (url, _):
        done, took = _run(url, tmp_path / "home", EXAMPLE, "-o", tmp_path / "out", "-q", "--device", "cpu",
                          "--push-to-hub", "me/model")  # fmt: skip
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and "me/model: cannot be pushed to: timed out" in line and took < 60, (line, took)
    assert line.endswith("nothing was converted") and not (tmp_path / "out").exists(), line


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_an_answer_that_is_not_the_hub_apis_is_said_so(tmp_path, answer):
    # a proxy's page or JSON of another shape showed as "KeyError: 'id'" or "JSONDecodeError: Expecting value"
    with serve(answer) as (url, _):
        done, _ = _run(url, tmp_path / "home", "org/model-bnb-4bit", "--dry-run", "-q")
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and f"the answer from {url} is not the Hub API's" in line, line
    assert "is HF_ENDPOINT a Hub?" in line


@pytest.mark.parametrize("fault", ["close", "reset", "garbage"])
def test_a_broken_connection_is_one_line_naming_the_endpoint(tmp_path, fault):
    with serve(fault, info=True) as (url, _):
        done, _ = _run(url, tmp_path / "home", "org/model-bnb-4bit", "-o", tmp_path / "out", "-q")
    line = one_error_line(done.stderr)
    assert done.returncode == 1 and f"network error with {url.split('//')[1]}: " in line, line
    assert not line.endswith(("Error", "without a message"))


def test_requests_without_a_timeout_get_the_hubs_own():
    from nf4convert.hub.session import ANSWER_SECONDS, bounds

    unset = {"connect": None, "read": None, "write": None, "pool": None}
    api = bounds("GET", "/api/models/a/b/revision/main", unset, 3, 7)
    assert api["connect"] == 3 and api["read"] == 3 and all(value is not None for value in api.values())
    download = bounds("GET", "/a/b/resolve/main/x", {"connect": 3, "read": 7, "write": 7, "pool": 7}, 3, 7)
    assert download == {"connect": 3, "read": 7, "write": 7, "pool": 7}  # huggingface_hub's own, kept
    retried = bounds("HEAD", "/a/b/resolve/main/x", {"connect": 60, "read": 60, "write": 60, "pool": 60}, 3, 7)
    assert retried["connect"] == 3 and retried["read"] == 3  # HF_HUB_ETAG_TIMEOUT, not huggingface_hub's 60 s retry
    commit = bounds("POST", "/api/models/a/b/commit/main", None, 3, 7)
    assert commit["connect"] == 3 and commit["read"] == ANSWER_SECONDS
    assert bounds("POST", "/api/repos/create", None, 3, 7)["read"] == 3

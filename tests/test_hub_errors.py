"""hub_error_line on real errors: raised by httpx2 and requests, by huggingface_hub's downloads and HTTP checks,
against a closed port, a server that never answers, an unresolvable name, and the local Hub stand-in."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest

from nf4convert.hub.errors import hub_error_line

from fixtures.fake_hub import READ_TOKEN, client_env, closed_port, serve

UNRESOLVABLE = "http://nf4convert-test.invalid"  # .invalid never resolves (RFC 6761)


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for connection in accepted:
        connection.close()
    listener.close()


def raised(call) -> BaseException:
    try:
        call()
    except Exception as error:  # noqa: BLE001
        return error
    raise AssertionError("no error")


@pytest.mark.parametrize("client", ["httpx2", "requests"])
def test_network_failures_name_the_cause_and_the_host(client, silent_port):
    module = pytest.importorskip(client)  # httpx2 comes with huggingface_hub 2.x, requests with 0.x

    def get(url, timeout):
        return module.get(url, timeout=timeout)

    port = closed_port()
    line = hub_error_line(raised(lambda: get(f"http://127.0.0.1:{port}/api/models/a/b", 5)))
    assert line.startswith(f"connection refused by 127.0.0.1:{port}"), line
    line = hub_error_line(raised(lambda: get(f"http://127.0.0.1:{silent_port}/api/models/a/b", 0.3)))
    assert line.startswith(f"timed out waiting for 127.0.0.1:{silent_port}"), line
    line = hub_error_line(raised(lambda: get(f"{UNRESOLVABLE}/api/models/a/b", 5)))
    assert line.startswith("cannot resolve the host name nf4convert-test.invalid"), line


NOT_FOUND = "repository not found (or private, and the token cannot see it)"
NO_TOKEN = "the token was rejected or is missing (give a token, or set HF_TOKEN)"
NO_WRITE = "the token lacks the permission (an upload needs write access to the namespace; a gated repo, its terms)"


@pytest.mark.parametrize(
    "path,token,expected",
    [
        (
            "/api/models/me/missing",
            READ_TOKEN,
            f"HTTP 404 Not Found from GET {{endpoint}}/api/models/me/missing: {NOT_FOUND} [server: Repository not "
            "found]",
        ),
        (
            "/api/models/me/model/revision/v9",
            READ_TOKEN,
            "HTTP 404 Not Found from GET {endpoint}/api/models/me/model/"
            "revision/v9: revision not found in the repository [server: Invalid rev id: v9]",
        ),
        (
            "/api/models/me/model",
            "hf_bad",
            f"HTTP 401 Unauthorized from GET {{endpoint}}/api/models/me/model: {NO_TOKEN} "
            "[server: Invalid credentials in Authorization header]",
        ),
        (
            "/api/repos/create",
            READ_TOKEN,
            f"HTTP 403 Forbidden from POST {{endpoint}}/api/repos/create: {NO_WRITE} "
            "[server: You don't have the rights to write to this repository: the token is read-only]",
        ),
        (
            "/cas/v1/xorbs/default/abc",
            READ_TOKEN,
            f"HTTP 401 Unauthorized from POST {{endpoint}}/cas/v1/xorbs/default/abc: {NO_TOKEN} [server: bad xet "
            "token]",
        ),
    ],
)
def test_http_errors_keep_status_request_and_server_message(path, token, expected):
    httpx2 = pytest.importorskip("httpx2")
    requests = pytest.importorskip("requests")
    from huggingface_hub.utils import hf_raise_for_status

    with serve() as (endpoint, state):
        state.add_repo("me/model", private=False)
        method = "POST" if path in ("/api/repos/create",) or path.startswith("/cas/") else "GET"
        headers = {"Authorization": f"Bearer {token}"}
        body = {"name": "x", "organization": "me"}
        response = httpx2.request(method, endpoint + path, headers=headers, json=body, timeout=10)
        assert hub_error_line(raised(lambda: hf_raise_for_status(response))) == expected.format(endpoint=endpoint)
        # huggingface_hub 0.x let requests' HTTPError through: the same line
        response = requests.request(method, endpoint + path, headers=headers, json=body, timeout=10)
        line = hub_error_line(raised(response.raise_for_status))
        if path.startswith("/cas/"):  # a text body, which requests' error does not carry as a server message
            expected = expected.split(" [server")[0]
        assert line == expected.format(endpoint=endpoint)


DOWNLOAD = """
import json, sys
from huggingface_hub import hf_hub_download, snapshot_download
from nf4convert.hub.errors import hub_error_line
calls = {
    "snapshot": lambda: snapshot_download("me/missing", cache_dir=sys.argv[1]),
    "file": lambda: hf_hub_download("me/missing", "config.json", cache_dir=sys.argv[1]),
}
lines = {}
for name in sys.argv[2:]:
    try:
        calls[name]()
        lines[name] = None
    except Exception as error:
        lines[name] = hub_error_line(error)
print(json.dumps(lines))
"""


@pytest.mark.parametrize("case", ["not-found", "refused", "offline"])
def test_download_errors_are_one_line(case, tmp_path):
    with serve() as (endpoint, _):
        env = client_env(endpoint, tmp_path / "home", HF_TOKEN=READ_TOKEN)
        if case == "refused":
            port = closed_port()
            env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
        if case == "offline":
            env["HF_HUB_OFFLINE"] = "1"
        # hf_hub_download retries a refused connection for about 25 s (huggingface_hub's http_backoff): not here
        calls = ["snapshot"] if case == "refused" else ["snapshot", "file"]
        result = subprocess.run(
            [sys.executable, "-c", DOWNLOAD, str(tmp_path / "cache"), *calls],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    lines = json.loads(result.stdout)
    assert list(lines) == calls
    for name, line in lines.items():
        assert line is not None and "\n" not in line, (name, line)
        if case == "not-found":
            assert line.startswith("HTTP 404 Not Found from ") and "repository not found" in line, line
        elif case == "refused":
            cause = f"connection refused by 127.0.0.1:{port}"
            assert line.startswith(f"not in the local cache, and the Hub cannot be reached: {cause}"), line
        else:
            assert line == "not in the local cache, and offline mode (HF_HUB_OFFLINE=1) forbids reaching the Hub", line


def test_never_raises_on_odd_errors():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    class OddResponse(Exception):
        response = type("Response", (), {"status_code": "500", "json": lambda self: 1 / 0})()

    class LoopingCause(Exception):
        pass

    looping = LoopingCause("a loop")
    looping.__cause__ = LoopingCause("b")
    looping.__cause__.__cause__ = looping
    assert hub_error_line(Unprintable()) == "Unprintable: Unprintable"
    assert hub_error_line(OddResponse("odd")) == "OddResponse: odd"
    assert hub_error_line(looping) == "LoopingCause: a loop"
    assert hub_error_line(ValueError("Invalid metadata in README.md.\n- license: must be a string")) == (
        "ValueError: Invalid metadata in README.md. - license: must be a string"
    )

"""Push a finished output folder to the Hub.

huggingface_hub 2.x has no ``upload_large_folder``: its ``upload_folder`` took that role. With hf_xet installed
(a dependency of huggingface_hub on x86-64 and arm64) it uploads through a streamed pipeline: files are chunked
and deduplicated while the next ones are still being checked, a large folder goes up in several commits, and an
interrupted upload resumes by running the same call again (committed files are skipped; chunks already stored
are not sent again). It takes ``revision`` (an existing branch, or ``refs/pr/N``), which the old
``upload_large_folder`` also took, and shows its progress unless huggingface_hub's progress bars are disabled.
Without hf_xet it makes one commit through Git LFS, which skips objects already on the Hub. So
``upload_folder`` is used on every version; the repo is created first (``private`` applies to a new repo only)
and so is the branch, since a commit cannot create one.

A push makes the repo's weights the folder's: the files at the repo's root that loaders take as the model's weights
without being told a file name, and that the folder does not have, are deleted in the same (first) commit
(``upload_folder``'s ``delete_patterns``). Otherwise a ``model.safetensors`` left by an earlier push beside new
``model-0000i-of-0000N.safetensors`` shards is what transformers loads (it prefers the single file to an index).

huggingface_hub is imported inside the functions that use it (its import cost is for a push alone to pay).
"""

from __future__ import annotations

import glob
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import quote

from ..errors import ArgumentError, UploadError
from ..files import ADAPTER_FILES, LOADED_WEIGHT_FILES
from ..refs import is_commit, ref_problem
from ..strict_json import shown
from .download import progress_bars
from .errors import hub_error_line
from .names import looks_like_repo_id
from .session import hub_session

# Root files a loader reads as the weights unasked, and an adapter's (checkpoint.LOADED_WEIGHT_FILES, ADAPTER_FILES).
# Files in subfolders, and GGUF or other files that a tool reads only when named, are the owner's and stay.
REPLACED_FILES = (*LOADED_WEIGHT_FILES, *ADAPTER_FILES)
DEFAULT_COMMIT_MESSAGE = "Upload dense weights dequantized by nf4convert"


def check_target(repo_id: str, revision: str | None) -> None:
    """ArgumentError for a push that cannot happen, found before any work: a repo id the Hub refuses (huggingface_hub's
    own check), a branch name git refuses or a commit hash as the branch, or huggingface_hub's offline switch
    (HF_HUB_OFFLINE) on."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ArgumentError(
            f"repo id {repo_id!r}: {str(error).split(':')[0].rstrip('.')}", option="push_to_hub"
        ) from None
    if not looks_like_repo_id(repo_id):
        raise ArgumentError(f"repo id {repo_id!r} is not a Hub repo id like 'me/model-bf16'", option="push_to_hub")
    problem = ref_problem(revision) if revision is not None else None
    if problem is not None:
        raise ArgumentError(f"branch {shown(revision)}: {problem}", option="push_branch")
    if revision is not None and is_commit(revision):
        raise ArgumentError(
            f"{repo_id}: revision {revision!r} is a commit; an upload needs a branch (or refs/pr/N)",
            option="push_branch",
        )
    if constants.HF_HUB_OFFLINE:
        raise ArgumentError(
            f"{repo_id}: HF_HUB_OFFLINE is set, so nothing can be pushed to the Hub", option="push_to_hub"
        )


def check_writable(whoami: dict, repo_id: str) -> None:
    """UploadError when the token ``whoami`` (``HfApi.whoami``'s answer) describes is read-only."""
    if (((whoami or {}).get("auth") or {}).get("accessToken") or {}).get("role") == "read":
        raise UploadError(
            f"{repo_id}: the token is read-only; nothing was converted (give a token with write access: --token, "
            "HF_TOKEN or `hf auth login`)",
            option="token",
        )


def check_ready(repo_id: str, *, token: str | None = None, private: bool = False, progress: bool = True) -> None:
    """UploadError, before any work, unless the Hub answers, ``token`` (or the saved login) is valid and not a
    read-only token, and a ``private`` push does not go to a repo that exists and is public: what ``push_to_hub`` would
    otherwise find only once the conversion is done."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    api = HfApi(token=token)
    try:
        with progress_bars(progress), hub_session(quiet=not progress):
            check_writable(api.whoami(), repo_id)
            if private:
                try:
                    public = not api.repo_info(repo_id).private
                except RepositoryNotFoundError:
                    public = False
                if public:
                    raise UploadError(
                        f"{repo_id}: the repository exists and is public; nothing was converted (make it private "
                        "on the Hub first, or push without --private)",
                        option="private",
                    )
    except UploadError:
        raise
    except Exception as error:  # noqa: BLE001  (whatever the Hub or the network raise: one line, the cause)
        raise UploadError(f"{repo_id}: cannot be pushed to: {hub_error_line(error)}; nothing was converted") from error


def push_to_hub(
    folder: Path | str,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    progress: bool = True,
    commit_message: str | None = None,
    replace_weights: bool = True,
) -> str:
    """Upload ``folder`` (a finished conversion) to the model repo ``repo_id``; return the repo's URL (with
    ``/tree/<revision>`` when a revision was given).

    The repo is created if needed (private when ``private``; an existing public repo is refused rather than
    filled, since ``private`` cannot change it). Weight files at the repo's root that ``folder`` lacks
    (``REPLACED_FILES``: an earlier push's shards, a ``.bin`` copy, an adapter's files) are deleted in the same
    commit, so the repo holds exactly the folder's weights (unless ``replace_weights`` is off). A ``revision`` that
    names a missing branch is created from the default branch; ``refs/pr/N`` must exist. ``token`` defaults to
    HF_TOKEN or the saved login; ``progress=False`` silences huggingface_hub's progress display for this call. A repo
    id or branch name the Hub refuses, or HF_HUB_OFFLINE on, is an ``ArgumentError`` (``check_target``); every other
    failure raises ``UploadError`` with one line naming the repo and the cause (network, token, HTTP status and the
    server's message).

    Example:
        >>> push_to_hub(Path("Llama-3.2-1B-Instruct-bf16"), "me/Llama-3.2-1B-Instruct-bf16", private=True)
        'https://huggingface.co/me/Llama-3.2-1B-Instruct-bf16'
    """
    check_target(repo_id, revision)  # before the folder's checks: nothing of the Hub is asked either way
    folder = Path(folder)
    if not folder.is_dir():
        raise UploadError(f"{folder}: no such folder to upload")
    if not any(folder.iterdir()):
        raise UploadError(f"{folder}: the folder is empty, nothing to upload")

    from huggingface_hub import HfApi  # keeps CLI start-up fast

    api = HfApi(token=token)
    try:
        with progress_bars(progress), hub_session(quiet=not progress):
            url = str(api.create_repo(repo_id, private=private, exist_ok=True))
            if private and not api.repo_info(repo_id).private:
                raise UploadError(
                    f"{repo_id}: the repository exists and is public; nothing was uploaded (make it "
                    "private on the Hub first, or push without --private)",
                    option="private",
                )
            if revision is not None and not revision.startswith("refs/"):
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            stale = stale_weights(api.list_repo_files(repo_id, revision=revision), folder) if replace_weights else []
            # upload_folder matches its patterns against the whole path (``*`` crosses ``/``): exact names, escaped
            api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                revision=revision,
                commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                delete_patterns=[glob.escape(name) for name in stale] or None,
            )
    except UploadError:
        raise
    except Exception as error:  # noqa: BLE001  (whatever the Hub, the network or hf_xet raise: one line, the cause)
        raise UploadError(f"{repo_id}: upload failed: {hub_error_line(error)}") from error
    return url if revision is None else f"{url}/tree/{quote(revision, safe='')}"


def stale_weights(repo_files: list[str], folder: Path) -> list[str]:
    """The repo's root files in ``REPLACED_FILES`` that ``folder`` does not have (a push deletes them)."""
    return [
        name
        for name in repo_files
        if "/" not in name
        and not (folder / name).is_file()
        and any(fnmatchcase(name, pattern) for pattern in REPLACED_FILES)
    ]


def push_file_to_hub(
    file: Path | str,
    repo_id: str,
    *,
    card: str | None,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    progress: bool = True,
) -> str:
    """Upload one finished file (a GGUF) and its model card (``card``, as README.md) to ``repo_id``, as
    ``push_to_hub`` uploads a folder, keeping the repo's other files (a GGUF sits beside other weights). Returns the
    repo's URL."""
    import os
    import shutil
    import tempfile

    check_target(repo_id, revision)
    file = Path(file)
    if not file.is_file():
        raise UploadError(f"{file}: no such file to upload")
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{file.name}.nf4convert-push-", dir=file.parent))
    except OSError:  # a folder that cannot be written: the system's temporary folder then
        folder = Path(tempfile.mkdtemp(prefix="nf4convert-push-"))
    try:
        try:
            os.link(file, folder / file.name)  # the same bytes without a copy
        except OSError:
            os.symlink(file.resolve(), folder / file.name)
        if card is not None:
            (folder / "README.md").write_text(card, encoding="utf-8")
        return push_to_hub(
            folder,
            repo_id,
            private=private,
            token=token,
            revision=revision,
            progress=progress,
            commit_message=f"Upload {file.name}, written by nf4convert",
            replace_weights=False,
        )
    except OSError as error:
        raise UploadError(f"{file}: cannot be staged for the upload ({error.strerror or error})") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def upload_command(
    repo_id: str, local_path: Path | str, path_in_repo: str, *, private: bool, branch: str | None
) -> str:
    """The shell command of huggingface_hub's own CLI that uploads ``local_path`` (a folder's contents with
    ``path_in_repo`` ".", or one file) to ``repo_id`` as ``path_in_repo``, as a push does: on ``branch`` (created if
    missing), the repo created private if asked."""
    import shlex

    words = ["hf", "upload", repo_id, str(local_path), path_in_repo]
    words += ["--revision", branch] if branch else []
    return shlex.join(words + (["--private"] if private else []))

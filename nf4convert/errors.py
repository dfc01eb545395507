"""Every failure a user can meet has its own type and a one-line message naming the file, tensor or option; the
fields an error carries are declared on its class here.

Library messages name parameters as the Python API spells them; an error that a parameter could
resolve says which in ``option`` ("overwrite", "token", ...), and the CLI turns that into a flag.

    Nf4ConvertError
    ├── ArgumentError        an option / argument value that is not valid (also a ValueError)
    ├── SourceNotFoundError  SOURCE or ADAPTER cannot be found, fetched or read as a folder
    │   └── FetchError       a Hub file's bytes could not be read (the network, the Hub), after retrying
    ├── CheckpointError      a checkpoint file that is missing, truncated, corrupt, or not convertible
    │   └── IntegrityError   a Hub file's bytes do not match the Hub's hash of that file
    ├── OutputError          the output cannot be written (exists, no space, not writable)
    ├── UploadError          pushing the output to the Hub failed
    ├── DependencyError      a library the path taken needs cannot be imported (bitsandbytes, peft; Triton on CUDA)
    ├── WorkerError          a worker process of the CPU route stopped (killed by the system: out of memory?)
    └── InternalError        a broken invariant of nf4convert itself: a bug to report (also a RuntimeError)

A stop signal under the command line is no failure: it is raised as :class:`Interrupted` (SIGINT, a
KeyboardInterrupt) or :class:`Terminated` (SIGTERM, SIGHUP), which unwind a run like any failure and remove what was
partly written.
"""

import signal
from pathlib import Path


class Nf4ConvertError(Exception):
    """Base of the errors the CLI reports in one line, without a traceback."""

    def __init__(self, message: str, *, option: str | None = None):
        super().__init__(message)
        self.option = option  # the parameter that would change the outcome, if any


class ArgumentError(Nf4ConvertError, ValueError):
    """An argument that is not valid: a dtype, device, size, backend, or a quant state's field."""


class SourceNotFoundError(Nf4ConvertError):
    """SOURCE is neither a local folder nor a Hub repository that can be reached or found in the cache."""


class CheckpointError(Nf4ConvertError):
    """A checkpoint file that is missing, truncated, corrupt, or not of a format nf4convert reads."""


class FetchError(SourceNotFoundError):
    """A Hub file's bytes could not be read while streaming it: the connection, the Hub or its storage failed as
    many times as a range is tried (``tries`` says how many)."""

    def __init__(self, message: str, *, option: str | None = None, tries: int = 0):
        super().__init__(message, option=option)
        self.tries = tries


class IntegrityError(CheckpointError):
    """A Hub file's bytes, as read, do not match the hash the Hub gives for that file (its LFS sha256 or git blob id),
    or two reads of the same bytes disagreed: corrupted on the way, or not the commit's bytes."""


class OutputError(Nf4ConvertError):
    """The output folder cannot be written: it exists, the disk is too small, or it is not writable."""


class UploadError(Nf4ConvertError):
    """The finished output could not be pushed to the Hub."""


class DependencyError(Nf4ConvertError):
    """A library that the path taken needs (verify's references: bitsandbytes, and peft for an adapter; Triton for the
    CUDA kernel) cannot be imported: a finding about the installation, never reported as a difference in the weights."""


class WorkerError(Nf4ConvertError):
    """A worker process of the CPU route stopped under a conversion (the system killed it, most often for memory)."""


class InternalError(Nf4ConvertError, RuntimeError):
    """A broken invariant of nf4convert's own code (a piece written where the plan put none): a bug, reported in one
    line like any other failure, never a traceback."""


# The signals that stop a run (Ctrl-C; kill, timeout, docker stop; a closed terminal or ssh session): the command line
# raises them as the two exceptions below.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), as the command line raises it."""

    signum = 2
    output_complete: Path | None = None  # an OUT that was complete before the signal could act: kept
    left: Path | None = None  # a partly written folder that could not be removed


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that cleanup runs as for Ctrl-C."""

    output_complete: Path | None = None  # as Interrupted's
    left: Path | None = None  # as Interrupted's

    def __init__(self, signum: int = 15):
        super().__init__(signum)
        self.signum = signum

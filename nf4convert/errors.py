"""Every failure a user can meet has its own type and a one-line message that says what to do next."""


class Nf4ConvertError(Exception):
    """Base of the errors the CLI reports in one line, without a traceback."""


class SourceNotFoundError(Nf4ConvertError):
    """SOURCE is neither a local folder nor a Hub repository that can be reached or found in the cache."""


class CheckpointError(Nf4ConvertError):
    """A checkpoint file that is missing, truncated, corrupt, or not a bitsandbytes 4-bit checkpoint."""


class OutputError(Nf4ConvertError):
    """The output folder cannot be written: it exists, or the disk is too small."""


class VerificationError(Nf4ConvertError):
    """The output does not match its source."""


class UploadError(Nf4ConvertError):
    """The output could not be pushed to the Hub: the cause (network, token, HTTP status and the server's message)."""

"""A directory for event files: created, or refused with the reason and the way out."""

from __future__ import annotations

import os


def check_log_dir(
    path: str | os.PathLike[str], given_as: str = "log_dir", fix: str | None = None
) -> None:
    """Create ``path`` (a directory for event files) or raise an OSError naming it, the reason
    and ``fix``, the way out; ``given_as`` says where the path came from."""
    name = os.fspath(path)
    try:
        os.makedirs(name, exist_ok=True)
    except OSError as err:
        error, reason = _why_not(name, err)
    else:
        if os.access(name, os.W_OK | os.X_OK):
            return
        error, reason = PermissionError, "it is not writable (permission denied)"
    raise error(
        f"{given_as} {name!r} cannot hold TensorBoard event files: {reason}; "
        + (fix or f"pass a {given_as} in a directory you can write to")
    )


def _why_not(path: str, err: OSError) -> tuple[type[OSError], str]:
    """The error to raise for a directory ``makedirs`` could not make, and why."""
    blocking = path
    while blocking and not os.path.exists(blocking):
        blocking = os.path.dirname(blocking.rstrip(os.sep))
    if blocking and not os.path.isdir(blocking):
        return NotADirectoryError, f"{blocking!r} is a file, not a directory"
    return type(err), err.strerror or str(err)

"""What an error may tell a caller, and how client errors are logged.

Ray re-raises a replica's exception as a `RayTaskError` whose `str()` carries the remote
traceback, the process title, the pid, the node IP and ANSI colour codes. None of that is the
caller's business (and on a public bind it maps the cluster), so:

- `remote_cause(exc)` follows `RayTaskError.cause` to the exception the replica raised;
- `public_message(exc)` is what a response may say: capserve's own errors keep their message
  (it names the field and the allowed values), anything else says only its type and first line,
  with ANSI codes, pids and addresses removed;
- `quiet_client_errors()` turns Serve's "Request failed." ERROR-with-traceback, which Serve's
  replica wrapper logs for every exception a handle method raises (ray/serve/_private/replica.py,
  `_handle_errors_and_metrics`), into one WARNING line when the exception is a client error.
"""

from __future__ import annotations

import logging
import re

from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    ReplicaUnavailableError,
)

OWN_ERRORS = (InvalidRequestError, CaptureFailedError, BackPressureError, ReplicaUnavailableError, DeadlineExceededError)
CLIENT_ERRORS = (InvalidRequestError,)  # the caller's mistake: a WARNING line, never a traceback
SERVE_LOGGER = "ray.serve"  # the logger Serve's replica wrapper reports user exceptions on

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# pid=123, pid: 123, ip=10.0.0.1, ip: 10.0.0.1, and bare IPv4 addresses with an optional port
_IDENTIFYING = re.compile(r"\b(?:pid|ip|node_ip|node_id|actor_id|worker_id)\s*[=:]\s*\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")


def remote_cause(exc: BaseException) -> BaseException:
    """The exception a remote task or actor raised, through any number of Ray wrappings."""
    seen = 0
    while seen < 16:  # a cycle would be a Ray bug; never loop on it
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or not _is_ray_task_error(exc):
            return exc
        exc, seen = cause, seen + 1
    return exc


def _is_ray_task_error(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayTaskError
    except ImportError:
        return False
    return isinstance(exc, RayTaskError)


def public_message(exc: BaseException) -> str:
    """A message safe to send to any caller: no traceback, pid, address or ANSI code."""
    cause = remote_cause(exc)
    if isinstance(cause, OWN_ERRORS):
        return scrub(str(cause.args[0]) if cause.args else str(cause))
    first = scrub(str(cause)).strip().splitlines()
    return f"{type(cause).__name__}: {first[0]}" if first else type(cause).__name__


def scrub(text: str) -> str:
    """Remove ANSI codes, identifying key=value pairs and IP addresses; keep the first paragraph
    only when a traceback follows it."""
    text = _ANSI.sub("", text)
    text = text.split("Traceback (most recent call last)")[0].rstrip()
    return _IDENTIFYING.sub("[redacted]", text)


class ClientErrorLogFilter(logging.Filter):
    """On Serve's logger: a record carrying a client error becomes one WARNING line (no traceback).

    Keyed on the exception type in the record, not on Serve's wording, so a Serve upgrade that
    rewords "Request failed." still gets filtered; other records pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not isinstance(remote_cause(exc), CLIENT_ERRORS):
            return True
        record.msg = "client error (%s): %s"
        record.args = (type(remote_cause(exc)).__name__, public_message(exc))
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def quiet_client_errors() -> None:
    """Install `ClientErrorLogFilter` on Serve's logger in this process (once). Logger filters
    survive Serve's logging setup, which replaces handlers only."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorLogFilter) for f in logger.filters):
        logger.addFilter(ClientErrorLogFilter())


def describe(exc: BaseException) -> str:
    """`Type: message` for a list of causes (a retry's failures), as safe as `public_message`."""
    cause = remote_cause(exc)
    message = public_message(exc)
    return message if message.startswith(type(cause).__name__) else f"{type(cause).__name__}: {message}"

"""Reaching the Serve app, and what a failure means for a retry. Shared by the provider and client.

Ray is imported only when a connection is made, so importing `provider` stays light.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Literal

from replicas.api.error_messages import OWN_ERRORS, remote_cause
from replicas.api.errors import (
    BackPressureError,
    CaptureFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    ReplicaUnavailableError,
)

Retry = Literal["rate_limit", "transient", "no"]


@dataclass(frozen=True)
class RetryAdvice:
    kind: Retry
    retry_after: float | None = None


def classify(exc: BaseException) -> RetryAdvice:
    """backpressure -> rate_limit; a dead or unavailable replica, router or object -> transient;
    a bad request, a failed capture or anything unknown -> no retry.

    Ray re-raises a remote exception as a `RayTaskError` that is also an instance of the cause's
    type, so capserve's own errors are recognised through Ray as well.
    """
    if isinstance(exc, (InvalidRequestError, CaptureFailedError, DeadlineExceededError)):
        return RetryAdvice("no")
    if isinstance(exc, BackPressureError):
        return RetryAdvice("rate_limit", 1.0)
    if isinstance(exc, ReplicaUnavailableError):
        return RetryAdvice("transient", 1.0)
    try:
        from ray import exceptions as ray_errors
        from ray.serve import exceptions as serve_errors
    except ImportError:  # no Ray: nothing below can have been raised
        return RetryAdvice("no")
    if isinstance(exc, serve_errors.BackPressureError):
        return RetryAdvice("rate_limit", getattr(exc, "retry_after_s", None))
    transient = (
        serve_errors.ReplicaUnavailableError,
        serve_errors.DeploymentUnavailableError,
        ray_errors.RayActorError,  # ActorDiedError, ActorUnavailableError
        ray_errors.ObjectLostError,  # OwnerDiedError etc.: a by-reference result lost with its replica
    )
    if isinstance(exc, transient):
        return RetryAdvice("transient")
    return RetryAdvice("no")


def unwrap(exc: BaseException) -> BaseException:
    """The remote cause of a `RayTaskError` for capserve's own errors (a clean message), else `exc`."""
    cause = remote_cause(exc)
    return cause if isinstance(cause, OWN_ERRORS) else exc


class AppConnection:
    """A lazily made, thread-safe connection to one Serve app: `handle()` connects on first use.

    `address`: a Ray cluster address (`"auto"`, `"ray://host:10001"`, `"host:6379"`); None uses
    `RAY_ADDRESS`, else `"auto"` (an existing cluster: never starts a new one). A process already
    connected to Ray keeps its connection. `handle` skips the lookup (an existing handle, or a
    fake in tests).
    """

    def __init__(self, app: str = "capserve", address: str | None = None, handle: Any = None) -> None:
        self.app = app
        self.address = address
        self._handle: Any = handle
        self._lock = threading.Lock()

    @property
    def connected(self) -> Any:
        """The handle when already connected, else None (never blocks)."""
        return self._handle

    def handle(self) -> Any:
        """The app's DeploymentHandle (blocking on first call; run it off the event loop)."""
        if self._handle is not None:
            return self._handle
        with self._lock:
            if self._handle is None:
                import ray
                from ray import serve

                if not ray.is_initialized():
                    address = self.address or os.environ.get("RAY_ADDRESS") or "auto"
                    try:
                        ray.init(address=address, log_to_driver=False, ignore_reinit_error=True)
                    except ConnectionError as exc:
                        cause = f"{exc}: {exc.__cause__}" if exc.__cause__ else str(exc)
                        raise ConnectionError(
                            f"cannot reach a Ray cluster at address={address!r} ({cause}). Start the "
                            "app first (`serve run serve_config.yaml`) or pass the cluster's address "
                            "(-M address=<host:port> / CaptureClient(address=...)); a cluster with token "
                            "authentication also needs RAY_AUTH_MODE=token in this process's environment"
                        ) from exc
                try:
                    self._handle = serve.get_app_handle(self.app)
                except Exception as exc:  # RayServeException: no such app
                    raise LookupError(
                        f"no Serve application named {self.app!r} on this cluster ({exc}); pass the "
                        "app name the app was started with (-M app=<name> / CaptureClient(app=...))"
                    ) from exc
        return self._handle

"""Errors that cross process boundaries; torch-free so the router and the provider can catch them."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (a 4xx). Only that request fails; retrying is useless."""


class CaptureFailedError(RuntimeError):
    """The worker could not record what a request asked for; the request fails, the engine goes on."""


class BackPressureError(RuntimeError):
    """The fleet's queue is full; retry later (HTTP 503)."""


class ReplicaUnavailableError(RuntimeError):
    """The replica or its engine died, or it is draining, before answering (HTTP 503).

    The router retries such a request on another replica; callers see it only when every attempt
    failed, with each attempt's cause in the message."""

"""Errors that cross process boundaries; torch-free so the router and the provider can catch them."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (a 4xx). Only that request fails; retrying is useless."""


class PlanError(InvalidRequestError):
    """A request that cannot be served as asked; the message names the field."""


class CaptureFailedError(RuntimeError):
    """The worker could not record what a request asked for; the request fails, the engine goes on."""


class BackPressureError(RuntimeError):
    """The fleet's queue is full; retry later (HTTP 503)."""


class ReplicaUnavailableError(RuntimeError):
    """The replica or its engine died, or it is draining, before answering (HTTP 503).

    The router retries such a request on another replica; callers see it only when every attempt
    failed, with each attempt's cause in the message."""


class DeadlineExceededError(RuntimeError):
    """The request did not finish within its deadline (the router's `routing.request_timeout_s`,
    or the client's `timeout_s`); it was cancelled wherever it was (queue or replica). HTTP 504.

    Retrying as is would likely time out again: ask for less (max_tokens, capture size), or raise
    the deadline."""


# Why the worker failed a request as the replica's fault rather than the request's (the
# "replica_fault" of a worker result): the replica raises ReplicaUnavailableError for either, so
# the router retries elsewhere, and once the outbox is dead it fails every later capture at once.
OUTBOX_STUCK = "outbox_stuck"  # the outbox thread did not deliver within outbox_timeout_s
OUTBOX_DEAD = "outbox_dead"  # the outbox thread died

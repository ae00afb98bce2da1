"""Ending the slow state a capture leaves on the GPU, by a context switch (engine option `switch_context_every_s`).

Measured on an H200 (docs/notes/slow-state.md; why it is on by default:
docs/notes/switch-context-default.md): once a capture has written many rows to host memory, this
process's CUDA context runs the model's forward ~3 % slower on the device, and stays so after the
capture ends, until the GPU switches to another context. A kernel on another
stream of the same context does not end it; an empty kernel launched in a second CUDA context of
this process does (0.21 ms on the host). So the worker keeps a second context with one empty
kernel and launches it while steps write rows (at most every `every_s`) and once after the last
such step. Torch has no handle on a second context, so it goes through the driver API (ctypes),
as `replicas.worker.arena_writer` does for host registration. The context's stack, printf FIFO and malloc
heap limits are set to zero (its empty kernel uses none): at the driver's defaults it held 524 MiB of
an H200, at zero 260 MiB (bench/gpu/context_cost.py), memory vLLM's profile takes from the KV cache.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# cuCtxSetLimit's limits that reserve device memory per context: CU_LIMIT_STACK_SIZE,
# CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE (the driver grows the stack again should a kernel need it)
LIMITS = {"stack": 0, "printf FIFO": 1, "malloc heap": 2}

# compiled by the driver for the GPU that loads it (PTX is forward compatible)
EMPTY_KERNEL_PTX = b""".version 7.8
.target sm_80
.address_size 64
.visible .entry capserve_switch()
{
    ret;
}
"""


class SecondContext:
    """A CUDA context of this process besides torch's, with one empty kernel in it."""

    def __init__(self, driver: ctypes.CDLL, context: ctypes.c_void_p, kernel: ctypes.c_void_p):
        self._driver, self._context, self._kernel = driver, context, kernel

    @classmethod
    def open(cls, device_index: int) -> SecondContext:
        """Raises RuntimeError when the driver refuses, OSError without a driver, AttributeError when
        it lacks a call."""
        driver = ctypes.CDLL("libcuda.so.1")
        device, context = ctypes.c_int(), ctypes.c_void_p()
        _check(driver.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        _check(driver.cuCtxCreate_v2(ctypes.byref(context), 0, device), "cuCtxCreate")  # it becomes current
        module, kernel = ctypes.c_void_p(), ctypes.c_void_p()
        try:
            for name, limit in LIMITS.items():
                _check(driver.cuCtxSetLimit(limit, ctypes.c_size_t(0)), f"cuCtxSetLimit({name})")
            _check(driver.cuModuleLoadData(ctypes.byref(module), EMPTY_KERNEL_PTX), "cuModuleLoadData")
            _check(driver.cuModuleGetFunction(ctypes.byref(kernel), module, b"capserve_switch"), "cuModuleGetFunction")
        except Exception:  # a refusal, or a driver without the call: torch's context must be current again
            driver.cuCtxDestroy_v2(context)  # which also pops it; the worker goes on without switches
            raise
        _check(driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
        return cls(driver, context, kernel)

    def launch(self, wait: bool = False) -> None:
        """Queue the empty kernel in the second context (the calling thread's current context is
        left as it was); with `wait`, until it ran."""
        _check(self._driver.cuCtxPushCurrent_v2(self._context), "cuCtxPushCurrent")
        try:
            _check(self._driver.cuLaunchKernel(self._kernel, 1, 1, 1, 1, 1, 1, 0, None, None, None), "cuLaunchKernel")
            if wait:
                _check(self._driver.cuCtxSynchronize(), "cuCtxSynchronize")
        finally:
            _check(self._driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {code}")


class ContextSwitches:
    """When to launch: after a step that wrote rows, if `every_s` passed since the last launch;
    and after the first step that wrote none following one that did (its copies have had a step's
    time to finish), so the engine does not carry the state into the work after a capture."""

    def __init__(self, launch: Callable[[], None], every_s: float, clock: Callable[[], float] = time.monotonic):
        self._launch, self.every_s, self._clock = launch, every_s, clock
        self._last = float("-inf")
        self._owed = False  # rows were written since the last step that wrote none
        self.count = 0
        self.failed = ""  # why launching stopped, if it did

    def after_step(self, wrote_rows: bool) -> None:
        if wrote_rows:
            self._owed = True
            if self._clock() - self._last >= self.every_s:
                self._switch()
        elif self._owed:
            self._owed = False
            self._switch()

    def _switch(self) -> None:
        if self.failed:
            return
        try:
            self._launch()
        except RuntimeError as exc:  # the step loop goes on without switches, never stops for them
            self.failed = str(exc)
            logger.warning("context switches stopped: %s", exc)
            return
        self._last = self._clock()
        self.count += 1


def context_switches(every_s: float | None, device: torch.device) -> ContextSwitches | None:
    """The worker's switches on a GPU when the option is set; None otherwise, or (with a warning)
    when the driver refuses a second context."""
    if every_s is None or device.type != "cuda":
        return None
    try:
        second = SecondContext.open(device.index if device.index is not None else torch.cuda.current_device())
    except (OSError, AttributeError, RuntimeError) as exc:  # no driver, a driver without the call, or its refusal
        logger.warning("switch_context_every_s is off: no second CUDA context (%s)", exc)
        return None
    return ContextSwitches(second.launch, every_s)

"""Graph-safe hook sites: static buffers read and written by pure tensor ops inside the forward.

A `Site` is one (layer, kind) point of the model. Inside the forward it applies up to
`edit_stages` edits per row, each a gather from slot tables that the worker fills before the
step (slot 0 is the identity), then copies the rows into a static staging buffer that the worker
reads after the step. Nothing here branches on data or leaves the device, so the same code runs
eagerly on CPU and inside torch.compile + CUDA graphs on GPU.

One stage of the per-row edit, for slot s of the row (all read from one table row):
    c = h . proj[s]                               # per head at a per-head site
    h = h - (c - clip(c, lo[s], hi[s])) proj[s]   # clamp; project_out is lo = hi = 0 (and proj[0] = 0)
    h = h * factor[s]                             # scale       (factor[0] = 1)
    h = h + gate * add[s] * (add_coef[s] + norm_coef[s] * |h|)   # add, optionally norm-matched
where gate is 1, or for a conditional add (`gated`) whether c + gate_bias[s] > threshold[s]: its
row holds the read-out's direction in proj with open bounds (lo = -inf, hi = inf), so c is the
read-out and nothing is projected away.
(a row holds one op, so |h| is the stage's input norm and one reduction pass serves both sums;
the stage computes in float32 and rounds once to the model dtype)
    h = values[set_row[row]] where set_stage[row] == stage  # set (activation patching)
Inside a compiled graph the stage fuses to a gather, one reduction and pointwise work.
Rows whose slot is 0 come out bit-identical.

A z site is `written_in_place` (engine option `attention_in_place`, on by default): vLLM's
attention kernel writes its output rows straight into the site's staging buffer
(`_vllm.attend_into`), and the model reads them from there, so capturing z costs no copy; only a
site that edits copies its edited rows back. (On an H200 the 32 layers' copies
took 49 µs of a 32-row CUDA-graph decode step of an 8B-shaped stack, bench/gpu/staging_copies.py;
in the engine, 3-4 ms of a 32-request batch's 1.48 s decode, docs/notes/step-loop-overhead.md.)

A per-head site (q, k, v, z: `per_column`) has one more d-wide vector per slot, `columns`,
multiplied in with `factor` (1 for the identity): a head selector scales, or zeroes before a `set`,
only its heads' columns. Its `set` is then `values + h`, where `values` is zero outside the set
heads and `h` zero inside them, so one row can patch some heads and keep the others. Its
project_out takes the dot product per head (`d_head` columns at a time) with a direction that is
unit on each head it edits, so each head loses (clamp: has clipped) the component along its own
direction, as a hook on TransformerLens's [pos, head, d_head] tensor would; the bounds are the
same for every head.

The `set` values live in one buffer that every site shares ([max_set_edits x max_tokens, d]):
a row of the step belongs to one request, which carries at most `max_set_edits` set edits, so
its j-th set edit reads row `row * max_set_edits + j` whatever the site — no two sites' values
ever share a row, and the buffer never moves (graph-safe).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from replicas.api.arrays import unit
from replicas.api.hooks import HookPoint
from replicas.plans.request import EditPlan

# Columns of an edit-table row after its d-wide vectors (proj, add, and columns on per-head sites).
FACTOR_COLUMN, ADD_COEF_COLUMN, NORM_COEF_COLUMN, LO_COLUMN, HI_COLUMN = 0, 1, 2, 3, 4
GATED_COLUMN, GATE_BIAS_COLUMN, GATE_THRESHOLD_COLUMN = 5, 6, 7
SCALARS = 8


@torch.library.custom_op("capserve::stage_rows", mutates_args=("staging",))
def stage_rows(rows: torch.Tensor, staging: torch.Tensor) -> None:
    """Copy the step's rows into the static staging buffer (an opaque op for the compiler)."""
    staging[: rows.shape[0]].copy_(rows)


@stage_rows.register_fake
def _stage_rows_fake(rows: torch.Tensor, staging: torch.Tensor) -> None:
    return None


@torch.library.custom_op("capserve::attention_wrote", mutates_args=("staging",))
def attention_wrote(output: torch.Tensor, staging: torch.Tensor) -> None:
    """No work: the point after which `staging` holds the rows vLLM's attention op wrote in place of
    `output`. The op declares that it writes `output` only, so without this point a compiler could
    read `staging` before the attention ran."""


@attention_wrote.register_fake
def _attention_wrote_fake(output: torch.Tensor, staging: torch.Tensor) -> None:
    return None


class Site(nn.Module):
    def __init__(
        self,
        point: HookPoint,
        *,
        d_model: int,
        max_tokens: int,
        edit_stages: int,
        edit_slots: int,
        capture: bool,
        dtype: torch.dtype,
        device: torch.device,
        values: torch.Tensor | None = None,
        per_column: bool = False,
        written_in_place: bool = False,
        d_head: int | None = None,
    ):
        super().__init__()
        self.point = point
        self.per_column = per_column
        self.d_head = d_head or d_model  # columns one project_out dot product spans: a head's, or the whole row
        self.written_in_place = written_in_place  # its input's rows are already in `staging` (see above)
        self.vectors = 3 if per_column else 2  # d-wide vectors at the start of a table row
        self.edit_stages = edit_stages
        self.capture = capture
        # In eager mode the worker switches off the parts no request in the step uses; compiled
        # graphs are traced with both on and never read these flags again.
        self.run_edits = edit_stages > 0
        self.run_capture = capture
        if edit_stages:
            def buffer(*shape: int, fill: float = 0.0, kind: torch.dtype = dtype) -> torch.Tensor:
                return torch.full(shape, fill, dtype=kind, device=device)

            # One row per slot: [proj (d) | add (d) | factor | add_coef | norm_coef | lo | hi], so a
            # stage reads its row with a single gather; slot 0 (factor 1, the rest 0) is the identity.
            table = buffer(edit_stages, edit_slots, self.vectors * d_model + SCALARS)
            table[:, :, self.vectors * d_model + FACTOR_COLUMN] = 1.0
            if per_column:
                table[:, :, 2 * d_model : 3 * d_model] = 1.0
            self.register_buffer("table", table, persistent=False)
            self.register_buffer("slot", buffer(edit_stages, max_tokens, kind=torch.long), persistent=False)
            self.register_buffer("set_stage", buffer(max_tokens, fill=-1, kind=torch.long), persistent=False)
            self.register_buffer("set_row", buffer(max_tokens, kind=torch.long), persistent=False)
            if values is None:
                raise ValueError("a site that takes edits needs the shared `set` values buffer (replicas.worker.blocks)")
            # shared by every site (see the docstring); a narrower per-head site reads its first columns
            self.register_buffer("values", values[:, :d_model], persistent=False)
        if capture:
            self.register_buffer("staging", torch.zeros(max_tokens, d_model, dtype=dtype, device=device), persistent=False)
        self.d_model = d_model

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        if self.written_in_place:
            attention_wrote(h, self.staging)
            h = self.staging[:n]
        stages = self.edit_stages if self.run_edits else 0
        for stage in range(stages):
            h = self._edit_stage(h, stage, n)
        if self.run_capture and (stages or not self.written_in_place):
            stage_rows(h, self.staging)
        return h

    def _edit_stage(self, h: torch.Tensor, stage: int, n: int) -> torch.Tensor:
        """One stage in float32: in fp16 the sum of squares of a row with |h| > 256 overflows, and
        an inf norm times a zero coefficient would turn rows nobody edits into NaN."""
        d, scalars = self.d_model, self.vectors * self.d_model
        row = self.table[stage][self.slot[stage, :n]].float()
        direction, add = row[:, :d], row[:, d : 2 * d]
        factor = row[:, scalars + FACTOR_COLUMN].unsqueeze(-1)
        if self.per_column:
            factor = factor * row[:, 2 * d : 3 * d]
        add_coef = row[:, scalars + ADD_COEF_COLUMN].unsqueeze(-1)
        norm_coef = row[:, scalars + NORM_COEF_COLUMN].unsqueeze(-1)
        lo, hi = row[:, scalars + LO_COLUMN, None, None], row[:, scalars + HI_COLUMN, None, None]  # per row, for every head
        x = h.float()
        # A table row holds one op, so when the add is norm-matched the row's direction is 0 and
        # its factor 1, and the norm it needs is the input's.
        per_head, direction = x.unflatten(-1, (-1, self.d_head)), direction.unflatten(-1, (-1, self.d_head))
        dot = (per_head * direction).sum(-1, keepdim=True)
        norm = (x * x).sum(-1, keepdim=True).sqrt()
        # the component past [lo, hi] goes: all of it for project_out (lo = hi = 0), none where the direction is 0
        x = (per_head - (dot - torch.clamp(dot, lo, hi)) * direction).flatten(-2) * factor
        # the norm enters only rows whose op asked for it
        gated = row[:, scalars + GATED_COLUMN] != 0
        fires = (dot[:, 0, 0] + row[:, scalars + GATE_BIAS_COLUMN]) > row[:, scalars + GATE_THRESHOLD_COLUMN]
        gate = torch.where(gated, fires.float(), 1.0).unsqueeze(-1)
        x = x + gate * add * (add_coef + torch.where(norm_coef != 0, norm_coef * norm, 0.0))
        values = self.values.index_select(0, self.set_row[:n])
        if self.per_column:  # the row's `columns` zeroed the heads it sets
            values = (values.float() + x).to(h.dtype)
        return torch.where((self.set_stage[:n] == stage).unsqueeze(-1), values, x.to(h.dtype))


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array as the source of a non-blocking copy to `device`. For a GPU it goes to pinned
    memory first: from pageable memory the driver may wait for the stream (the step in flight)
    before it stages the copy, which costs a step loop running ahead of the GPU its lead. The
    caching host allocator reuses a pinned block only once the copy reading it has ended."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if device.type == "cuda" else tensor


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return host_tensor(array, device).to(device, non_blocking=True)


def identity_row(d_model: int, per_column: bool = False) -> np.ndarray:
    vectors = 3 if per_column else 2
    row = np.zeros(vectors * d_model + SCALARS, dtype=np.float32)
    row[vectors * d_model + FACTOR_COLUMN] = 1.0
    if per_column:
        row[2 * d_model : 3 * d_model] = 1.0
    return row


def table_row(edit: EditPlan, d_model: int, per_column: bool = False) -> np.ndarray:
    """The edit-table row (see replicas.worker.sites) that applies one intervention."""
    row = identity_row(d_model, per_column)
    if edit.columns is not None:
        if not per_column:
            raise ValueError(f"a head selector needs a per-head site; {edit.site} is not one")
        row[2 * d_model : 3 * d_model] = edit.columns
    scalars = (3 if per_column else 2) * d_model
    if edit.op == "project_out":
        row[:d_model] = edit.direction
    elif edit.op == "clamp":  # an open side's infinite bound clips nothing (the table's dtype holds inf)
        row[:d_model] = edit.direction
        row[scalars + LO_COLUMN], row[scalars + HI_COLUMN] = edit.lo, edit.hi
    elif edit.op == "scale":
        row[scalars + FACTOR_COLUMN] = edit.factor
    if edit.gate is not None:  # the read-out's direction where clamp keeps its own, with bounds that clip nothing
        row[:d_model] = edit.gate[0]
        row[scalars + LO_COLUMN], row[scalars + HI_COLUMN] = -np.inf, np.inf
        row[scalars + GATED_COLUMN], row[scalars + GATE_BIAS_COLUMN], row[scalars + GATE_THRESHOLD_COLUMN] = 1.0, edit.gate[1], edit.gate[2]
    if edit.op == "add" and edit.norm_match:
        row[d_model : 2 * d_model] = unit(edit.direction)
        row[scalars + NORM_COEF_COLUMN] = edit.scale
    elif edit.op == "add":
        row[d_model : 2 * d_model] = edit.direction * edit.scale
        row[scalars + ADD_COEF_COLUMN] = 1.0
    return row  # set: identity row; its values are written per step


def stacked_rows(sites: list[Site], rows: torch.Tensor, width: int) -> torch.Tensor:
    """[hooks, rows, width]: these rows of each site's staging buffer, narrower ones zero-padded."""
    if len(sites) == 1 and sites[0].staging.shape[1] == width:  # no stacked copy of a single hook
        return sites[0].staging.index_select(0, rows).unsqueeze(0)
    blocks = [site.staging.index_select(0, rows) for site in sites]
    return torch.stack([b if b.shape[1] == width else torch.nn.functional.pad(b, (0, width - b.shape[1])) for b in blocks])

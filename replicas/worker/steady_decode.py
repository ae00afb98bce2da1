"""A decode step like the one before it, collected without the selection.

When the same capturing requests decode step after step in the same order, each step selects the
same thing: every request's one new row, into its arena blocks. The collector recognises such a
step by its key (`decode_key`), and writes it as the step before did (`SteadyDecode`): at a few
dozen requests the selection's numpy, not the GPU, set the step loop's pace, and at hundreds the
per-request Python of finding each row's block did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from replicas.plans.positions import MODE_CODES
from replicas.worker.request_table import NO_LOGITS, Batch, Columns
from replicas.worker.sites import Site

# modes that select no generated position: a decode step selects none of their rows
PROMPT_ONLY = (MODE_CODES["prompt"], MODE_CODES["last_prompt"])


@dataclass
class SteadyDecode:
    """A decode step's capture, as the full selection found it: every capturing request in one
    group, selecting its one new row, filing into the arena. The next step of the same requests
    in the same order (`key`) writes the same way."""

    key: bytes
    places: np.ndarray  # the capturing requests' places in the step (= their rows: one each); none in a quiet step
    rows: np.ndarray  # their rows in the request columns
    buffers: list = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)
    width: int = 0
    out: torch.dtype = torch.float32
    row_bytes: int = 0
    table_slots: tuple[np.ndarray, np.ndarray] | None = None  # their block table rows (`arena_writer.table_slots`)

    def advance(self, batch: Batch, columns: Columns) -> np.ndarray | None:
        """Count this step's row of each request as seen and taken; their destinations (each
        request's row number), or None, with nothing counted, when a request failed meanwhile."""
        if any(b.error is not None for b in self.buffers):
            return None
        columns["seen"][self.rows] = batch.step.start_positions[self.places] + 1
        taken = columns["rows_taken"]
        dests = taken[self.rows]
        taken[self.rows] = dests + 1
        return dests


def decode_key(batch: Batch, columns: Columns, arena: bool) -> tuple[bytes, np.ndarray] | None:
    """What a `SteadyDecode` step is known by, and the places of the requests whose row it
    captures; None for any other step: a prefill chunk, SAE features or read-outs, logits of generated
    positions, positions other than "all" and "generated" (a decode row is a generated one:
    "prompt" and "last_prompt" select none, explicit indices may), two capture groups, rows
    recorded before (a request recomputed after preemption), rows to capture without an arena."""
    rows = batch.rows
    if not batch.step.one_token_each or (columns["sae"][rows] > 0).any() or (columns["readouts"][rows] > 0).any():
        return None
    group, modes, logits = columns["group"][rows], columns["positions"][rows], columns["logits"][rows]
    if np.isin(logits, (NO_LOGITS, *PROMPT_ONLY), invert=True).any():
        return None
    reads = (group >= 0) & np.isin(modes, PROMPT_ONLY, invert=True)
    places = np.flatnonzero(reads)
    if len(places) and not arena:
        return None
    selecting = modes[places]
    if ((selecting != MODE_CODES["all"]) & (selecting != MODE_CODES["generated"])).any():
        return None
    if (group[places] != group[places[:1]]).any():
        return None
    asking = np.flatnonzero((group >= 0) | (logits != NO_LOGITS))
    if not batch.is_decode(columns["prompt_len"][rows[asking]], asking):
        return None
    if (columns["seen"][rows[places]] != batch.step.start_positions[places]).any():
        return None
    return np.concatenate([rows, group, modes, logits]).tobytes(), places

"""Engine-side admission of interventions: a request waits until each of its ops fits the worker's
edit table, so a full table delays requests instead of failing them in the worker."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from replicas.api.errors import PlanError


class EditSlots:
    """Admits a request with interventions once each of its ops fits the worker's edit table.
    Requests with the same op at the same hook and stage share one table row (the worker keys rows
    by content), so the limit counts distinct ops per hook and stage, not requests."""

    def __init__(self, slots: int):
        self.slots = slots
        self.users: Counter[tuple] = Counter()  # op -> requests holding it
        self.per_hook: Counter[tuple] = Counter()  # (layer, kind, stage) -> distinct ops held
        self.changed = asyncio.Condition()

    def check(self, wire_edits: list[dict[str, Any]]) -> None:
        """Refuse a request that alone needs more rows at one hook and stage than there are: it
        would wait for ever. (Edits at disjoint positions share a stage, one row each.)"""
        per_hook = Counter(op[:3] for op in {_op_key(edit) for edit in wire_edits})
        for (layer, kind, _), n in per_hook.items():
            if n > self.slots:
                raise PlanError(
                    f"interventions: {n} distinct edits at layer {layer} {kind} apply side by side; this replica "
                    f"holds at most {self.slots} there at once (engine option edit_slots)"
                )

    @asynccontextmanager
    async def hold(self, wire_edits: list[dict[str, Any]]) -> AsyncIterator[None]:
        ops = {_op_key(edit) for edit in wire_edits}
        async with self.changed:
            await self.changed.wait_for(lambda: self._fits(ops))
            for op in ops:
                self.per_hook[op[:3]] += self.users[op] == 0
                self.users[op] += 1
        try:
            yield
        finally:
            async with self.changed:
                for op in ops:
                    self.users[op] -= 1
                    if not self.users[op]:
                        del self.users[op]
                        self.per_hook[op[:3]] -= 1
                self.changed.notify_all()

    def _fits(self, ops: set[tuple]) -> bool:
        new = Counter(op[:3] for op in ops if op not in self.users)
        return all(self.per_hook[hook] + n <= self.slots for hook, n in new.items())


def _op_key(edit: dict[str, Any]) -> tuple:
    """What decides an edit's table row (a `set` row is the identity; its values go per row)."""
    where = (edit["layer"], edit["kind"], edit["stage"])
    columns = edit["columns"]["data"] if edit.get("columns") is not None else None  # a head selector
    if edit["op"] == "set":
        return (*where, "set", columns)
    vector = edit["vector"]["data"] if edit["vector"] is not None else None
    gate = edit.get("gate")
    gate_key = None if gate is None else (gate["vector"]["data"], gate["bias"], gate["threshold"])
    return (*where, edit["op"], vector, edit["scale"], edit["norm_match"], edit["factor"], columns, edit.get("min"),
            edit.get("max"), gate_key)

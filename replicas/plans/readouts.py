"""One read-out of a request as the worker reads it (replicas.readouts.specs builds its wire form)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from replicas.api import Positions


@dataclass
class ReadoutPlan:
    """A lens or probe of one request; `taken` counts the rows handed over so far."""

    kind: str  # logit_lens | tuned_lens | probe
    site: tuple[int | None, str]  # the site whose staging rows it reads
    hook: str  # as the request named it (a probe's own when it named none)
    positions: Positions
    max_rows: int
    width: int  # lenses: top_k; probes: n_out
    translator: int = -1  # tuned_lens: index of the translator (the block whose input the rows are)
    probe: str | None = None
    taken: int = 0  # lenses; a probe's count is its region's in the probe's store (replicas.readouts.store)
    region: int = -1  # probes: their rows' region in that store

    @property
    def group(self) -> Hashable:
        """Specs of one group read the same rows the same way: one device computation serves them."""
        if self.kind == "probe":
            return ("probe", self.probe)
        return ("lens", self.site, self.translator)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ReadoutPlan:
        return cls(
            kind=wire["kind"], site=(wire["layer"], wire["site_kind"]), hook=wire["hook"], positions=wire["positions"],
            max_rows=int(wire["max_rows"]), width=int(wire["width"]), translator=int(wire["translator"]),
            probe=wire["probe"],
        )

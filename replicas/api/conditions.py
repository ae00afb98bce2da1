"""Conditional steering: an `add` that applies only at the positions where a linear read-out of the
same hook crosses a threshold, decided row by row inside the forward (`Intervention.when`).

The read-out is a direction and a bias, `x . vector + bias`, taken on the hook's value before the
edit: given inline, or a registered probe's output (engine option `probes`), or an SAE feature's
activation (engine option `saes`; the replica turns either into a vector and a bias). The test is
strict: `above` fires where the read-out is greater than it, `below` where it is less.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.api.fields import FloatArray


class Condition(BaseModel):
    """Where an intervention applies: the rows whose read-out crosses the threshold."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    probe: str | None = Field(None, description="A probe the replica loaded (engine option probes); it must read the edited hook.")
    output: int = Field(0, ge=0, description="probe: which of its outputs.")
    sae_id: str | None = Field(None, description="An SAE the replica loaded (engine option saes), with `feature`: its activation.")
    feature: int | None = Field(None, ge=0, description="sae_id: the feature whose activation is tested.")
    vector: FloatArray | None = Field(None, description="An inline read-out direction, [width of the hook].")
    bias: float = Field(0.0, description="vector: added to x . vector.")
    above: float | None = Field(None, description="Fire where the read-out is greater than this.")
    below: float | None = Field(None, description="Fire where the read-out is less than this.")

    @model_validator(mode="after")
    def _one_source_one_test(self) -> "Condition":
        sources = [name for name, given in (("probe", self.probe is not None), ("sae_id", self.sae_id is not None),
                                            ("vector", self.vector is not None)) if given]
        if len(sources) != 1:
            raise ValueError(f"when: give exactly one of probe, sae_id (with feature) or vector; got {sources or 'none'}")
        if (self.sae_id is None) != (self.feature is None):
            raise ValueError("when: sae_id and feature go together")
        if self.vector is not None and self.vector.ndim != 1:
            raise ValueError(f"when.vector: a 1-D read-out direction, got shape {list(self.vector.shape)}")
        if (self.above is None) == (self.below is None):
            raise ValueError("when: give exactly one of above or below")
        if self.sae_id is not None and ((self.above is not None and self.above < 0) or (self.below is not None and self.below <= 0)):
            raise ValueError("when: an SAE feature's activation is never negative; use above >= 0 or below > 0")
        return self

    @property
    def threshold(self) -> float:
        return self.above if self.above is not None else self.below  # type: ignore[return-value]

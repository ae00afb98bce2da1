"""What a replica serves (`Router.info()`, `GET /v1/info`): the model's shape, its hooks, and the
SAEs, probes and tuned lens loaded at start, which requests name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AttentionInfo(BaseModel):
    """The model's attention as its engine runs it; lists hold one value per layer."""

    model_config = ConfigDict(extra="forbid")
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_head_v: int
    scale: list[float]
    soft_cap: list[float] = Field(description="Logit soft-capping (0: none).")
    sliding_window: list[int | None] = Field(description="Keys within this many positions of the query (itself included); None: all.")
    sinks: list[list[float]] | None = Field(
        None, description="Per layer, each head's attention sink logit (gpt-oss): a column every query's softmax "
        "takes weight from, that no key holds; None: the model has none."
    )


class MoeInfo(BaseModel):
    """A mixture-of-experts model's routers."""

    model_config = ConfigDict(extra="forbid")
    n_experts: int = Field(description="Experts each router chooses from: the width of hook_router_logits.")
    top_k: int = Field(description="Experts each token is routed to: the width of hook_expert_ids.")
    layers: list[int] = Field(description="The layers with a router; the others have a dense MLP.")


class SaeInfo(BaseModel):
    """An SAE loaded at start (engine option `saes`): a request's `sae[].sae_id` names it."""

    model_config = ConfigDict(extra="forbid")
    hook: str = Field(description="The hook it reads.")
    d_sae: int = Field(description="Its features.")
    architecture: str = Field(description="standard, topk, jumprelu, ...")
    k: int | None = Field(None, description="TopK SAEs: the features active per token.")


class ProbeInfo(BaseModel):
    """A linear probe loaded at start (engine option `probes`): a read-out's `probe` names it."""

    model_config = ConfigDict(extra="forbid")
    hook: str = Field(description="The hook it reads.")
    n_out: int = Field(description="Its outputs per position.")


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    architecture: str
    n_layers: int
    d_model: int
    d_vocab: int
    max_model_len: int
    dtype: str
    hook_names: list[str]
    armed_kinds: list[str]
    attention: AttentionInfo | None = None
    moe: MoeInfo | None = Field(None, description="The routers; None for a dense model.")
    saes: dict[str, SaeInfo] = Field(default_factory=dict, description="SAEs loaded at start, by id.")
    probes: dict[str, ProbeInfo] = Field(default_factory=dict, description="Linear probes loaded at start, by name.")
    tuned_lens: bool = Field(False, description="Whether read-outs of kind tuned_lens are served (a tuned lens was loaded).")

    @property
    def probe_widths(self) -> dict[str, int]:
        """Each probe's outputs per position, by name (the cost model's read-out bytes)."""
        return {name: probe.n_out for name, probe in self.probes.items()}

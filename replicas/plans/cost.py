"""How much work a request asks of an engine, in token-equivalents; torch-free, used by the router.

cost = prompt_tokens * prompt_token_weight + max_tokens * n + returned_bytes / capture_bytes_per_token

The router balances replicas by the sum of this over their outstanding requests, so a 4,000-token
capture does not count the same as a 5-token chat turn. The prompt length is estimated without a
tokenizer (the router has none): token ids count exactly, text as one token per 4 UTF-8 bytes
(plus BOS), chat as that plus a few template tokens per message. Returned bytes are activations,
logits and read-outs, the payload the replica copies out of the engine and through the object store.
"""

from __future__ import annotations

from collections.abc import Mapping

from replicas.api import GenerateRequest, Positions
from replicas.plans.positions import count_positions

BYTES_PER_TOKEN_ESTIMATE = 4  # BPE tokenizers average ~4 bytes of English per token
CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds
DEFAULT_CAPTURE_BYTES_PER_TOKEN = 256 << 10


def estimate_prompt_tokens(request: GenerateRequest) -> int:
    prompt = request.prompt
    if isinstance(prompt, str):
        return 1 + len(prompt.encode()) // BYTES_PER_TOKEN_ESTIMATE
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    tools = sum(len(t.model_dump_json()) for t in request.tools or ()) // BYTES_PER_TOKEN_ESTIMATE
    return 1 + tools + sum(  # chat messages; tool calls and tool specs count as their JSON text
        CHAT_TOKENS_PER_MESSAGE
        + (len((m.content or "").encode()) + sum(len(c.model_dump_json()) for c in m.tool_calls or ())) // BYTES_PER_TOKEN_ESTIMATE  # type: ignore[union-attr]
        for m in prompt
    )


def returned_bytes(
    request: GenerateRequest, prompt_tokens: int, d_model: int, d_vocab: int, probe_widths: Mapping[str, int] | None = None,
) -> int:
    """Activation, logit and read-out bytes the request will bring back (an estimate for text
    prompts); `probe_widths`: each loaded probe's outputs (ModelInfo.probes)."""
    def rows(positions: Positions) -> int:
        return count_positions(positions, prompt_tokens, request.max_tokens)

    total = 0
    capture = request.capture
    if capture is not None:
        itemsize = 4 if capture.dtype == "float32" else 2
        total += len(capture.hooks) * (1 if capture.reduce == "mean" else rows(capture.positions)) * d_model * itemsize
    if request.logits is not None:
        total += rows(request.logits.positions) * d_vocab * 4
    for readout in request.readouts:
        if readout.kind == "probe":  # float32 outputs
            total += rows(readout.positions) * (probe_widths or {}).get(readout.probe, 1) * 4
        else:  # a lens: an int32 id and a float32 logprob per token
            total += rows(readout.positions) * readout.top_k * 8
    for sae in request.sae:  # feature ids and values, and the error's norm or vector
        total += rows(sae.positions) * (sae.top_k * 8 + {"none": 0, "norm": 4}.get(sae.error, d_model * 4))
    return total


def request_cost(
    request: GenerateRequest,
    d_model: int,
    d_vocab: int,
    *,
    probe_widths: Mapping[str, int] | None = None,
    prompt_token_weight: float = 1.0,
    capture_bytes_per_token: int = DEFAULT_CAPTURE_BYTES_PER_TOKEN,
) -> float:
    prompt = estimate_prompt_tokens(request)
    generated = request.max_tokens * request.n
    payload = returned_bytes(request, prompt, d_model, d_vocab, probe_widths)
    return prompt * prompt_token_weight + generated + payload / capture_bytes_per_token

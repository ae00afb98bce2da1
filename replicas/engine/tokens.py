"""Tokenizer work the OpenAI routes ask a replica for (the Router has no tokenizer).

- `tokenize`: /tokenize as vLLM serves it; a chat prompt is rendered exactly as generate()
  renders it (chat template, tools), through the engine's own `prompt_token_ids`.
- `detokenize`, `token_strings`: /detokenize, and the text of tokens in logprobs and echo.
- `fill_max_tokens`: OpenAI chat's default when max_tokens is omitted, as vLLM does it: all the
  room the model's context leaves after the prompt.
"""

from __future__ import annotations

from typing import Any

from replicas import _vllm
from replicas.api import GenerateRequest
from replicas.api.errors import InvalidRequestError


def _tokenizer(engine: Any) -> Any:
    if engine.tokenizer is None:
        raise InvalidRequestError("this replica runs without a tokenizer (skip_tokenizer_init); send and read token ids")
    return engine.tokenizer


def prompt_token_ids(engine: Any, request: GenerateRequest) -> list[int]:
    """The prompt's token ids as generate() would run them (max_tokens does not matter)."""
    return engine.prompt_token_ids(request.model_copy(update={"max_tokens": 1}))


def fill_max_tokens(engine: Any, request: GenerateRequest, max_model_len: int) -> GenerateRequest:
    room = max_model_len - len(prompt_token_ids(engine, request))
    # no room: max_tokens 1 lets the engine refuse the prompt, naming its length and the limit
    return request.model_copy(update={"max_tokens": max(room, 1)})


def tokenize(engine: Any, request: GenerateRequest, add_special_tokens: bool, token_strs: bool) -> dict[str, Any]:
    tokenizer = _tokenizer(engine)
    if isinstance(request.prompt, str):
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens))
    else:
        ids = prompt_token_ids(engine, request)
    return {"tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids) if token_strs else None}


def detokenize(engine: Any, ids: list[int], vocab: int) -> str:
    _check_ids(ids, vocab)
    return _tokenizer(engine).decode(ids)


def token_strings(engine: Any, ids: list[int], vocab: int) -> list[str]:
    """Each token's own text (what logprobs report as `token`), as vLLM's OpenAI server shows it:
    a SentencePiece "▁hello" is " hello" (`_vllm.token_texts`)."""
    _check_ids(ids, vocab)
    return _vllm.token_texts(_tokenizer(engine), ids)


def _check_ids(ids: list[int], vocab: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InvalidRequestError(f"tokens: ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")

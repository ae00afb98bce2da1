"""Logprobs on the OpenAI routes equal what vLLM's own OpenAI server answers for the same rows.

The references are vLLM's serving functions themselves (`_create_chat_logprobs`,
`_create_completion_logprobs`) on Logprob rows built as vLLM's output processor builds them
(`append_logprobs_for_next_position`, `convert_ids_list_to_tokens`). Tokenizers are made here
with the `tokenizers` library: a SentencePiece-style one (Metaspace, "▁") and a byte-level one
("Ġ"); nothing is downloaded.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deploy.openai_responses import chat_logprobs, completion_logprobs
from replicas.api.streaming import DeltaTracker
from replicas.engine.tokens import token_strings

SENTENCEPIECE = ["<unk>", "▁hello", "hello", "▁world", "▁", ",", "▁the", "▁mill", "▁river"]
BYTE_LEVEL = ["<unk>", "Ġhello", "hello", "Ġworld", "Ġ", ",", "Ġthe", "Ġmill", "Ġriver"]


def tokenizer(pieces: list[str], byte_level: bool) -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level else pre_tokenizers.Metaspace()
    model.decoder = decoders.ByteLevel() if byte_level else decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")


@pytest.fixture(params=["sentencepiece", "byte_level"])
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return tokenizer(BYTE_LEVEL, True) if request.param == "byte_level" else tokenizer(SENTENCEPIECE, False)


def test_token_strings_keep_the_leading_space_of_a_piece(tok):
    """"▁hello" and "Ġhello" are " hello", as vLLM's server shows them; decode() of the one
    token drops a SentencePiece piece's space, which is what capserve sent before."""
    from vllm.entrypoints.generate.base.serving import decode_token_ids

    ids = list(range(1, len(SENTENCEPIECE)))
    engine = SimpleNamespace(tokenizer=tok)
    texts = token_strings(engine, ids, len(SENTENCEPIECE))
    assert texts[:4] == [" hello", "hello", " world", " "]
    assert texts == [text for text, _ in decode_token_ids(ids, tok)]  # vLLM's OpenAI server's own helper
    tracker = DeltaTracker(partial(token_strings, engine, vocab=len(SENTENCEPIECE)))  # streamed deltas: the same texts
    rows = [{1: SimpleNamespace(logprob=-0.5), 3: SimpleNamespace(logprob=-1.0)}]
    tracker.feed(SimpleNamespace(outputs=[SimpleNamespace(index=0, text=" hello", token_ids=[1], finish_reason=None, logprobs=rows)]))
    assert tracker.drain().tokens == {1: " hello", 3: " world"}


# Per position: (token there, [(id, logprob) of vLLM's top-k by rank]): the token among the top k,
# outside them, ties, and -inf.
POSITIONS = [
    (1, [(1, -0.1), (3, -2.5), (6, -3.0)]),
    (7, [(3, -0.2), (8, -0.9), (6, -1.4)]),  # sampled (-4.0) outside the top 3
    (6, [(5, -0.7), (6, -0.7), (2, -0.7)]),
    (4, [(2, -0.05), (1, float("-inf")), (5, float("-inf"))]),
]
SAMPLED = {1: -0.1, 7: -4.0, 6: -0.7, 4: -6.0}


def vllm_rows(tok, k: int) -> list[dict[int, object]]:
    """The Logprob rows vLLM's output processor makes: ids [sampled, top 1..k], their decoded tokens."""
    from vllm.logprobs import append_logprobs_for_next_position
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    rows: list[dict[int, object]] = []
    for token, top in POSITIONS:
        ids = [token] + [t for t, _ in top[:k]]
        logprobs = [SAMPLED[token]] + [v for _, v in top[:k]]
        rank = 1 + sum(v > SAMPLED[token] for _, v in top)
        append_logprobs_for_next_position(rows, ids, logprobs, convert_ids_list_to_tokens(tok, ids), rank, k)
    return rows


def capserve_rows(rows: list[dict[int, object]]) -> list[dict[int, float]]:
    """What a GenerateResult holds for them: {id: logprob} in vLLM's order, as replicas.engine.results
    keeps them (the answers sort by logprob; only equal logprobs need that order)."""
    return [{t: lp.logprob for t, lp in row.items()} for row in rows]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_chat_and_completion_logprobs_equal_vllms_serving(tok, k):
    """Chat's top_logprobs are the first k of the position's row in vLLM's order (its own token
    first, so a sampled token outside the top k displaces the k-th); completions' top_logprobs
    hold k + 1, always including the sampled token."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    rows = vllm_rows(tok, k)
    token_ids = [token for token, _ in POSITIONS]
    ids = sorted({t for row in rows for t in row})
    text = dict(zip(ids, token_strings(SimpleNamespace(tokenizer=tok), ids, len(SENTENCEPIECE))))
    serving = SimpleNamespace(return_tokens_as_token_ids=False, _get_decoded_token=OpenAIServingChat._get_decoded_token)
    serving._get_top_logprobs = partial(OpenAIServingChat._get_top_logprobs, serving)

    expected = OpenAIServingCompletion._create_completion_logprobs(serving, token_ids, rows, k, tok).model_dump()
    got = completion_logprobs(token_ids, capserve_rows(rows), k, text).model_dump()
    assert got["tokens"] == expected["tokens"] and got["text_offset"] == expected["text_offset"]
    assert [max(v, -9999.0) for v in got["token_logprobs"]] == expected["token_logprobs"]
    assert [list(top.items()) for top in got["top_logprobs"]] == [list(top.items()) for top in expected["top_logprobs"]]
    assert all(text[token] in top for token, top in zip(token_ids, got["top_logprobs"]))

    expected = OpenAIServingChat._create_chat_logprobs(serving, token_ids, rows, tok, num_output_top_logprobs=k).content
    got = chat_logprobs(token_ids, capserve_rows(rows), k, text)
    assert [(e.token, e.logprob, e.bytes) for e in got] == [(e.token, e.logprob, e.bytes) for e in expected]
    assert ([[(x.token, x.logprob, x.bytes) for x in e.top_logprobs] for e in got]
            == [[(x.token, x.logprob, x.bytes) for x in e.top_logprobs] for e in expected])

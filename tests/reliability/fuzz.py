"""Hypothesis strategies for hostile GenerateRequests, and the rule a rejection must follow.

The strategies mix valid values with near misses (a layer past the last, a vector one short, NaN,
a huge max_tokens, unknown keys, wrong types) so most examples reach a different check; valid
ones stay cheap (a few tokens on the tiny model).
"""

from __future__ import annotations

import base64
import re
from typing import Any

import numpy as np
from hypothesis import strategies as st

from replicas.api import GenerateRequest

D_MODEL = 128
VALID_HOOKS = ["blocks.0.hook_resid_pre", "blocks.3.hook_mlp_out", "ln_final.hook_normalized", "2:attn_out",
               "blocks.1.hook_out", "blocks.2.ln2.hook_in"]
BAD_HOOKS = ["blocks.9.hook_resid_post", "blocks.-1.hook_resid_pre", "blocks.0.hook_nonsense", "99:resid_post",
             "ln_final.hook_normalized.x", "", "blocks..hook_in", "blocks.1e3.hook_out"]
FIELDS = set(GenerateRequest.model_fields) | {"request", "requests"}


def _encoded(dtype: str, shape: list[int], n_bytes: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(b"\x00" * n_bytes).decode()}


def vectors() -> st.SearchStrategy[Any]:
    good = np.linspace(-1, 1, D_MODEL, dtype=np.float32).tolist()
    return st.one_of(
        st.just(good),
        st.just(good[:-1]),  # one short
        st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=8),
        st.just([good, good]),
        st.just(_encoded("float32", [D_MODEL], 4 * D_MODEL)),
        st.just(_encoded("float32", [10**12], 8)),  # shape and bytes disagree
        st.just(_encoded("object", [1], 8)),  # no pickled objects
        st.just({"dtype": "float32", "shape": [2], "data": "not base64!"}),
        st.text(max_size=10),
        st.none(),
    )


def positions() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(["all", "prompt", "generated", "last_prompt", "first", ""]),
        st.lists(st.integers(-600, 600), max_size=4),
        st.lists(st.integers(-(2**70), 2**70), min_size=1, max_size=2),
    )


def hooks() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(VALID_HOOKS), st.sampled_from(BAD_HOOKS), st.text(max_size=24))


def interventions() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"hook": hooks(), "op": st.sampled_from(["add", "scale", "set", "project_out", "delete"])},
        optional={
            "vector": vectors(),
            "values": vectors(),
            "factor": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3)),
            "scale": st.floats(allow_nan=True, allow_infinity=True),
            "norm_match": st.booleans(),
            "positions": positions(),
            "phase": st.sampled_from(["prefill", "decode", "all", "later"]),
        },
    )


def prompts() -> st.SearchStrategy[Any]:
    chat = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                  "content": st.text(max_size=40)})
    return st.one_of(
        st.text(max_size=120),
        st.lists(st.integers(-3, 2000), max_size=40),
        st.lists(chat, max_size=3),
        st.integers(),
        st.none(),
        st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=3),
    )


def capture_specs() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.fixed_dictionaries(
            {"hooks": st.lists(hooks(), max_size=3)},
            optional={"positions": positions(), "reduce": st.sampled_from(["none", "mean", "max"]),
                      "dtype": st.sampled_from(["float32", "float16", "bfloat16", "float64", "object"])},
        ),
        st.text(max_size=5),
    )


def requests() -> st.SearchStrategy[dict[str, Any]]:
    small = st.integers(-2, 6)
    huge = st.sampled_from([511, 512, 10**6, 2**63, 2**70])
    return st.fixed_dictionaries(
        {"prompt": prompts()},
        optional={
            "max_tokens": st.one_of(small, huge),
            "temperature": st.one_of(st.floats(-1, 3), st.just(float("nan"))),
            "top_p": st.floats(-0.5, 1.5),
            "top_k": st.integers(-1, 50),
            "seed": st.one_of(st.none(), st.integers(-(2**65), 2**65)),
            "stop": st.one_of(st.lists(st.text(max_size=4), max_size=3), st.text(max_size=4)),
            "n": st.integers(-1, 20),
            "logprobs": st.integers(-1, 25),
            "prompt_logprobs": st.integers(-1, 25),
            "ignore_eos": st.booleans(),
            "capture": capture_specs(),
            "interventions": st.lists(interventions(), max_size=2),
            "logits": st.fixed_dictionaries({"positions": positions()}),
            "tempreature": st.floats(0, 1),  # a typo must be refused, not ignored
        },
    )


def names_a_field(message: str) -> bool:
    """A 4xx message must say which field is wrong: a GenerateRequest field name as a word."""
    words = set(re.findall(r"[A-Za-z_]+", message))
    return bool(words & FIELDS)

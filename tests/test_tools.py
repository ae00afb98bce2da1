"""Tool calling: schemas, the tiny models' Hermes-style template, vLLM's parser on model output,
and (marked engine) one real CPU engine with tool_call_parser=hermes: the rendered prompt holds
the tools, a forced call comes back as a ToolCall whose arguments match the schema, a second turn
with the result renders and generates, tool_choice none parses nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from replicas.api import Choice, GenerateRequest, GenerateResult
from replicas.api.errors import InvalidRequestError

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        },
    },
}
# strict: a constrained call's arguments follow the schema, whose values are all short, so a
# random-weight model constrained to it ends its call within a few tokens
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "exact": {"type": "boolean"}},
            "required": ["city", "exact"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is 1 + 2?"}]
CALL = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1, "y": 2}'}}
SECOND_TURN = USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "3", "tool_call_id": "call-1", "name": "add"}]
OLD_TEMPLATE = (  # the tiny models' template before it learned tools
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def req(**fields: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"prompt": USER, **fields})


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize(
    "fields, where",
    [
        ({"prompt": "Hello", "tools": [ADD]}, "tools: need a chat prompt"),
        ({"prompt": [1, 2, 3], "tools": [ADD]}, "tools: need a chat prompt"),
        ({"tools": []}, "tools: must not be an empty list"),
        ({"tools": [ADD, ADD]}, "tools: function names must be unique"),
        ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "function 'mul' is not in tools"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        ({"prompt": [{"role": "tool", "content": "3"}]}, "tool message needs tool_call_id"),
        ({"prompt": [{"role": "user"}]}, "user message needs content"),
        ({"prompt": [{"role": "system", "content": None}]}, "system message needs content"),
        ({"prompt": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "tool_calls belong to assistant messages"),
        ({"prompt": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "tool_call_id belongs to tool messages"),
        ({"prompt": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "add"}}]}]}, "arguments"),
    ],
)
def test_bad_tool_requests_name_the_field(fields, where):
    with pytest.raises(ValidationError, match=where):
        GenerateRequest.model_validate({"prompt": USER, **fields})


def test_tool_requests_validate_and_default_to_auto():
    request = GenerateRequest.model_validate({"prompt": SECOND_TURN, "tools": [ADD]})
    assert request.tool_choice is None and request.tool_choice_name == "auto" and request.is_chat
    assistant = request.prompt[1]
    assert assistant.content is None and assistant.tool_calls[0].function.arguments == '{"x": 1, "y": 2}'
    assert request.prompt[2].tool_call_id == "call-1" and request.prompt[2].name == "add"
    assert req(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}}).tool_choice_name == "add"
    assert req(tools=[ADD], tool_choice="none").tool_choice_name == "none"
    assert req(tool_choice="none").tools is None  # "none" needs no tools, as in vLLM
    assert req().tool_choice_name is None
    dumped = req(tools=[ADD]).model_dump(exclude_none=True)["tools"][0]
    assert dumped == {"type": "function", "function": ADD["function"]}


def test_choice_content_is_the_text_unless_tools_parsed_it():
    plain = Choice(text="hi", token_ids=[1], finish_reason="stop")
    assert plain.content == "hi" and plain.tool_calls is None
    called = Choice(text="<tool_call>...", token_ids=[1], finish_reason="tool_calls", content=None, tool_calls=[CALL])
    assert called.content is None and called.tool_calls[0].id == "call-1"
    result = GenerateResult(request_id="r", text="x", token_ids=[1], prompt_token_ids=[2], finish_reason="stop", choices=[called], tool_calls=called.tool_calls)
    assert result.tool_calls[0].function.name == "add"


def test_cost_counts_tool_calls_and_tool_specs():
    from replicas.plans.cost import estimate_prompt_tokens

    plain = estimate_prompt_tokens(GenerateRequest.model_validate({"prompt": SECOND_TURN}))
    assert estimate_prompt_tokens(GenerateRequest.model_validate({"prompt": SECOND_TURN, "tools": [ADD]})) > plain > 3 * 4


# ---------------------------------------------------------------- the tiny models' template


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from replicas.tiny import _train_tokenizer

    return _train_tokenizer("llama")


def test_tiny_template_renders_plain_chats_as_before(tokenizer):
    chats = [USER, [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "3"}, {"role": "user", "content": "Sure?"}]]
    for chat in chats:
        for generation in (True, False):
            new = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
            assert new == tokenizer.apply_chat_template(chat, chat_template=OLD_TEMPLATE, tokenize=False, add_generation_prompt=generation)


def test_tiny_template_renders_tools_calls_and_results_in_hermes_format(tokenizer):
    from replicas.engine.tools import template_inputs

    system = [{"role": "system", "content": "Be brief."}]
    request = GenerateRequest.model_validate({"prompt": system + SECOND_TURN, "tools": [ADD]})
    messages, _ = template_inputs(request, None)
    text = tokenizer.apply_chat_template(messages, tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.\n\n<tools>\n" + json.dumps(ADD) + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # the byte-level BPE spells every marker


def test_a_cached_tiny_model_gets_the_tool_template_and_keeps_its_weights(tmp_path):
    from replicas.tiny import CHAT_TEMPLATE, make_tiny_model

    folder = tmp_path / "tiny"
    make_tiny_model("llama", folder, seed=1)
    weights = (folder / "model.safetensors").read_bytes()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = OLD_TEMPLATE  # as built before tools
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(OLD_TEMPLATE)
    make_tiny_model("llama", folder, seed=1)
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (folder / "model.safetensors").read_bytes() == weights
    from transformers import AutoTokenizer

    assert "<tools>" in AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(USER, tools=[ADD], tokenize=False)


# ---------------------------------------------------------------- vLLM's parser on model output


@pytest.fixture(scope="module")
def hermes(tokenizer) -> Any:
    from replicas.engine.tools import ToolCalling

    return ToolCalling("hermes", tokenizer)


def test_hermes_output_becomes_a_tool_call_with_the_markup_removed(hermes):
    turn = hermes.turn(req(tools=[ADD]))
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    parsed = turn.parse(text, [5, 6], "stop")
    assert parsed["content"] == "Let me add.\n" and parsed["finish_reason"] == "tool_calls"
    (call,) = parsed["tool_calls"]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"x": 1, "y": 2}
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    only_calls = turn.parse(text.split("\n", 1)[1] + '\n<tool_call>\n{"name": "add", "arguments": {"x": 3, "y": 4}}\n</tool_call>', [], "stop")
    assert only_calls["content"] is None and [json.loads(c.function.arguments) for c in only_calls["tool_calls"]] == [{"x": 1, "y": 2}, {"x": 3, "y": 4}]
    no_call = turn.parse("Three.", [], "stop")
    assert no_call == {"content": "Three.", "tool_calls": None, "finish_reason": "stop"}


def stream_through(stream: Any, tokenizer: Any, text: str) -> list[dict[str, Any]]:
    """Feed `text` to a ToolStream one token at a time, as engine steps would; the deltas it emits."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, sent = [], ""
    for k in range(1, len(ids) + 1):
        so_far = tokenizer.decode(ids[:k])
        delta = stream.delta(so_far[len(sent):], ids[k - 1 : k], finished=k == len(ids))
        sent = so_far
        if delta is not None:
            deltas.append(delta)
    return deltas


def test_streamed_hermes_output_yields_content_then_call_deltas(hermes, tokenizer):
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    stream = hermes.turn(req(tools=[ADD])).stream([1, 2, 3])
    deltas = stream_through(stream, tokenizer, text)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == "Let me add." and "<tool_call>" not in content
    assert {c["index"] for c in calls} == {0}
    first = next(c for c in calls if c.get("id"))
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function" and first["function"]["name"] == "add"
    arguments = "".join(c.get("function", {}).get("arguments") or "" for c in calls)
    assert json.loads(arguments) == {"x": 1, "y": 2}
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"
    plain = hermes.turn(req(tools=[ADD], tool_choice="none")).stream([1])
    assert "".join(d["content"] for d in stream_through(plain, tokenizer, text)) == text and plain.finish_reason("stop") == "stop"


def test_tool_choice_none_renders_tools_but_parses_nothing(hermes):
    turn = hermes.turn(req(tools=[ADD], tool_choice="none"))
    text = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    assert turn.parse(text, [], "stop") == {"content": text, "tool_calls": None, "finish_reason": "stop"}
    assert turn.sampling_options() == {}
    from replicas.engine.tools import template_inputs

    assert template_inputs(req(tools=[ADD], tool_choice="none"), turn)[1] == [ADD]


def structural_tag(options: dict[str, Any]) -> dict[str, Any]:
    structured = options["structured_outputs"]
    assert structured.json is None  # vLLM 0.32 constrains hermes calls with a structural tag, not a bare JSON schema
    return json.loads(structured.structural_tag)["format"]


def test_forced_calls_are_constrained_to_hermes_calls_and_parsed(hermes):
    """vLLM 0.32's default (VLLM_ENFORCE_STRICT_TOOL_CALLING on): for required / a named function
    the hermes parser's structural tag forces `<tool_call>{"name": ..., "arguments": ...}</tool_call>`;
    a strict tool's arguments follow its schema, another's are any JSON object."""
    named = hermes.turn(req(tools=[ADD, LOOKUP], tool_choice={"type": "function", "function": {"name": "lookup"}}))
    tag = structural_tag(named.sampling_options())
    assert tag["type"] == "tags_with_separator" and tag["at_least_one"] and tag["stop_after_first"]
    assert {t["begin"] for t in tag["tags"]} == {'<tool_call>\n{"name": "lookup", "arguments": ', '<tool_call>{"name": "lookup", "arguments": '}
    assert all(t["content"]["json_schema"] == LOOKUP["function"]["parameters"] for t in tag["tags"])
    parsed = named.parse('<tool_call>\n{"name": "lookup", "arguments": {"city": "Rome", "exact": true}}\n</tool_call>', [], "stop")
    assert parsed["content"] is None and parsed["finish_reason"] == "stop"  # a named call keeps its reason (vLLM)
    assert parsed["tool_calls"][0].function.name == "lookup" and json.loads(parsed["tool_calls"][0].function.arguments) == {"city": "Rome", "exact": True}

    required = hermes.turn(req(tools=[ADD, LOOKUP], tool_choice="required", parallel_tool_calls=False))
    tag = structural_tag(required.sampling_options())
    assert tag["at_least_one"] and tag["stop_after_first"]  # one call, as parallel_tool_calls=False asks
    schemas = {t["begin"].split('"')[3]: t["content"]["json_schema"] for t in tag["tags"]}
    assert schemas == {"add": True, "lookup": LOOKUP["function"]["parameters"]}  # ADD is not strict: any JSON
    parsed = required.parse('<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 5}}\n</tool_call>', [], "stop")
    assert parsed["finish_reason"] == "tool_calls" and parsed["content"] is None
    assert json.loads(parsed["tool_calls"][0].function.arguments) == {"x": 2, "y": 5}
    assert "structured_outputs" not in hermes.turn(req(tools=[ADD])).sampling_options()  # auto, nothing strict
    assert structural_tag(hermes.turn(req(tools=[LOOKUP])).sampling_options())["type"] == "triggered_tags"  # auto, strict


def test_the_strict_level_pins_every_tools_arguments_and_whitespace_can_be_bounded(tokenizer):
    from replicas.engine.tools import ToolCalling

    calling = ToolCalling("hermes", tokenizer, strict_level="parameter")
    tag = structural_tag(calling.turn(req(tools=[ADD], tool_choice="required")).sampling_options())
    assert all(t["content"]["json_schema"] == ADD["function"]["parameters"] for t in tag["tags"])
    assert all(t["content"]["max_whitespace_cnt"] is None for t in tag["tags"])  # vLLM's default: any whitespace
    bounded = ToolCalling("hermes", tokenizer, strict_level="parameter", max_whitespace=1)
    tag = structural_tag(bounded.turn(req(tools=[ADD], tool_choice="required")).sampling_options())
    assert all(t["content"]["max_whitespace_cnt"] == 1 for t in tag["tags"])


def test_tools_need_a_parser_unless_tool_choice_is_none(tokenizer):
    from replicas.engine.tools import ToolCalling

    calling = ToolCalling(None, tokenizer)
    for choice in (None, "auto", "required"):
        with pytest.raises(InvalidRequestError, match=r"tools: this engine has no tool parser.*tool_call_parser"):
            calling.turn(req(tools=[ADD], **({"tool_choice": choice} if choice else {})))
    assert calling.turn(req(tools=[ADD], tool_choice="none")).parse("x", [], "stop")["content"] == "x"
    assert calling.turn(req()) is None


def test_an_unknown_parser_fails_at_start_listing_vllms_parsers():
    from replicas.engine.config import EngineConfig

    config = EngineConfig(model="m", tool_call_parser="hermes2")
    with pytest.raises(ValueError, match=r"tool_call_parser: 'hermes2' is not one of vLLM's tool parsers.*hermes, "):
        config.engine_args()
    assert "tool_call_parser" not in EngineConfig(model="m", tool_call_parser="hermes").engine_args()


# ---------------------------------------------------------------- the inspect provider (fake app handle)


def test_inspect_messages_tools_and_choices_become_capserve_fields():
    from inspect_ai.model import ChatMessageAssistant, ChatMessageTool, ChatMessageUser, GenerateConfig
    from inspect_ai.tool import ToolCall, ToolCallError, ToolFunction, ToolInfo, ToolParam, ToolParams

    from provider.inspect_provider import build_request

    info = ToolInfo(
        name="add", description="Add two numbers.",
        parameters=ToolParams(properties={"x": ToolParam(type="integer", description="First."), "y": ToolParam(type="integer")}, required=["x", "y"]),
    )  # fmt: skip
    messages = [
        ChatMessageUser(content="What is 1 + 2?"),
        ChatMessageAssistant(content="", tool_calls=[ToolCall(id="c1", function="add", arguments={"x": 1, "y": 2})]),
        ChatMessageTool(content="3", tool_call_id="c1", function="add"),
        ChatMessageTool(content="", tool_call_id="c2", function="add", error=ToolCallError("parsing", "bad x")),
    ]
    request = build_request(messages, GenerateConfig(parallel_tool_calls=False), None, tools=[info], tool_choice="any")
    assert request["prompt"][1] == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1, "y": 2}'}}],
    }  # fmt: skip
    assert request["prompt"][2] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}
    assert request["prompt"][3]["content"] == "Error: bad x"
    (tool,) = request["tools"]
    assert tool["function"]["name"] == "add" and tool["function"]["description"] == "Add two numbers."
    assert tool["function"]["parameters"]["properties"]["x"] == {"type": "integer", "description": "First."}
    assert tool["function"]["parameters"]["required"] == ["x", "y"]
    assert request["tool_choice"] == "required" and request["parallel_tool_calls"] is False
    named = build_request(messages[:1], GenerateConfig(), None, tools=[info], tool_choice=ToolFunction(name="add"))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert "tools" not in build_request(messages[:1], GenerateConfig(), None, tools=[], tool_choice="none")


def addition() -> Any:  # inspect's documented example tool
    from inspect_ai.tool import tool

    @tool
    def addition() -> Any:
        async def execute(x: int, y: int) -> int:
            """Add two numbers.

            Args:
                x: First number to add.
                y: Second number to add.

            Returns:
                The sum of the two numbers.
            """
            return x + y

        return execute

    return addition()


class ToolApp:
    """A fake app: calls `addition` until it sees the tool's result, then answers in text."""

    def __init__(self) -> None:
        from tests.test_provider import FakeApp, FakeMethod

        self.requests: list[dict[str, Any]] = []
        self.info = FakeApp().info
        self.generate = FakeMethod(self._generate)

    async def _generate(self, request: dict[str, Any], by_reference: Any = False) -> GenerateResult:
        self.requests.append(request)
        if request["prompt"][-1]["role"] == "tool":
            choice = Choice(text="It is 3.", token_ids=[5], finish_reason="stop")
        else:
            call = {"id": "chatcmpl-tool-1", "function": {"name": "addition", "arguments": '{"x": 1, "y": 2}'}}
            choice = Choice(text="<tool_call>...</tool_call>", token_ids=[5], finish_reason="tool_calls", content=None, tool_calls=[call])
        return GenerateResult(request_id="r", text=choice.text, token_ids=[5], prompt_token_ids=[1], finish_reason=choice.finish_reason,
                              choices=[choice], tool_calls=choice.tool_calls, replica="fake-0")  # fmt: skip


def test_an_inspect_tool_loop_runs_on_the_provider(tmp_path):
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import get_model
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import ToolCall

    import provider._registry  # noqa: F401
    from provider.inspect_provider import to_tool_calls

    app = ToolApp()
    task = Task(dataset=[Sample(input="What is 1 + 2?", target="3")], solver=[use_tools(addition()), generate()])
    (log,) = eval(task, model=get_model("capserve/fake", handle=app, memoize=False), log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    roles = [m.role for m in log.samples[0].messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = log.samples[0].messages[1].tool_calls[0]
    assert (call.id, call.function, call.arguments) == ("chatcmpl-tool-1", "addition", {"x": 1, "y": 2})
    assert log.samples[0].messages[2].text == "3" and log.samples[0].output.completion == "It is 3."
    first, second = app.requests
    assert first["tools"][0]["function"]["name"] == "addition" and set(first["tools"][0]["function"]["parameters"]["properties"]) == {"x", "y"}
    assert first["tool_choice"] == "auto"
    assert second["prompt"][1]["tool_calls"][0]["function"] == {"name": "addition", "arguments": '{"x": 1, "y": 2}'}
    assert second["prompt"][2] == {"role": "tool", "content": "3", "tool_call_id": "chatcmpl-tool-1", "name": "addition"}
    assert log.samples[0].output.choices[0].stop_reason == "stop"
    (bad,) = to_tool_calls([ToolCallFunctionLike("c", "addition", '{"x": 1,')])
    assert isinstance(bad, ToolCall) and bad.arguments == {} and "Error parsing" in bad.parse_error


class ToolCallFunctionLike:
    def __init__(self, id: str, name: str, arguments: str) -> None:
        from replicas.api import ToolCallFunction

        self.id, self.function = id, ToolCallFunction(name=name, arguments=arguments)


# ---------------------------------------------------------------- one real engine (hermes)


@pytest.fixture(scope="module")
def engine(loop, tmp_path_factory) -> Any:
    from replicas.tiny import make_tiny_model
    from tests.conftest import start_engine

    path = make_tiny_model("llama", tmp_path_factory.mktemp("tools") / "llama", seed=1)
    # a bound on whitespace inside a forced call's JSON, or the random-weight model may never end it
    started = loop.run(start_engine(path, name="engine-tools", tool_call_parser="hermes", tool_call_max_whitespace=1))
    yield started
    loop.run(started.shutdown())


FORCED_TOKENS = 160


def generate(loop: Any, engine: Any, **fields: Any) -> GenerateResult:
    return loop.run(engine.generate({"prompt": USER, "max_tokens": 48, "temperature": 0.0, **fields}))


@pytest.mark.engine
def test_the_rendered_prompt_holds_the_tool_schema(loop, engine):
    result = generate(loop, engine, tools=[ADD, LOOKUP], max_tokens=4)
    prompt = engine.tokenizer.decode(result.prompt_token_ids)
    assert "<tools>" in prompt and prompt.index("<tools>") < prompt.index("What is 1 + 2?")
    for name in ('"add"', '"lookup"', '"x"', '"y"', '"city"', '"exact"', '"Paris"'):
        assert name in prompt
    plain = generate(loop, engine, max_tokens=4)
    assert len(result.prompt_token_ids) > len(plain.prompt_token_ids) + 100


@pytest.mark.engine
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_comes_back_as_a_tool_call_matching_the_schema(loop, engine, choice):
    tool_choice = {"type": "function", "function": {"name": "lookup"}} if choice == "named" else "required"
    # the grammar forces the call's markup, which a random-weight model spells a character or two a token
    result = generate(loop, engine, tools=[LOOKUP], tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=FORCED_TOKENS)
    print(f"forced {choice} call: {len(result.token_ids)} tokens: {result.text!r}")
    assert result.choices[0].finish_reason in ("stop", "tool_calls"), result.text  # ended inside the grammar
    (call,) = result.tool_calls
    assert call.function.name == "lookup" and call == result.choices[0].tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "exact"} and arguments["city"] in ("Paris", "Rome") and isinstance(arguments["exact"], bool)
    assert result.choices[0].content is None
    assert result.finish_reason == ("stop" if choice == "named" else "tool_calls")


@pytest.mark.engine
def test_a_second_turn_with_the_tool_result_renders_and_generates(loop, engine):
    result = generate(loop, engine, prompt=SECOND_TURN, tools=[ADD], max_tokens=8)
    prompt = engine.tokenizer.decode(result.prompt_token_ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and len(result.token_ids) >= 1
    again = generate(loop, engine, prompt=SECOND_TURN, tools=[ADD], max_tokens=8)
    assert again.token_ids == result.token_ids  # greedy: the same prompt gives the same tokens


@pytest.mark.engine
def test_tool_choice_none_and_auto_on_plain_text(loop, engine):
    none = generate(loop, engine, tools=[LOOKUP], tool_choice="none", max_tokens=12)
    assert none.tool_calls is None and none.choices[0].content == none.text
    assert '"lookup"' in engine.tokenizer.decode(none.prompt_token_ids)  # rendered all the same (vLLM's default)
    auto = generate(loop, engine, tools=[LOOKUP], max_tokens=12)
    assert auto.token_ids == none.token_ids  # auto adds no constraint; the random model writes no call
    assert auto.tool_calls is None and auto.choices[0].content == auto.text


@pytest.mark.engine
def test_tools_on_a_text_prompt_fail_the_request(loop, engine):
    with pytest.raises(InvalidRequestError, match="tools: need a chat prompt"):
        generate(loop, engine, prompt="Hello", tools=[ADD])

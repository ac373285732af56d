"""Forced tool calls (worker/requests/tool_grammar.py): the grammar admits exactly the calls tool_choice
allows, in the template's format, with arguments valid for the tool's schema; what it cannot enforce is
refused by name.

Checked with llguidance over the builtin SmolLM2 tokenizer, text fed token by token as a model would write it.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.tool_parsers import json_tools, mistral

from engine.batch.grammar import GrammarCompiler
from engine.core.errors import InvalidRequestError
from engine.models.gguf_smollm2 import gguf_path
from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata
from producer.models import GenerationRequest
from worker.jobs.payload import JobRejected
from worker.requests.output_split import OutputSplitter, stop_after_one_call
from worker.requests.sampling import checked_sampling, sampling_of
from worker.requests.tool_grammar import forced_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    return tokenizer_from_gguf_metadata(loaded[1])


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 0, frozenset({2}))


def splitter(
    parser: Any = json_tools, markers: tuple[str, str] = ("<tool_call>", "</tool_call>")
) -> OutputSplitter:
    return OutputSplitter(think=None, tool_markers=markers, tool_parser=parser.parse_tool_call, tools=[])


def request(**fields: Any) -> GenerationRequest:
    return GenerationRequest.model_validate({"messages": ASK, "tools": [WEATHER, CLOCK], **fields})


def accepts(compiler: GrammarCompiler, tokenizer: Any, req: GenerationRequest, text: str) -> bool:
    """Whether the forced grammar takes `text` whole and may end there."""
    grammar = forced_tool_calls(tokenizer, req, splitter())
    assert grammar is not None
    matcher = compiler.processor(grammar).matcher
    return bool(matcher.consume_tokens(list(tokenizer.encode(text, add_special_tokens=False)))) and bool(
        matcher.is_accepting()
    )


def test_required_admits_calls_of_offered_tools_with_valid_arguments(compiler: Any, tokenizer: Any) -> None:
    required = request(tool_choice="required")
    assert accepts(compiler, tokenizer, required, call("get_weather", {"city": "Paris"}))
    assert accepts(compiler, tokenizer, required, call("get_weather", {"city": "Paris", "days": 3}))
    assert accepts(compiler, tokenizer, required, call("get_time", {"anything": [1, 2]}))
    both = call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {})
    assert accepts(compiler, tokenizer, required, both)  # parallel calls by default
    assert not accepts(compiler, tokenizer, required, call("get_news", {}))  # not offered
    assert not accepts(compiler, tokenizer, required, call("get_weather", {"city": 7}))  # wrong type
    assert not accepts(compiler, tokenizer, required, call("get_weather", {"days": 2}))  # city missing
    assert not accepts(compiler, tokenizer, required, call("get_weather", {"city": "P", "x": 1}))  # extra
    assert not accepts(compiler, tokenizer, required, "Sure! " + call("get_time", {}))  # text first
    assert not accepts(compiler, tokenizer, required, "")  # no call at all


def test_one_call_only_without_parallel_tool_calls(compiler: Any, tokenizer: Any) -> None:
    single = request(tool_choice="required", parallel_tool_calls=False)
    assert accepts(compiler, tokenizer, single, call("get_time", {}))
    assert not accepts(compiler, tokenizer, single, call("get_time", {}) + "\n" + call("get_time", {}))


def test_a_named_choice_admits_only_that_tool(compiler: Any, tokenizer: Any) -> None:
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert accepts(compiler, tokenizer, named, call("get_weather", {"city": "Oslo"}))
    assert not accepts(compiler, tokenizer, named, call("get_time", {}))


def test_a_named_choice_admits_one_call_only(compiler: Any, tokenizer: Any) -> None:
    """`call (GAP call)*` let a small model repeat the named call until max_tokens (issue 42)."""
    named = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(compiler, tokenizer, named, call("get_time", {}))
    assert not accepts(compiler, tokenizer, named, call("get_time", {}) + "\n" + call("get_time", {}))
    assert stop_after_one_call(sampling_of(named), splitter(), named).stop[-1] == "</tool_call>"


def test_the_grammar_ends_after_the_call(compiler: Any, tokenizer: Any) -> None:
    grammar = forced_tool_calls(
        tokenizer, request(tool_choice="required", parallel_tool_calls=False), splitter()
    )
    assert grammar is not None
    matcher = compiler.processor(grammar).matcher
    assert matcher.consume_tokens(list(tokenizer.encode(call("get_time", {}), add_special_tokens=False)))
    assert matcher.is_stopped()  # the row ends here, with no end token to wait for


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_the_model_decides_where_tool_choice_leaves_it_free(tokenizer: Any, choice: str | None) -> None:
    assert forced_tool_calls(tokenizer, request(tool_choice=choice), splitter()) is None


def test_what_cannot_be_enforced_is_refused_by_name(tokenizer: Any) -> None:
    required = request(tool_choice="required")
    with pytest.raises(JobRejected, match="this model's is mistral: send tool_choice 'auto'"):
        forced_tool_calls(tokenizer, required, splitter(mistral, ("[TOOL_CALLS]", "")))
    with pytest.raises(JobRejected, match="declares no tool calling"):
        forced_tool_calls(tokenizer, required, None)
    both = request(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(JobRejected, match="response_format cannot also hold it"):
        forced_tool_calls(tokenizer, both, splitter())


def test_response_format_with_tools_the_model_may_call_is_refused(compiler: GrammarCompiler) -> None:
    def check(params: Any) -> None:
        if params.grammar is not None:
            compiler.check(params.grammar)

    json_answer = {"response_format": {"type": "json_object"}}
    with pytest.raises(JobRejected, match="tools offered could never be called"):
        checked_sampling(request(**json_answer), check)
    assert checked_sampling(request(tool_choice="none", **json_answer), check).grammar is not None


def test_a_tool_schema_llguidance_cannot_enforce_is_an_invalid_request(compiler: Any, tokenizer: Any) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}
    req = GenerationRequest.model_validate({"messages": ASK, "tools": [broken], "tool_choice": "required"})
    grammar = forced_tool_calls(tokenizer, req, splitter())
    assert grammar is not None
    with pytest.raises(InvalidRequestError, match="tool_choice 'required' cannot be enforced"):
        compiler.check(grammar)

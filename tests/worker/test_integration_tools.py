"""A tool round trip through a real worker: a call, a `tool` result message, the final answer.

The model is rigged so that its output is known: a tiny llama whose layers add nothing (attention and
MLP outputs are zero), so the next token depends on the last token alone through a table written into
its embeddings and head. Its tokenizer is the builtin SmolLM2 one plus three added tokens (`<tool_call>`,
the call's JSON, `</tool_call>`) and a ChatML template that declares tools the way Qwen's does, so mlx-lm
finds its tool parser (json_tools) as it would for a real model. After the generation prompt the table
says `<tool_call>` (a weak preference); the call's tokens follow each other, and after `</tool_call>` comes
the next call, until max_tokens or, with parallel_tool_calls false, the first call's end. In the second
turn a logit_bias on "Sun" outweighs that preference for the first token only: "Sun" -> `<|im_end|>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from engine.models.load import load_model
from producer.client import Producer
from producer.models import GenerationRequest
from tests.engine.tiny import model_config, save_model_folder, tiny_model
from tests.worker.procs import RedisProcess, WorkerProcess, exits_cleanly, running
from worker.requests.prompts import prompt_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADDED = ["<tool_call>", CALL, "</tool_call>"]
ANSWER = "Sun"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def rig(model: Any, table: dict[int, tuple[int, float]]) -> None:
    """Make the next token a function of the last: token s -> (t, strength) in `table`."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    embed = mx.zeros_like(model.model.embed_tokens.weight)
    head = mx.zeros_like(model.lm_head.weight)
    for axis, (source, (target, strength)) in enumerate(table.items()):
        embed[source, axis] = 1.0  # after the final RMSNorm: 8 x this unit vector (hidden 64)
        head[target, axis] = strength
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head
    mx.eval(model.parameters())


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import AddedToken

    from engine.models.gguf_smollm2 import gguf_path
    from engine.models.gguf_tokenizer import tokenizer_from_gguf_metadata

    folder = tmp_path_factory.mktemp("models") / "tiny-tool-caller"
    loaded: Any = mx.load(str(gguf_path()), return_metadata=True)
    hf = tokenizer_from_gguf_metadata(loaded[1])._tokenizer
    hf.add_tokens([AddedToken(text, special=False, normalized=False) for text in ADDED])
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(folder))
    start, call, end = hf.convert_tokens_to_ids(ADDED)
    (answer,) = hf.encode(ANSWER)
    newline = hf.encode("<|im_start|>assistant\n")[-1]  # the generation prompt's last token
    im_end = hf.eos_token_id
    vocab = len(hf)
    config = model_config("llama", vocab_size=vocab, tie_word_embeddings=False)
    model = tiny_model("llama", vocab_size=vocab, tie_word_embeddings=False)
    rig(
        model,
        {
            newline: (start, 1.0),
            start: (call, 50.0),
            call: (end, 50.0),
            end: (start, 50.0),
            answer: (im_end, 50.0),
        },
    )
    save_model_folder(model, config, folder)
    return folder


@pytest.fixture(scope="module")
def producer(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Producer]:
    with running(RedisProcess(tmp_path_factory.mktemp("redis-tools"))) as redis:
        workdir = tmp_path_factory.mktemp("worker-tools")
        worker = WorkerProcess(redis.url, workdir, name="kvrq-tools", args=["--model", str(model_folder)])
        with exits_cleanly(worker), Producer(redis.url) as p:
            yield p


def test_a_tool_call_its_result_and_the_final_answer(producer: Producer, model_folder: Path) -> None:
    first = {
        "agent_id": "tool-agent",
        "messages": [QUESTION],
        "tools": [WEATHER],
        "parallel_tool_calls": False,
        "max_tokens": 8,
    }
    handle = producer.submit(first)
    events = list(handle.events(timeout=300))
    calls = [event.data for event in events if event.kind == "tool_call"]
    result = handle.result(timeout=60)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert events[-1].kind == "end" and events[-1].finish_reason == "tool_calls"  # the stream says so too
    assert result.tool_calls is not None and len(result.tool_calls) == 1
    (call,) = result.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert calls == [call.model_dump(mode="json")]  # the stream carried it as its own event

    history = [
        QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(mode="json")]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    _, tokenizer = load_model(str(model_folder))
    answer_token = tokenizer.encode(ANSWER)[0]
    second = {**first, "messages": history, "logit_bias": {str(answer_token): 20}}
    final = producer.submit(second).result(timeout=300)
    assert (final.text, final.finish_reason, final.tool_calls) == (ANSWER, "stop", None)

    rendered = tokenizer.decode(prompt_tokens(tokenizer, GenerationRequest.model_validate(second)))
    assert f"<tool_call>{CALL}</tool_call>" in rendered and "18 C, sunny" in rendered
    assert final.usage.prompt_tokens == len(
        prompt_tokens(tokenizer, GenerationRequest.model_validate(second))
    )
    # The call rendered back through the template is what the model generated: the agent's KV resumes.
    assert final.usage.reused_tokens >= result.usage.prompt_tokens


def test_a_tool_calls_end_ends_only_its_row(producer: Producer) -> None:
    """One batch: a row that may make one call only, one that may make several (it repeats its call, which
    ends it), one offered no tools."""
    base = {"messages": [QUESTION], "max_tokens": 8}
    one, several, plain = producer.submit_many(
        [
            {**base, "tools": [WEATHER], "parallel_tool_calls": False},
            {**base, "tools": [WEATHER]},
            base,
        ]
    )
    one_call = one.result(timeout=300)
    assert one_call.finish_reason == "tool_calls" and len(one_call.token_ids) == 3
    assert one_call.tool_calls is not None and len(one_call.tool_calls) == 1

    calls = several.result(timeout=300)  # the rigged model repeats its call: the repeat ends the row
    assert calls.finish_reason == "tool_calls" and len(calls.token_ids) < 8
    assert calls.tool_calls is not None and len(calls.tool_calls) == 1  # the repeat dropped
    assert calls.text == ""

    untouched = plain.result(timeout=300)  # no tools offered: the markup is plain text, nothing parsed
    assert untouched.tool_calls is None and len(untouched.token_ids) == 8
    assert untouched.text.startswith(f"<tool_call>{CALL}</tool_call>")


def test_tool_choice_required_makes_a_model_that_would_answer_call(
    producer: Producer, model_folder: Path
) -> None:
    """A logit_bias makes the rigged model answer "Sun" (as in the second turn above); with tool_choice
    "required" the grammar leaves it only a call, in its template's format, ended by the grammar."""
    _, tokenizer = load_model(str(model_folder))
    steer = {str(tokenizer.encode(ANSWER)[0]): 20}
    base = {"messages": [QUESTION], "tools": [WEATHER], "max_tokens": 16, "logit_bias": steer}
    answered, forced = producer.submit_many(
        [base, {**base, "tool_choice": "required", "parallel_tool_calls": False}]
    )
    assert answered.result(timeout=300).text == ANSWER  # what the model does when it decides
    result = forced.result(timeout=300)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert result.tool_calls is not None and len(result.tool_calls) == 1
    (call,) = result.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_named_tool_choice_calls_that_tool_with_valid_arguments(producer: Producer) -> None:
    """The rigged model always writes the get_weather call; named get_time, the grammar masks that call
    out and the row writes a get_time call whose arguments validate against get_time's schema."""
    request = {
        "messages": [QUESTION],
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": 64,
    }
    result = producer.submit(request).result(timeout=300)
    assert result.finish_reason == "tool_calls", result
    assert result.tool_calls is not None and len(result.tool_calls) >= 1
    for call in result.tool_calls:
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])  # type: ignore[index]

"""A model that repeats an identical tool call (a small model under a forced call grammar does, until
max_tokens) has its answer ended at the repeat: one call, finish_reason tool_calls, its KV kept."""

from __future__ import annotations

from engine.core.results import StepOutput, TokenDelta
from tests.worker.fakes import FakeEngine
from tests.worker.harness import Harness

CALL = '<tool_call>{"name": "look", "arguments": {"q": "x"}}</tool_call>\n'
TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}


class LoopingEngine(FakeEngine):
    """Writes the same tool call over and over, one character a step."""

    def step(self) -> StepOutput:
        out = StepOutput()
        for seq in list(self._seqs.values()):
            token = ord((CALL * 20)[len(seq.generated)])
            seq.generated.append(token)
            out.deltas.append(TokenDelta(seq.uid, token, chr(token)))
            if len(seq.generated) >= seq.max_tokens:
                out.completions.append(self._finish(seq, "length"))
        return out


def test_the_answer_ends_at_the_first_repeated_call_with_its_cache_saved() -> None:
    h = Harness()
    h.loop = h.new_loop(LoopingEngine(pool_blocks=4096))
    handle = h.producer.submit(
        {"agent_id": "a", "messages": [{"role": "user", "content": "go"}], "tools": [TOOL], "max_tokens": 500}
    )
    h.run_until(h.all_ended([handle]))
    result = handle.result()
    assert result.finish_reason == "tool_calls"
    assert [call.function.name for call in result.tool_calls or ()] == ["look"]
    assert result.usage.generated_tokens <= 2 * len(CALL)  # not run on to max_tokens
    assert h.store.puts == ["a"]

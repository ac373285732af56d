"""The ragged batch on tiny random models: warm joins, chunked prefill, no padding, counted in steps."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.blocks import AgentCache
from engine.core.params import SamplingParams
from engine.core.results import Completion, StepOutput
from engine.cpu.gemm_rows import padded_rows
from engine.cpu.shortcuts import cpu_shortcuts
from tests.engine.tiny import ByteTokenizer, run_all, tiny_model

pytestmark = pytest.mark.mlx_path  # run again with KVRQ_CPU_SHORTCUTS=0 by .ci/test

GREEDY_LONG = SamplingParams(max_tokens=400, stop_tokens=())


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_model("llama")


def make_engine(model: object, **kwargs: object) -> BlockPoolBatchEngine:
    options: dict[str, object] = {"pool_blocks": 64, "max_batch": 8, "max_context": 4096, **kwargs}
    return BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny-llama", **options)  # type: ignore[arg-type]


@pytest.fixture
def engine(model: object) -> Iterator[BlockPoolBatchEngine]:
    eng = make_engine(model, prefill_tokens_per_step=64)
    yield eng
    eng.close()


def prompt(n_tokens: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt * 13) % 250 for i in range(n_tokens)]


def tokens_of(output: StepOutput) -> set[int]:
    return {delta.uid for delta in output.deltas}


def saved_cache(engine: BlockPoolBatchEngine, n_tokens: int) -> AgentCache:
    uid = engine.submit("agent", prompt(n_tokens, salt=5), SamplingParams(max_tokens=2, stop_tokens=()))
    cache = run_all(engine)[uid].cache
    assert cache is not None and cache.n_tokens == n_tokens + 1
    return cache


def block_the_cut(monkeypatch: pytest.MonkeyPatch, seconds: float, message: str) -> threading.Event:
    """Make the background cut of finished caches wait until the returned event is set."""
    import engine.batch.engine as engine_module

    release = threading.Event()
    real_copy = engine_module.copy_into_blocks

    def slow_copy(*args: object, **kwargs: object) -> AgentCache:
        assert release.wait(seconds), message
        return real_copy(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "copy_into_blocks", slow_copy)
    return release


def test_the_tiny_llama_runs_ragged(engine: BlockPoolBatchEngine) -> None:
    assert engine.ragged


def test_warm_agent_gets_its_first_token_at_the_first_step_while_others_keep_decoding(
    engine: BlockPoolBatchEngine,
) -> None:
    cache = saved_cache(engine, 600)
    running = [engine.submit(f"r{i}", prompt(10, i), GREEDY_LONG) for i in range(3)]
    while tokens_of(engine.step()) != set(running):
        pass
    warm = engine.submit("agent", cache.token_ids + prompt(17, salt=9), GREEDY_LONG, cache=cache)
    first = engine.step()
    assert tokens_of(first) == {*running, warm}, "the warm agent's first token came with the first step"
    for _ in range(5):
        assert tokens_of(engine.step()) == {*running, warm}


def test_running_rows_get_a_token_every_step_during_a_cold_burst(engine: BlockPoolBatchEngine) -> None:
    running = [engine.submit(f"r{i}", prompt(12, i), GREEDY_LONG) for i in range(2)]
    while tokens_of(engine.step()) != set(running):
        pass
    burst = [engine.submit(f"b{i}", prompt(n, 20 + i), GREEDY_LONG) for i, n in enumerate((500, 300, 120))]
    first_token_step: dict[int, int] = {}
    for step in range(1, 40):
        got = tokens_of(engine.step())
        assert set(running) <= got, f"a running row missed step {step}"
        for uid in burst:
            if uid in got and uid not in first_token_step:
                first_token_step[uid] = step
    assert set(first_token_step) == set(burst)
    shortest, middle, longest = burst[2], burst[1], burst[0]
    # Shortest remaining prefill first: 120 tokens at 64 a step is 2 steps, its own prefill only.
    assert first_token_step[shortest] == 2
    assert first_token_step[shortest] < first_token_step[middle] < first_token_step[longest]
    # No step ran more than its prompt-token budget.
    assert first_token_step[longest] >= (500 + 300 + 120 - 3) // 64


def test_a_row_decodes_the_same_tokens_with_or_without_long_batch_mates(model: object) -> None:
    alone_engine = make_engine(model)
    uid = alone_engine.submit("a", prompt(20), SamplingParams(max_tokens=30, stop_tokens=()))
    alone = run_all(alone_engine)[uid].token_ids
    busy = make_engine(model, prefill_tokens_per_step=128)
    mates = [busy.submit(f"m{i}", prompt(n, i), GREEDY_LONG) for i, n in enumerate((700, 300))]
    for _ in range(12):
        busy.step()
    uid = busy.submit("a", prompt(20), SamplingParams(max_tokens=30, stop_tokens=()))
    done: dict[int, Completion] = {}
    while uid not in done:
        for completion in busy.step().completions:
            done[completion.uid] = completion
    assert done[uid].token_ids == alone
    assert all(busy.cancel(m) is not None for m in mates)


def test_chunked_and_batched_prefill_match_one_shot_prefill(model: object) -> None:
    prompts = [prompt(n, salt=i) for i, n in enumerate((333, 90, 7))]
    results = []
    for budget in (4096, 50):
        eng = make_engine(model, prefill_tokens_per_step=budget)
        uids = [eng.submit("a", p, SamplingParams(max_tokens=12, stop_tokens=())) for p in prompts]
        done = run_all(eng)
        results.append([done[u].token_ids for u in uids])
    single = []
    for p in prompts:
        eng = make_engine(model)
        uid = eng.submit("a", p, SamplingParams(max_tokens=12, stop_tokens=()))
        single.append(run_all(eng)[uid].token_ids)
    assert results[0] == single, "three rows prefilled in one batched forward"
    assert results[1] == single, "prefill cut into 50-token chunks"


def test_resumed_agent_matches_a_fresh_run(engine: BlockPoolBatchEngine) -> None:
    cache = saved_cache(engine, 300)
    full = cache.token_ids + prompt(25, salt=3)
    fresh_uid = engine.submit("f", full, SamplingParams(max_tokens=15, stop_tokens=()))
    fresh = run_all(engine)[fresh_uid]
    before = engine.prompt_tokens_processed()
    resumed_uid = engine.submit("agent", full, SamplingParams(max_tokens=15, stop_tokens=()), cache=cache)
    resumed = run_all(engine)[resumed_uid]
    assert resumed.token_ids == fresh.token_ids
    assert resumed.usage.reused_tokens == cache.n_tokens
    assert engine.prompt_tokens_processed() - before == 25 - 1


def test_finished_rows_give_their_buffers_back_for_the_next_one(engine: BlockPoolBatchEngine) -> None:
    uid = engine.submit("a", prompt(100), SamplingParams(max_tokens=5, stop_tokens=()))
    run_all(engine)
    backend = engine._backend
    arena = backend.arena  # type: ignore[attr-defined]
    idle = arena.idle_bytes
    assert idle > 0, "the ended row's KV buffers are kept"
    engine.submit("b", prompt(90), SamplingParams(max_tokens=5, stop_tokens=()))
    assert arena.idle_bytes < idle, "and handed to the next row"
    run_all(engine)
    assert uid not in backend.generator.rows  # type: ignore[attr-defined]


def test_unsupported_architectures_use_mlx_lms_batch_generator(
    model: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture not in the verified list (every tested family is: here llama is struck off it)
    falls back to mlx-lm's BatchGenerator, and asking for the ragged batch is an error."""
    import engine.batch.ragged as ragged

    monkeypatch.setattr(ragged, "SUPPORTED_MODULES", frozenset())
    eng = BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=8)
    assert not eng.ragged
    uid = eng.submit("a", prompt(20), SamplingParams(max_tokens=4, stop_tokens=()))
    assert len(run_all(eng)[uid].token_ids) == 4
    with pytest.raises(ValueError, match="cannot run in the ragged batch"):
        BlockPoolBatchEngine(model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=8, ragged=True)


def test_forcing_the_batch_generator_gives_the_same_greedy_tokens(model: object) -> None:
    outputs = []
    for ragged in (True, False):
        eng = make_engine(model, ragged=ragged)
        uids = [
            eng.submit("a", prompt(n, i), SamplingParams(max_tokens=10, stop_tokens=()))
            for i, n in enumerate((40, 9))
        ]
        done = run_all(eng)
        outputs.append([done[u].token_ids for u in uids])
    assert outputs[0] == outputs[1]


def test_rows_crossing_from_the_short_group_to_attending_alone_keep_their_tokens(model: object) -> None:
    from engine.batch.ragged import SHORT_ROW_TOKENS

    prompts = [prompt(SHORT_ROW_TOKENS - 12, salt=s) for s in (1, 2)] + [prompt(30, salt=3)]
    alone = []
    for p in prompts:
        eng = make_engine(model)
        uid = eng.submit("a", p, SamplingParams(max_tokens=25, stop_tokens=()))
        alone.append(run_all(eng)[uid].token_ids)
    together = make_engine(model)
    uids = [together.submit("a", p, SamplingParams(max_tokens=25, stop_tokens=())) for p in prompts]
    done = run_all(together)
    assert [done[u].token_ids for u in uids] == alone


def test_cutting_a_finished_cache_runs_off_the_step_thread(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = block_the_cut(monkeypatch, 30, "the test never let the copy finish")
    running = engine.submit("r", prompt(10), GREEDY_LONG)
    ending = engine.submit("e", prompt(300, salt=4), SamplingParams(max_tokens=2, stop_tokens=()))
    held = engine.pool.held_by(ending)
    last_delta_seen = False
    for _ in range(20):
        out = engine.step()
        assert not out.completions, "no completion while its blocks are still being copied"
        if ending in tokens_of(out):
            last_delta_seen = len([d for d in out.deltas if d.uid == ending]) == 1
        if engine.active() == 1:
            break
    assert last_delta_seen and engine.active() == 1 and engine.has_work()
    assert engine.pool.held_by(ending) == held, "its blocks stay reserved until the copy is done"
    for _ in range(3):
        assert tokens_of(engine.step()) == {running}, "the batch keeps stepping meanwhile"
    release.set()
    completions: list[Completion] = []
    for _ in range(50):
        completions += engine.step().completions
        if completions:
            break
    assert [c.uid for c in completions] == [ending]
    assert completions[0].cache is not None and completions[0].cache.n_tokens == 301
    assert engine.pool.held_by(ending) == 0
    engine.cancel(running)
    assert not engine.has_work()


def test_short_rows_leaving_the_slots_in_any_order_keep_everyone_s_tokens(model: object) -> None:
    # Six short rows (the slots grow from 4 to 8, and past 128 tokens each), ending at
    # different steps: every leaving row's slot is refilled by moving the last one in.
    shapes = [(20, 5), (60, 40), (120, 12), (90, 150), (30, 3), (70, 70)]
    requests = [
        (prompt(n, salt=i), SamplingParams(max_tokens=m, stop_tokens=())) for i, (n, m) in enumerate(shapes)
    ]
    alone = []
    for p, params in requests:
        eng = make_engine(model)
        uid = eng.submit("a", p, params)
        alone.append(run_all(eng)[uid].token_ids)
    together = make_engine(model)
    uids = [together.submit(f"a{i}", p, params) for i, (p, params) in enumerate(requests)]
    slots = together._backend.generator.slots  # type: ignore[attr-defined]
    most_slotted = most_slots = most_capacity = 0
    done: dict[int, Completion] = {}
    while together.has_work():
        for completion in together.step().completions:
            done[completion.uid] = completion
        most_slotted = max(most_slotted, len(slots.rows))
        most_slots, most_capacity = max(most_slots, slots.slots), max(most_capacity, slots.capacity)
    assert most_slotted >= 5, "the short rows decoded side by side in the slots"
    assert most_slots >= 8 and most_capacity >= 256, "which grew on both axes"
    assert not slots.keys, "and were freed once the last row left"
    assert [done[u].token_ids for u in uids] == alone


def test_a_cache_cut_from_a_slotted_row_resumes_like_a_fresh_prefill(model: object) -> None:
    eng = make_engine(model)
    mates = [eng.submit(f"m{i}", prompt(40, salt=i), GREEDY_LONG) for i in range(3)]
    uid = eng.submit("agent", prompt(100, salt=7), SamplingParams(max_tokens=30, stop_tokens=()))
    done: dict[int, Completion] = {}
    while uid not in done:
        for completion in eng.step().completions:
            done[completion.uid] = completion
    cache = done[uid].cache
    assert cache is not None and cache.n_tokens == 100 + 29
    prefilled_engine = make_engine(model)
    prefilled_uid = prefilled_engine.submit(
        "p", cache.token_ids, SamplingParams(max_tokens=1, stop_tokens=())
    )
    prefilled = run_all(prefilled_engine)[prefilled_uid].cache
    assert prefilled is not None and prefilled.n_tokens == cache.n_tokens
    for mine, theirs in zip(cache.blocks, prefilled.blocks, strict=True):
        for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values, strict=True):
            # the decoded K/V equal the prefilled ones, up to float rounding
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)
    full = cache.token_ids + prompt(9, salt=8)
    params = SamplingParams(max_tokens=10, stop_tokens=())
    fresh_engine = make_engine(model)
    fresh_uid = fresh_engine.submit("f", full, params)
    fresh = run_all(fresh_engine)[fresh_uid].token_ids
    resumed_uid = eng.submit("agent", full, params, cache=cache)
    while resumed_uid not in done:
        for completion in eng.step().completions:
            done[completion.uid] = completion
    assert done[resumed_uid].usage.reused_tokens == cache.n_tokens
    assert done[resumed_uid].token_ids == fresh
    assert all(eng.cancel(m) is not None for m in mates), "a canceled slotted row leaves cleanly"
    assert not eng._backend.generator.slots.rows  # type: ignore[attr-defined]


def test_a_warm_suffix_runs_in_a_step_without_cold_chunks_and_the_cold_prompt_still_advances(
    engine: BlockPoolBatchEngine,
) -> None:
    cache = saved_cache(engine, 300)
    other = saved_cache(engine, 200)
    running = engine.submit("r", prompt(10), GREEDY_LONG)
    cold = engine.submit("c", prompt(900, salt=4), GREEDY_LONG)  # 64 prompt tokens a step
    generator = engine._backend.generator  # type: ignore[attr-defined]
    for _ in range(3):
        engine.step()
    assert generator.last_step.prompt_tokens == 64, "the cold prompt is being prefilled"
    warm = engine.submit("agent", cache.token_ids + prompt(17, salt=9), GREEDY_LONG, cache=cache)
    first = engine.step()
    assert warm in tokens_of(first) and running in tokens_of(first)
    assert generator.last_step.prompt_tokens == 17, "the warm suffix's step carried no cold chunk"
    engine.step()
    assert generator.last_step.prompt_tokens == 64, "and the cold prompt went on at the next step"
    second = engine.submit("agent2", other.token_ids + prompt(5, salt=2), GREEDY_LONG, cache=other)
    engine.step()
    assert generator.last_step.prompt_tokens == 5
    third = engine.submit("agent3", other.token_ids + prompt(6, salt=3), GREEDY_LONG, cache=other)
    engine.step()
    assert generator.last_step.prompt_tokens == 64, "held back once, the cold chunk goes whatever finishes"
    assert {second, third} <= tokens_of(engine.step())
    for _ in range(30):
        if cold in tokens_of(engine.step()):
            break
    else:
        raise AssertionError("the cold prompt never got its first token")


def test_a_cold_prompts_long_last_chunk_holds_nothing_back_so_the_next_warm_suffix_runs_alone(
    engine: BlockPoolBatchEngine,
) -> None:
    cache = saved_cache(engine, 300)
    running = engine.submit("r", prompt(10), GREEDY_LONG)
    short_cold = engine.submit("a", prompt(100, salt=5), GREEDY_LONG)  # chunks of 64 and 36
    engine.submit("b", prompt(900, salt=6), GREEDY_LONG)
    generator = engine._backend.generator  # type: ignore[attr-defined]
    assert running in tokens_of(engine.step())  # its 10-token prompt held the cold chunks back
    engine.step()
    assert generator.last_step.prompt_tokens == 64, "the shorter cold prompt's first chunk"
    assert short_cold in tokens_of(engine.step())
    assert generator.last_step.prompt_tokens == 64, "its 36-token last chunk shared the step"
    warm = engine.submit("agent", cache.token_ids + prompt(17, salt=9), GREEDY_LONG, cache=cache)
    assert warm in tokens_of(engine.step())
    assert generator.last_step.prompt_tokens == 17, "so the next warm suffix ran alone"


def test_on_an_idle_engine_the_last_token_goes_out_before_its_cache_is_cut(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = block_the_cut(monkeypatch, 5, "the step waited for the cut before handing out the token")
    uid = engine.submit("a", prompt(200), SamplingParams(max_tokens=1, stop_tokens=()))
    out = engine.step()  # 64 prompt tokens a step: its one token comes with the fourth
    while uid not in tokens_of(out):
        out = engine.step()
    assert not out.completions and engine.active() == 0 and engine.has_work()
    release.set()
    completions = engine.step().completions
    assert [c.uid for c in completions] == [uid] and completions[0].cache is not None


def test_the_vocabulary_projection_runs_on_the_sampling_rows_only(
    engine: BlockPoolBatchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = engine._backend.generator  # type: ignore[attr-defined]
    projected: list[int] = []
    real_head = generator._head

    def counting_head(hidden: object) -> object:
        projected.append(hidden.shape[0])  # type: ignore[attr-defined]
        return real_head(hidden)

    monkeypatch.setattr(generator, "_head", counting_head)
    running = engine.submit("r", prompt(10), GREEDY_LONG)
    engine.step()
    assert projected == [1], "a 10-token prompt finishing: its last token only"
    cold = engine.submit("c", prompt(150, salt=4), GREEDY_LONG)  # 64 prompt tokens a step
    seen = tokens_of(engine.step())
    assert projected[-1] == 1 and seen == {running}, "the decoding row only, not the chunk's 64"
    while cold not in seen:
        seen = tokens_of(engine.step())
    # the decoding row and the cold prompt's last token (as many rows as the CPU's matmul likes)
    assert projected[-1] == padded_rows(2, cpu_shortcuts().pad_rows)


def test_padding_rows_write_no_kv_and_reach_no_sampler(engine: BlockPoolBatchEngine) -> None:
    uids = [
        engine.submit(None, prompt(3, salt=s), SamplingParams(max_tokens=3, stop_tokens=())) for s in range(3)
    ]
    first = engine.step()
    assert tokens_of(first) == set(uids) and len(first.deltas) == 3
    generator = engine._backend.generator  # type: ignore[attr-defined]
    offsets = [row.layers[0].offset for row in generator.rows.values()]
    assert offsets == [3, 3, 3], "no padding token in anybody's K/V"
    done = run_all(engine)
    assert all(done[uid].usage.generated_tokens == 3 for uid in uids)

"""KVArena.reserve: a sequence's KV buffers made ahead on a background thread, taken without a new
allocation on the step thread; and the engine's reserve() around it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.batch.engine import BlockPoolBatchEngine
from engine.core.params import SamplingParams
from engine.core.spec import LayerSpec, ModelCacheSpec
from engine.kv.arena import KVArena, LayerBuffers
from tests.engine.test_ragged import run_all
from tests.engine.tiny import ByteTokenizer, tiny_model


def make_spec() -> ModelCacheSpec:
    return ModelCacheSpec("t", 3, (LayerSpec("full"),) * 3, 2, 16, 8, "float32", block_tokens=32)


class WatchedArena(KVArena):
    """Records the thread of every new allocation; `gate`, when set, holds them until released."""

    def __init__(self, spec: ModelCacheSpec, max_idle_bytes: int = 10**9) -> None:
        super().__init__(spec, max_idle_bytes)
        self.made_on: list[int] = []
        self.gate: threading.Event | None = None
        self.fail = False

    def _new(self, capacity: int) -> LayerBuffers:
        self.made_on.append(threading.get_ident())
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail and threading.get_ident() != threading.main_thread().ident:
            raise MemoryError("no memory on the background thread")
        return super()._new(capacity)


@pytest.fixture
def arena() -> Iterator[WatchedArena]:
    a = WatchedArena(make_spec())
    yield a
    a.close()


def ids(buffers: LayerBuffers) -> list[int]:
    return [id(k) for k, _ in buffers]


def wait_idle(arena: KVArena) -> None:
    for _ in range(1000):
        if arena.idle_bytes:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the reserved buffers never became idle")


def test_reserved_buffers_are_made_off_the_calling_thread_and_taken_without_a_new_allocation(
    arena: WatchedArena,
) -> None:
    assert arena.reserve(70)
    wait_idle(arena)
    made = arena.made_on[:]
    buffers = arena.take(70)
    assert made and threading.get_ident() not in made, "made on the background thread"
    assert arena.made_on == made, "take() allocated nothing more"
    assert int(buffers[0][0].shape[2]) >= 70
    assert arena.reserved == arena.reserved_used == 1


def test_take_waits_for_a_reservation_in_flight_instead_of_making_another(arena: WatchedArena) -> None:
    arena.gate = threading.Event()
    assert arena.reserve(40)
    taken: list[LayerBuffers] = []
    taker = threading.Thread(target=lambda: taken.append(arena.take(40)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive(), "take() waits for the set being made"
    arena.gate.set()
    taker.join(10)
    assert taken and len(arena.made_on) == 1, "one allocation in all, the reserved one"
    assert arena.reserved_used == 1
    assert arena.idle_bytes == 0, "the set went to take(), not to the idle list"


def test_each_reservation_gets_a_set_of_its_own_and_idle_sets_count_once(arena: WatchedArena) -> None:
    arena.give_back(arena.take(64))
    made = len(arena.made_on)
    assert not arena.reserve(60), "the idle set fits: nothing to make"
    assert arena.reserve(60), "that idle set is claimed: a second sequence gets a new one"
    assert arena.reserve(200)
    assert arena.reserve(190), "two sequences of about that size: two sets"
    arena.close()
    assert len(arena.made_on) == made + 3
    for n in (60, 60, 200, 190):
        arena.take(n)
    assert len(arena.made_on) == made + 3, "every take found its set"


def test_stock_makes_idle_sets_before_any_sequence_asks(arena: WatchedArena) -> None:
    assert arena.stock(100) and arena.stock(100)
    arena.wait_made()
    wait_idle(arena)
    assert len(arena.made_on) == 2 and threading.get_ident() not in arena.made_on
    assert not arena.reserve(90) and not arena.reserve(90), "both stocked sets fit"
    arena.take(90)
    arena.take(90)
    assert len(arena.made_on) == 2 and arena.reserved_used == 2


def test_an_unclaimed_reservation_is_idle_and_kept_within_the_budget() -> None:
    spec = make_spec()
    small = WatchedArena(spec, max_idle_bytes=100 * spec.bytes_per_token())
    try:
        assert not small.reserve(200), "it could not be kept: nothing is started"
        assert small.reserve(40)
        wait_idle(small)
        assert 0 < small.idle_bytes <= small.max_idle_bytes
        reserved = ids(small.take(40))
        assert len(small.made_on) == 1 and reserved, "the idle reserved set was handed out"
    finally:
        small.close()


def test_a_failed_reservation_leaves_take_to_allocate(arena: WatchedArena) -> None:
    arena.fail = True
    arena.gate = threading.Event()
    assert arena.reserve(40)
    arena.gate.set()
    buffers = arena.take(40)  # the background allocation raised: made here instead
    assert int(buffers[0][0].shape[2]) >= 40
    assert arena.made_on[-1] == threading.get_ident()
    assert arena.reserved_used == 0


@pytest.fixture(scope="module")
def model() -> object:
    return tiny_model("llama")


def test_engine_resume_on_reserved_buffers_gives_the_same_tokens(model: object) -> None:
    """A resumed sequence whose buffers were reserved takes them (no allocation at submit) and
    generates exactly what the same resume without a reservation does."""

    def engine() -> BlockPoolBatchEngine:
        return BlockPoolBatchEngine(
            model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=8, max_batch=4
        )

    params = SamplingParams(max_tokens=8, stop_tokens=())
    first = engine()
    uid = first.submit("a", list(b"the first turn of an agent"), params)
    turn1 = run_all(first)[uid]
    first.close()
    assert turn1.cache is not None
    prompt = list(turn1.cache.token_ids) + list(b" and its second turn")

    outputs = []
    for reserve in (True, False):
        fresh = engine()  # nothing idle in its arena, as in a new process
        arena = fresh._backend.arena  # type: ignore[attr-defined]
        if reserve:
            assert fresh.reserve(len(prompt), params.max_tokens)
            wait_idle(arena)
        uid = fresh.submit("a", prompt, params, cache=turn1.cache)
        done = run_all(fresh)[uid]
        assert done.usage.reused_tokens > 0
        assert arena.reserved_used == (1 if reserve else 0), "submit took the reserved buffers"
        outputs.append(done.token_ids)
        fresh.close()
    assert outputs[0] == outputs[1]


def test_engine_reserve_declines_what_it_could_never_run(model: object) -> None:
    eng = BlockPoolBatchEngine(
        model, ByteTokenizer(), model_name="tiny-llama", pool_blocks=8, max_batch=4, max_context=512
    )
    try:
        assert not eng.reserve(600, 8), "beyond the context: nothing is made"
    finally:
        eng.close()


def test_without_a_background_thread_reserve_does_nothing_and_stock_makes_sets_here() -> None:
    """Metal and CUDA: arrays made on another thread are not verified there, so nothing is."""
    arena = WatchedArena(make_spec())
    arena.background = False
    assert not arena.reserve(40)
    assert arena.made_on == []
    assert arena.stock(40)
    assert arena.made_on == [threading.get_ident()] and arena.idle_bytes > 0
    arena.take(40)
    assert arena.reserved_used == 1 and len(arena.made_on) == 1


def test_a_set_made_before_its_callback_is_attached_does_not_deadlock() -> None:
    """The background thread may finish a set before reserve() attaches its done-callback (under the
    arena's lock): the callback then runs at once on the reserving thread."""
    from concurrent.futures import Future

    class Instant:
        def submit(self, fn: object, *args: object) -> Future[LayerBuffers]:
            done: Future[LayerBuffers] = Future()
            done.set_result(fn(*args))  # type: ignore[operator]
            return done

        def shutdown(self, wait: bool = True) -> None:
            pass

    arena = KVArena(make_spec(), max_idle_bytes=10**9, background=True)
    arena._maker = Instant()  # type: ignore[assignment]
    finished = threading.Event()

    def reserve() -> None:
        arena.reserve(40)
        finished.set()

    threading.Thread(target=reserve, daemon=True).start()
    assert finished.wait(10), "reserve() deadlocked on its own lock"
    assert arena.idle_bytes > 0

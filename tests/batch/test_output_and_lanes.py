"""The output file (durable, locked, torn-line repair) and the per-agent lanes (no Redis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.batch.format import BatchRequest, error_line
from producer.batch.lanes import Lanes
from producer.batch.output import BatchOutput, OutputLockedError


def test_appended_lines_are_found_again_and_never_written_twice(tmp_path: Path) -> None:
    path = tmp_path / "out" / "result.jsonl"
    with BatchOutput(path) as out:
        out.append("id:a", {"custom_id": "a", "response": {"status_code": 200}, "error": None})
        out.append("line:3", error_line("run", 3, None, "invalid_json", "bad"))
        out.append("id:a", {"custom_id": "a", "response": {"status_code": 200}, "error": None})
    assert len(path.read_text().splitlines()) == 2
    with BatchOutput(path) as again:
        assert again.keys == {"id:a": True, "line:3": False}
        assert "id:a" in again and "id:b" not in again


def test_a_torn_last_line_from_a_crash_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "result.jsonl"
    good = json.dumps({"custom_id": "a", "response": {}, "error": None})
    path.write_text(good + "\n" + '{"custom_id": "b", "resp')
    with BatchOutput(path) as out:
        assert set(out.keys) == {"id:a"}
        out.append("id:b", {"custom_id": "b", "response": {}, "error": None})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "b"]


def test_a_second_writer_of_the_same_output_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "result.jsonl"
    with BatchOutput(path), pytest.raises(OutputLockedError):
        BatchOutput(path).open()
    BatchOutput(path).open().close()  # released with the first


def item(line: int, agent: str | None) -> BatchRequest:
    return BatchRequest(line, f"c{line}", "/v1/chat/completions", "kvrq", agent, {})


def test_lanes_release_an_agents_next_line_only_after_its_previous_one() -> None:
    lanes = Lanes()
    for line, agent in [(1, "a"), (2, "a"), (3, "b"), (4, None), (5, "b"), (6, None)]:
        lanes.add(item(line, agent))
    first = [lanes.pop_ready() for _ in range(4)]
    assert [i.line for i in first if i] == [1, 3, 4, 6]
    assert lanes.pop_ready() is None  # 2 waits for 1, 5 waits for 3
    assert first[1] is not None
    lanes.release(first[1])  # line 3 (agent b) ended
    nxt = lanes.pop_ready()
    assert nxt is not None and nxt.line == 5
    assert first[0] is not None
    lanes.release(first[0])
    nxt = lanes.pop_ready()
    assert nxt is not None and nxt.line == 2
    assert lanes.pending() == 0


def test_a_held_line_blocks_its_agent_until_released() -> None:
    lanes = Lanes()
    held = item(2, "a")
    lanes.hold(held)
    lanes.add(item(3, "a"))
    lanes.add(item(4, "b"))
    lanes.start()
    got = lanes.pop_ready()
    assert got is not None and got.line == 4 and lanes.pop_ready() is None
    lanes.release(held)
    got = lanes.pop_ready()
    assert got is not None and got.line == 3

from __future__ import annotations

from engine.batch.textstream import TextStream
from tests.engine.tiny import ByteTokenizer


def feed(stream: TextStream, text: str) -> list[str]:
    return [stream.add(t) for t in text.encode()]


def test_multibyte_characters_are_released_whole() -> None:
    stream = TextStream(ByteTokenizer())
    deltas = feed(stream, "aé€")
    assert deltas == ["a", "", "é", "", "", "€"]
    assert stream.finish() == ""


def test_stop_string_cuts_text_and_never_streams_it() -> None:
    stream = TextStream(ByteTokenizer(), stop=("END",))
    deltas = feed(stream, "hello ENDmore")
    assert stream.stopped
    out = "".join(deltas) + stream.finish()
    assert out == "hello " and stream.text == "hello "
    assert not any("E" in d for d in deltas)


def test_partial_stop_prefix_is_released_when_it_does_not_match() -> None:
    stream = TextStream(ByteTokenizer(), stop=("END",))
    deltas = feed(stream, "EN then")
    assert not stream.stopped
    assert "".join(deltas) + stream.finish() == "EN then"


def test_windowed_decoding_matches_a_full_decode_over_long_text() -> None:
    text = "naïve café — 東京タワー 🚀 " * 40
    stream = TextStream(ByteTokenizer())
    out = "".join(feed(stream, text)) + stream.finish()
    assert out == text == stream.text


def test_finish_releases_an_incomplete_character_as_replacement() -> None:
    stream = TextStream(ByteTokenizer())
    deltas = feed(stream, "ok") + [stream.add("€".encode()[0])]
    assert "".join(deltas) == "ok"
    assert stream.finish() == "\ufffd"

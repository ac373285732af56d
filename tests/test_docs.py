"""The docs cite what the repo holds and list what the code does (docs/worker.md's settings: tests/worker)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from store.errors import MISS_REASONS
from worker.cli.main import build_parser
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])


def test_docs_and_benchmarks_cite_nothing_outside_the_repo() -> None:
    """PLATFORM-NOTES was a file on the machines kvrq was built on; docs/platform.md holds its facts."""
    texts = [*DOCS, *(ROOT / "benchmarks").glob("*.py")]
    citing = [path.relative_to(ROOT) for path in texts if "PLATFORM-NOTES" in path.read_text()]
    assert citing == []


def test_repo_paths_named_in_the_docs_exist() -> None:
    named = {
        (doc.relative_to(ROOT), found)
        for doc in DOCS
        for found in re.findall(
            r"(?<![\w/.])((?:docs|benchmarks|engine|store|worker|producer|tests)/[\w/.-]*\w)", doc.read_text()
        )
    }
    missing = sorted((str(doc), path) for doc, path in named if not (ROOT / path).exists())
    assert missing == []


def test_every_miss_reason_is_in_the_store_format_table() -> None:
    documented = set(re.findall(r"`miss_(\w+)`", (ROOT / "docs" / "store-format.md").read_text()))
    assert documented == set(MISS_REASONS)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[str]]:
    """Every `kvrq` command path (("cache", "list"), ...) with the flags it takes."""
    found = {path: {option for action in parser._actions for option in action.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, (*path, name)))
    return found


KVRQ = _commands(build_parser())
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _code_segments(text: str) -> list[list[str]]:
    """The tokens of each command in the docs' code (fences, `spans`), split at ; && |, no comments."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    segments = []
    for line in lines:
        for segment in re.split(r";|&&|\|\||\s\|\s", re.split(r"(?:^|\s)#", line)[0]):
            segments.append([token.strip("[]()',.:") for token in segment.split()])
    return segments


def _flag(token: str) -> str | None:
    match = re.fullmatch(r"(--[a-z][a-z0-9-]*)(=.*)?", token)
    return match.group(1) if match else None


def _script_flags(script: Path) -> set[str]:
    """The flags a benchmark script defines: its quoted "--name" literals (argparse, shell case)."""
    return set(re.findall(r"[\"'(|\s](--[a-z][a-z0-9-]*)[\"')|]", script.read_text()))


def _script(token: str) -> Path | None:
    name = token.removeprefix("benchmarks/")
    path = ROOT / "benchmarks" / name
    return path if re.fullmatch(r"[\w-]+\.(py|sh)", name) and path.exists() else None


def _stale_commands_and_flags() -> list[str]:
    benchmark_flags = {
        flag for path in (ROOT / "benchmarks").glob("*.[ps][yh]") for flag in _script_flags(path)
    }
    any_kvrq_flag = set().union(*KVRQ.values())
    stale = []
    for doc in DOCS:
        where = str(doc.relative_to(ROOT))
        for tokens in _code_segments(doc.read_text()):
            at = [
                i
                for i, token in enumerate(tokens)
                if (token == "kvrq" or token.endswith("/bin/kvrq"))
                and not (i and tokens[i - 1].startswith("-"))
            ]
            scripts = [(i, _script(token)) for i, token in enumerate(tokens) if _script(token)]
            if at and not (
                scripts and scripts[0][0] < at[0]
            ):  # `bench_agents.py --sides kvrq` is the script's
                rest = tokens[at[0] + 1 :]
                command: tuple[str, ...] = ()
                if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
                    command = (rest[0],)
                    if command not in KVRQ:
                        stale.append(f"{where}: kvrq {rest[0]}")
                        continue
                    rest = rest[1:]
                actions = {path for path in KVRQ if path[:-1] == command and len(path) == len(command) + 1}
                for i, token in enumerate(rest):
                    alternatives = token.replace("\\", "").split("|")
                    if actions and (i == 0 or "|" in token) and re.fullmatch(r"[a-z|\\]+", token):
                        stale += [
                            f"{where}: kvrq {command[0]} {a}"
                            for a in alternatives
                            if (*command, a) not in KVRQ
                        ]
                known = set().union(
                    *(flags for path, flags in KVRQ.items() if path[: len(command)] == command)
                )
                stale += [
                    f"{where}: kvrq {' '.join(command)} {f}"
                    for t in rest
                    if (f := _flag(t)) and f not in known
                ]
            elif scripts:
                start, script = scripts[0]
                assert script is not None
                flags = _script_flags(script)
                stale += [
                    f"{where}: {script.name} {f}"
                    for t in tokens[start:]
                    if (f := _flag(t)) and f not in flags
                ]
            elif tokens and (f := _flag(tokens[0])) and f not in any_kvrq_flag | benchmark_flags:
                stale.append(f"{where}: {f}")
    return sorted(set(stale))


def test_every_kvrq_command_and_flag_the_docs_name_exists() -> None:
    """A doc's `kvrq CMD --flag` (or bare `--flag`) is in worker.cli's parser; a benchmark's in its script."""
    assert _stale_commands_and_flags() == []


def _read_env_vars() -> set[str]:
    """KVRQ_* names the code reads: as a string literal ("KVRQ_X", a shell's ${KVRQ_X}), or as
    WorkerSettings' KVRQ_<FIELD>; a name only in a comment or docstring does not count."""
    sources = [
        *(
            path
            for package in ("engine", "store", "worker", "producer")
            for path in (ROOT / package).rglob("*.py")
        ),
        *(ROOT / "benchmarks").glob("*.[ps][yh]"),
        *(ROOT / ".ci").iterdir(),
        ROOT / "Procfile",
    ]
    name = r"KVRQ_[A-Z0-9_]*[A-Z0-9]"
    pattern = re.compile(rf"[\"']({name})[\"']|\$\{{?({name})")
    read = {quoted or expanded for path in sources for quoted, expanded in pattern.findall(path.read_text())}
    return read | {f"KVRQ_{field.upper()}" for field in WorkerSettings.model_fields}


def test_every_kvrq_env_var_the_docs_name_is_read_by_the_code() -> None:
    read = _read_env_vars()
    named = {
        (str(doc.relative_to(ROOT)), name)
        for doc in DOCS
        for name in re.findall(r"KVRQ_[A-Z0-9_]*[A-Z0-9]", doc.read_text())
    }
    assert sorted((doc, name) for doc, name in named if name not in read) == []


def test_every_kvrq_command_is_in_the_commands_table_and_the_interfaces() -> None:
    """docs/worker.md's Commands table and docs/interfaces.md's Subcommands line list every `kvrq` command."""
    commands = {path[0] for path in KVRQ if path}
    table = (ROOT / "docs" / "worker.md").read_text().split("## Commands", 1)[1].split("\n#", 1)[0]
    assert commands - set(re.findall(r"^\| `kvrq ([a-z]+)", table, re.M)) == set()
    interfaces = (ROOT / "docs" / "interfaces.md").read_text()
    listed = re.search(r"Subcommands: (.*?)\.\n", interfaces, re.S)
    assert listed is not None
    assert commands - set(re.findall(r"`([a-z]+)", listed.group(1))) == set()


def test_the_base_install_the_docs_name_is_pyprojects() -> None:
    """ "needs only `redis`, `rq`, ..." must name exactly pyproject's dependencies (it once left two out)."""
    listed = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert listed is not None
    required = set(re.findall(r'^\s*"([\w-]+)', listed.group(1), re.M))
    claims = [
        (str(doc.relative_to(ROOT)), set(re.findall(r"`([\w-]+)`", claim)))
        for doc in DOCS
        for claim in re.findall(r"needs only ((?:`[\w-]+`[,\s]*(?:and\s+)?)+)", doc.read_text())
    ]
    assert claims and all(named == required for _, named in claims), claims


def test_the_readme_gives_the_test_command_ci_runs() -> None:
    """.ci/run runs .ci/setup then .ci/test: the README's test command, which a newcomer copies."""
    readme = (ROOT / "README.md").read_text()
    assert "```bash\nbash .ci/setup && bash .ci/test\n```" in readme
    run = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("bash ")]
    assert run == ["bash .ci/setup", "bash .ci/test"]


def _module_name_resolves(dotted: str) -> bool:
    """`worker.loop.scheduler.Scheduler`: the longest prefix that is a module of the repo, and the
    first name after it is in that module's source. `store.put` (two parts, no module `store/put`) is an
    object's method, not a path."""
    parts = dotted.split(".")
    second = ROOT / parts[0] / parts[1]
    if len(parts) == 2 and not (second.with_suffix(".py").exists() or second.is_dir()):
        return True
    for n in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:n])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.exists():
                rest = parts[n:]
                return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None
    return False


def test_module_names_in_the_docs_exist() -> None:
    """A dotted `worker.x.y.Name` in a doc names a module of the repo and something in it."""
    named = {
        (str(doc.relative_to(ROOT)), found)
        for doc in DOCS
        for found in re.findall(r"(?<![\w./-])((?:engine|store|worker|producer)(?:\.\w+)+)", doc.read_text())
    }
    assert sorted(item for item in named if not _module_name_resolves(item[1])) == []


def reading_path_words() -> dict[str, int]:
    """Words of the newcomer's reading path (docs/README.md): README.md and the pages marked *read*,
    less their sections that open with *Reference:* (tables and runbooks looked up, not read)."""
    rows = re.findall(r"^\| `(docs/[\w-]+\.md)` \| read \|", (ROOT / "docs" / "README.md").read_text(), re.M)
    words = {}
    for page in ["README.md", "docs/README.md", *rows]:
        sections = re.split(r"\n(?=#+ )", (ROOT / page).read_text())
        kept = [s for s in sections if not s.split("\n", 1)[-1].lstrip().startswith("*Reference:")]
        words[page] = sum(len(section.split()) for section in kept)
    return words


def test_the_reading_path_reads_in_an_hour() -> None:
    """About 15,000 words: an hour at a technical reader's pace. A page that grows past it says
    what to move out (into a reference section, a reference page or the code's docstrings)."""
    words = reading_path_words()
    assert len(words) >= 8, words  # README, the map and the read pages were all found
    assert sum(words.values()) <= 15_500, words

"""Each client driven as a user drives it, for three turns, against a ClientStack: the tests assert on
what these return, and benchmarks/bench_clients.py prints the same sessions' turns.

Clients run non-interactive in a fresh HOME (their config, caches and sessions stay in the test's
directory), telemetry off, and every request beyond loopback sent to a dead proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.clients.session import Session
from tests.clients.stack import ClientStack
from tests.conftest import in_ci

HERE = Path(__file__).resolve().parent
#: A port nothing listens on: any request a client makes beyond loopback fails at once.
NO_NETWORK = "http://127.0.0.1:9"
QUESTIONS = ("What is the capital of France?", "And of Italy?", "Thanks.")
#: Requests one `opencode run` may make: its title request and its agent request (a tool call or
#: two would add some; the compaction loop it once fell into, many more).
OPENCODE_MAX_REQUESTS_PER_RUN = 4


def client_program(name: str) -> Path:
    """A pinned client: node_modules/.bin (npm) or .venv-NAME/bin (pip), installed by .ci/setup."""
    for path in (HERE / "node_modules" / ".bin" / name, HERE / f".venv-{name}" / "bin" / name):
        if path.exists():
            return path
    message = f"{name} is not installed under tests/clients (bash .ci/setup installs the pinned clients)"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's PATH and locale, a fresh HOME, telemetry off, non-loopback traffic to a dead proxy."""
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "LD_LIBRARY_PATH")}
    proxies = {
        name: NO_NETWORK for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")
    }
    return {
        **keep,
        **proxies,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "DO_NOT_TRACK": "1",
        **extra,
    }


def claude_env(stack: ClientStack, home: Path) -> dict[str, str]:
    """Claude Code's environment: its config under `home`, kvrq as its Anthropic API."""
    return isolated_env(
        home,
        CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_BASE_URL=stack.url,
        ANTHROPIC_API_KEY="unused",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )


def codex_exec(stack: ClientStack, home: Path) -> tuple[list[str | Path], dict[str, str]]:
    """`codex exec` on kvrq as a custom Responses provider (the arguments after it are the caller's),
    and its environment: CODEX_HOME under `home`."""
    (home / ".codex").mkdir(parents=True)
    env = isolated_env(home, CODEX_HOME=str(home / ".codex"), OPENAI_API_KEY="unused")
    provider = f'{{name="kvrq",base_url="{stack.url}/v1",wire_api="responses",env_key="OPENAI_API_KEY"}}'
    base: list[str | Path] = [client_program("codex"), "exec", "--skip-git-repo-check"]
    base += ["-c", "model_provider=kvrq", "-c", f"model_providers.kvrq={provider}", "-m", stack.model]
    return base, env


def write_opencode_config(stack: ClientStack, workdir: Path) -> None:
    """opencode.json in `workdir`: kvrq as an openai-compatible provider with no limits set (opencode's
    defaults), sharing off."""
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "kvrq",
        "options": {"baseURL": f"{stack.url}/v1", "apiKey": "unused"},
        "models": {stack.model: {"name": "kvrq test model"}},  # no `limit`: opencode's defaults
    }
    config = {"provider": {"kvrq": provider}, "model": f"kvrq/{stack.model}", "autoupdate": False}
    (workdir / "opencode.json").write_text(json.dumps({**config, "share": "disabled"}))


def claude_code(stack: ClientStack, tmp: Path) -> tuple[Session, list[dict[str, Any]]]:
    """`claude -p`, then `--continue`, then `--resume` its session: default configuration, JSON output."""
    claude = client_program("claude")
    env = claude_env(stack, tmp / "home")
    session = Session(stack, tmp / "work")
    options = ["--model", stack.model, "--output-format", "json"]
    first = json.loads(session.run([claude, "-p", "What is in this folder?", *options], env))
    second = json.loads(session.run([claude, "-p", "And what next?", "--continue", *options], env))
    third = json.loads(session.run([claude, "-p", "Thanks.", "--resume", first["session_id"], *options], env))
    return session, [first, second, third]


def codex(stack: ClientStack, tmp: Path) -> tuple[Session, list[str]]:
    """`codex exec`, then `codex exec resume --last` twice, on a custom Responses provider."""
    base, env = codex_exec(stack, tmp / "home")
    session = Session(stack, tmp / "work")
    turns = (["Say hello."], ["resume", "--last", "And now?"], ["resume", "--last", "Thanks."])
    return session, [session.run([*base, *argv], env) for argv in turns]


def opencode(stack: ClientStack, tmp: Path) -> tuple[Session, list[int]]:
    """`opencode run`, `--continue`, `--session ID` with an openai-compatible provider and no limits
    set (opencode's defaults); the requests each run made (asserted bounded as they come)."""
    program = client_program("opencode")
    env = isolated_env(tmp / "home")
    session = Session(stack, tmp / "work")
    write_opencode_config(stack, session.workdir)
    counts: list[int] = []

    def run(*args: str) -> list[dict[str, Any]]:
        before = len(session.exchanges())
        out = session.run([program, "run", "--format", "json", *args], env, timeout=240)
        counts.append(len(session.exchanges()) - before)
        assert counts[-1] <= OPENCODE_MAX_REQUESTS_PER_RUN, session.requests_brief()
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    first = run("What is in this folder?")
    run("--continue", "And what next?")
    ids = {event["sessionID"] for event in first if "sessionID" in event}
    assert len(ids) == 1, first
    run("--session", ids.pop(), "Thanks.")
    return session, counts


def llm_cli(stack: ClientStack, tmp: Path) -> Session:
    """`llm -m kvrq` (an extra OpenAI model), then `llm -c` twice; greedy, 24 tokens."""
    program = client_program("llm")
    user_dir = tmp / "llm"
    user_dir.mkdir(parents=True)
    (user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: kvrq\n  model_name: {stack.model}\n  api_base: {stack.url}/v1\n  api_key_name: kvrq\n"
    )
    env = isolated_env(tmp / "home", LLM_USER_PATH=str(user_dir))
    session = Session(stack, tmp / "work")
    session.run([program, "keys", "set", "kvrq", "--value", "unused"], env)
    greedy = ["-o", "temperature", "0", "-o", "max_tokens", "24"]
    session.run([program, "-m", "kvrq", *greedy, QUESTIONS[0]], env)
    for question in QUESTIONS[1:]:
        session.run([program, "-c", *greedy, question], env)
    return session


def aider(stack: ClientStack, tmp: Path) -> Session:
    """`aider --message` three times, no git, its chat history restored each run; greedy, 24 tokens
    (a model settings file, as aider documents for OpenAI-compatible servers)."""
    program = client_program("aider")
    session = Session(stack, tmp / "work")
    model = f"openai/{stack.model}"
    (session.workdir / "settings.yml").write_text(
        f"- name: {model}\n  edit_format: whole\n  use_temperature: 0\n  extra_params:\n    max_tokens: 24\n"
    )
    env = isolated_env(tmp / "home", LITELLM_LOCAL_MODEL_COST_MAP="True")
    argv: list[str | Path] = [program, "--model", model, "--openai-api-base", f"{stack.url}/v1"]
    argv += ["--openai-api-key", "unused"]
    argv += ["--model-settings-file", "settings.yml", "--no-git", "--yes-always", "--no-check-update"]
    argv += ["--no-analytics", "--no-show-model-warnings", "--no-stream", "--no-pretty", "--no-fancy-input"]
    argv += ["--restore-chat-history", "--map-tokens", "0"]
    for question in QUESTIONS:
        session.run([*argv, "--message", question], env)
    return session


def agents_sdk(stack: ClientStack, tmp: Path, api: str) -> Session:
    """The OpenAI Agents SDK on its Responses or Chat Completions model, each turn re-sending the
    whole history (`to_input_list`, the SDK's way without server-side state)."""
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    session = Session(stack, tmp / "work")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        model = kind(model=stack.model, openai_client=client)
        # Stop strings end the tiny model's answers: the SDK raises on one cut by max_tokens.
        settings = ModelSettings(max_tokens=64, temperature=0.0, extra_body={"stop": [".", "\n"]})
        agent = Agent(
            name="geo", instructions="You are a helpful assistant.", model=model, model_settings=settings
        )
        history: list[Any] = []
        for question in QUESTIONS:
            result = await Runner.run(agent, [*history, {"role": "user", "content": question}])
            assert isinstance(result.final_output, str)
            history = result.to_input_list()
        await client.close()

    asyncio.run(run())
    return session

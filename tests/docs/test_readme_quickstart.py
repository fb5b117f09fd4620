"""The README's quick start, lived as a new user lives it: a fresh copy of the checkout, `make run` (which
makes its own virtual environment) on a free port, then the README's curl and SDK examples exactly as
written but for the port, each answer checked against the one the README shows. The README cannot drift
from the product without failing this test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_PORT = 8000
START_GUARD_S = 300.0  # the first `make run` installs the server's dependencies into a new venv
ANY = "..."


@dataclass(frozen=True)
class Example:
    """One shell command of the README and the answer the README shows for it (None: none shown)."""

    command: str
    expected: str | None


def section(markdown: str, heading: str) -> str:
    """The text under a level-2 heading, up to the next one."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
    assert match, f"README.md has no section {heading!r}"
    return match.group(1)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def shell_examples(block: str) -> list[Example]:
    """Each command (with its continuation lines) and the comment line right after it, if that comment
    shows an answer (`# {...}` or `# 409 ... {...}`)."""
    examples: list[Example] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        command = [line]
        while command[-1].endswith("\\"):
            i += 1
            command.append(lines[i])
        i += 1
        expected = None
        if i < len(lines) and re.match(r"#\s*(\d{3}\b.*)?\{", lines[i].strip()):
            expected = lines[i].strip()[1:].strip()
            i += 1
        examples.append(Example("\n".join(command), expected))
    return examples


def matches(expected: Any, actual: Any) -> bool:
    """``expected`` as the README shows it: ``"..."`` stands for any value, and an object may leave keys
    out (a trailing ``...`` in the README)."""
    if expected == ANY:
        return True
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and matches(value, actual[key]) for key, value in expected.items()
        )
    return bool(expected == actual)


def parse_shown(shown: str) -> tuple[int | None, dict[str, Any]]:
    """`409 application/problem+json {...}` or `{...}`: the status if shown, and the body, with the
    README's `...` (a value left out, or more keys) made parseable."""
    status_match = re.match(r"(\d{3})\b", shown)
    body = shown[shown.index("{") :]
    body = re.sub(r",\s*\.\.\.\s*}", "}", body)  # {"a": 1, ...}: more keys may follow
    body = body.replace('"..."', json.dumps(ANY))
    return (int(status_match.group(1)) if status_match else None), json.loads(body)


@pytest.fixture(scope="module")
def fresh_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout's files as a clone would have them (tracked and new, never ignored ones such as
    .venv or a data directory), in a new directory."""
    target = tmp_path_factory.mktemp("readme") / "lockledger"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def served(fresh_checkout: Path) -> Iterator[str]:
    """`make run PORT=N` in the fresh copy, until it is ready; stopped (with its embedded PostgreSQL)
    afterwards as Ctrl-C would."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKLEDGER_", "VIRTUAL_ENV"))}
    env["PYTHON"] = sys.executable  # the same interpreter the suite runs on
    log = (fresh_checkout / "make-run.log").open("wb")
    process = subprocess.Popen(
        ["make", "run", f"PORT={port}"],
        cwd=fresh_checkout,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_GUARD_S
        while True:
            assert process.poll() is None, (fresh_checkout / "make-run.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (fresh_checkout / "make-run.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_readme_shows_answers_to_check() -> None:
    """The parsing this test relies on finds the README's examples (a guard against a silent pass)."""
    examples = [
        e
        for block in code_blocks(section(_readme(), "A lease over HTTP"), "bash")
        for e in shell_examples(block)
    ]
    assert len(examples) >= 4
    assert sum(e.expected is not None for e in examples) >= 3
    assert all(e.command.startswith("curl ") for e in examples)


def test_curl_examples_answer_as_the_readme_shows(served: str) -> None:
    port = served.rsplit(":", 1)[1]
    examples = [
        e
        for block in code_blocks(section(_readme(), "A lease over HTTP"), "bash")
        for e in shell_examples(block)
    ]
    for example in examples:
        command = example.command.replace(f"localhost:{README_PORT}", f"localhost:{port}")
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (example.command, result.stderr)
        answer = json.loads(result.stdout)
        assert "status" not in answer or answer["status"] < 500, answer
        if example.expected is None:
            continue
        status, body = parse_shown(example.expected)
        assert matches(body, answer), (example.command, example.expected, answer)
        if status is not None:
            assert answer["status"] == status, answer


def test_sdk_example_runs_as_written(served: str, fresh_checkout: Path) -> None:
    blocks = code_blocks(section(_readme(), "Python SDK"), "python")
    assert blocks, "README.md's Python SDK section has no example"
    dev_mode = blocks[0].replace(f"127.0.0.1:{README_PORT}", served.removeprefix("http://"))
    result = subprocess.run(
        [str(fresh_checkout / ".venv" / "bin" / "python"), "-c", dev_mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=fresh_checkout,
    )
    assert result.returncode == 0, result.stderr
    shown = re.findall(r"^# prints: (.*)$", blocks[0], re.M)
    assert shown, "the SDK example shows what it prints"
    printed = result.stdout.strip().splitlines()
    assert len(printed) == len(shown)
    for expected, line in zip(shown, printed, strict=True):
        pattern = re.escape(expected).replace(re.escape(ANY), ".+")
        assert re.fullmatch(pattern, line), (expected, line)


def test_tokens_command_runs_as_printed(served: str, fresh_checkout: Path) -> None:
    """The README's token commands, with the venv's bin on PATH as the README says."""
    commands = [
        line.split("#")[0].strip()
        for block in code_blocks(section(_readme(), "Tokens and roles"), "bash")
        for line in block.splitlines()
        if line.startswith("lockledger tokens create")
    ]
    assert commands
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKLEDGER_")}
    env["PATH"] = f"{fresh_checkout / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    result = subprocess.run(
        ["bash", "-c", commands[0]], capture_output=True, text=True, timeout=120, cwd=fresh_checkout, env=env
    )
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert token.startswith("llt_")


def test_make_run_prints_the_dashboards_url(served: str, fresh_checkout: Path) -> None:
    """The README sends a new user to the dashboard; `make run` says where it is."""
    printed = (fresh_checkout / "make-run.log").read_text(errors="replace")
    assert re.search(rf"Dashboard:\s+{re.escape(served)}/\s", printed), printed[-2000:]
    page = httpx.get(f"{served}/", timeout=5, follow_redirects=True)
    assert page.text.lstrip().lower().startswith("<!doctype html>")


def test_run_from_the_clones_parent_the_sdk_is_not_shadowed(served: str, fresh_checkout: Path) -> None:
    """The clone is a folder named `lockledger`: a script run from its parent has that folder (no
    `__init__.py`) as a namespace package on its path, which must not win over the installed SDK."""
    assert fresh_checkout.name == "lockledger"
    python = fresh_checkout / ".venv" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", "import lockledger; print(lockledger.__file__, lockledger.AsyncClient.__name__)"],
        cwd=fresh_checkout.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [str(fresh_checkout / "lockledger" / "__init__.py"), "AsyncClient"]

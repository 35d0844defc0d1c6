"""Every command the README (and docs/performance.md) shows still runs.

Each command's entry point answers ``--help``; the short ones run end to end on the simulated device:
``generate`` and ``demo``, and ``serve`` with a request and the packaged serving benchmark
(``python -m asyncbatch.bench``) against it. ``serve`` runs as its own process, as a user starts it; the
others run in the test worker (tests/in_process.py), their fresh-interpreter start being what the
``--help`` run checks. The two set-up commands (``scripts/demo.sh``,
``scripts/test.sh``) install things and run the whole suite, so only their presence and syntax are
checked here; the demo's body is ``asyncbatch demo``, run below.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from in_process import run_program
from serve_harness import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "performance.md")
TIMEOUT_S = 300


def shown_commands(path: Path) -> list[str]:
    """The shell commands of a Markdown file's ```bash blocks (continuation lines joined, comments cut)."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith(("#", "-", "}", '"')):
                commands.append(line)
    return commands


def entry_point(command: str) -> list[str] | None:
    """The argv that asks the command's program for ``--help``; None for what is not a Python program."""
    words = shlex.split(command.split(" -d ")[0])
    if words[0].endswith("python") and words[1] == "-m":
        module = words[2]
        sub = [words[3]] if module == "asyncbatch" else []
        return [sys.executable, "-m", module, *sub, "--help"]
    if words[0].endswith("python"):
        return [sys.executable, str(ROOT / words[1]), "--help"]
    if words[0].endswith("asyncbatch"):
        return [sys.executable, "-m", "asyncbatch", words[1], "--help"]
    return None


def _run(argv: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _programs() -> list[tuple[str, ...]]:
    found = {tuple(argv) for doc in DOCS for command in shown_commands(doc)
             if (argv := entry_point(command)) is not None}
    return sorted(found)


def test_the_docs_show_the_commands_this_test_covers():
    readme = shown_commands(ROOT / "README.md")
    assert readme[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert any(c.startswith("python -m asyncbatch.bench ") for c in readme)
    assert any("asyncbatch serve --device sim" in c for c in readme)
    assert len(_programs()) >= 15  # every script under scripts/ that the performance page names


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/test.sh", "scripts/gpu_check.sh"])
def test_the_shell_scripts_exist_and_parse(script):
    assert _run(["bash", "-n", str(ROOT / script)]).returncode == 0


# Runs each program's ``--help`` in one interpreter (torch imported once, not once per program): argv
# in on stdin as JSON, {program: [exit status, stdout]} out as the last line.
_HELP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for argv in json.loads(sys.stdin.read()):
    out = io.StringIO()
    sys.argv = argv[2:] if argv[1] == "-m" else argv[1:]
    with contextlib.redirect_stdout(out):
        try:
            if argv[1] == "-m":
                sys.argv[0] = argv[2]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str(__import__("pathlib").Path(argv[1]).parent))
                runpy.run_path(argv[1], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        except Exception:  # a program that fails to import or parse: its traceback is the message
            code = 1
            out.write(traceback.format_exc())
    results[" ".join(argv[1:])] = [code, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    programs = [list(argv) for argv in _programs()]
    done = subprocess.run([sys.executable, "-c", _HELP_DRIVER], input=json.dumps(programs), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", _programs(), ids=lambda argv: " ".join(Path(a).name for a in argv[1:-1]))
def test_every_shown_program_answers_help(argv, helps):
    code, text = helps[" ".join(argv[1:])]
    assert code == 0, f"{argv}: exit {code}\n{text[-2000:]}"
    assert "usage:" in text.lower()


def on_sim(command: str) -> list[str]:
    """``python -m asyncbatch ...`` as this interpreter's argv, on the simulated device."""
    words = shlex.split(command)[1:]
    if "--device" in words:
        i = words.index("--device")
        del words[i:i + 2]
    return [sys.executable, *words, "--device", "sim"]


@pytest.mark.parametrize("command", [c for c in shown_commands(ROOT / "README.md")
                                     if c.startswith("python -m asyncbatch generate")])
def test_generate_runs_on_sim(command):
    done = run_program(on_sim(command))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(simulated)" in done.stderr


def test_demo_runs_on_sim():
    command = next(c for c in shown_commands(ROOT / "README.md") if c.startswith("python -m asyncbatch demo"))
    done = run_program(on_sim(command))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "overlap" in done.stdout and "sync" in done.stdout
    # Three rounds alternate between the modes; the ratio is their median, with the rounds' range beside it.
    assert "3 rounds alternating between the modes" in done.stdout
    assert re.search(r"overlap/sync throughput ratio: \d+\.\d\dx \(rounds \d+\.\d\d-\d+\.\d\d\); "
                     r"identical tokens in both modes: True", done.stdout), done.stdout


def test_serve_answers_and_the_serving_benchmark_measures_it(tmp_path):
    server = ServeProcess()  # ``asyncbatch serve --device sim`` on a free port, healthy
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 48})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        done = run_program([sys.executable, "-m", "asyncbatch.bench", "--base-url", server.url, "--out",
                     str(tmp_path / "bench"), "--device", "sim", "--num-prompts", "8", "--request-rates", "inf",
                     "--warmup-requests", "1"])
        assert done.returncode == 0, done.stderr[-3000:]
        doc = json.loads((tmp_path / "bench" / "serving.json").read_text())
        summary = doc["systems"][0]["points"][0]["summary"]
        assert summary["completed"] == 8 and summary["failed"] == 0
    finally:
        server.kill()

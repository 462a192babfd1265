"""The `pagedkv` command on the default install, without the `serve` and
`distributed` extras: their modules are made unimportable in a fresh
interpreter, and each subcommand either works or says which extra to
install."""

from __future__ import annotations

import json
import subprocess
import sys

EXTRAS_MODULES = (
    "fastapi",
    "starlette",
    "pydantic",
    "uvicorn",
    "prometheus_client",
    "zmq",
    "msgpack",
    "redis",
    "nixl",
)

SCRIPT = """
import contextlib, io, json, sys
sys.modules.update(dict.fromkeys(EXTRAS_MODULES))  # None: an ImportError
from pagedkv.cli.main import main
results = []
for argv in ARGVS:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_without_extras(*argvs: list[str]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of `pagedkv ARGV` for each argv, in one
    interpreter where the extras' modules cannot be imported."""
    script = f"EXTRAS_MODULES = {EXTRAS_MODULES!r}\nARGVS = {list(argvs)!r}\n{SCRIPT}"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(r) for r in json.loads(result.stdout)]


def test_the_command_works_and_names_the_extra_a_subcommand_needs():
    generate_help, cache_help, serve, route = run_without_extras(
        ["generate", "--help"],
        ["cache", "--help"],
        ["serve"],
        ["route", "--replica", "http://127.0.0.1:1"],
    )
    assert generate_help[0] == 0 and "usage: pagedkv generate" in generate_help[1]
    assert cache_help[0] == 0 and "usage: pagedkv cache" in cache_help[1]
    assert serve[0] == 2 and "is missing: pip install 'pagedkv[serve]'" in serve[2]
    assert route[0] == 2 and "is missing: pip install 'pagedkv[serve,distributed]'" in route[2]

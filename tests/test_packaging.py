"""The project's entry points exist: pixi tasks, README commands, .ci/run."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def cli_subcommands() -> set[str]:
    from pagedkv.cli.main import _parser

    parser = _parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return set(subparsers.choices)


def check_command(command: str) -> None:
    """Raises AssertionError unless the command's program and target exist."""
    argv = shlex.split(command)
    program = argv[0]
    if program == "pagedkv":
        assert argv[1] in cli_subcommands(), f"pagedkv has no subcommand {argv[1]!r}"
    elif program in ("python", "python3"):
        if argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
        else:
            assert (ROOT / argv[1]).is_file(), f"no file {argv[1]}"
    else:
        assert (ROOT / program).is_file(), f"unknown program {program!r}"


def test_every_pixi_task_names_something_that_exists():
    manifest = tomllib.loads((ROOT / "pixi.toml").read_text())
    tasks = manifest["tasks"]
    assert {"test", "demo", "bench", "check-gpu"} <= set(tasks)
    for command in tasks.values():
        check_command(command if isinstance(command, str) else command["cmd"])
    assert set(manifest["workspace"]["platforms"]) == {"linux-64", "linux-aarch64", "osx-arm64"}
    assert "conda-forge" in manifest["workspace"]["channels"]
    assert any("conda.modular.com" in c for c in manifest["workspace"]["channels"])


def readme_commands() -> list[str]:
    """The commands in the README's first shell block (set-up + main job, tests)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README.md has no shell block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_commands_exist_and_ci_runs_the_readme_test_command():
    setup, test = readme_commands()[:2]
    for part in setup.split("&&"):
        part = part.strip()
        if not part.startswith("pip "):
            check_command(part)
    check_command(test)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines(), ".ci/run must run the README's test command"
    assert setup.split("&&")[0].strip() in ci, ".ci/run must install the README's way"
    for task in ("test", "demo"):
        pixi = tomllib.loads((ROOT / "pixi.toml").read_text())["tasks"][task]
        assert pixi in (test, setup.split("&&")[-1].strip())


def test_the_readme_examples_run():
    """The README's usage examples (its python blocks) run as written."""
    text = (ROOT / "README.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(examples) >= 2, "README.md lacks its python examples"
    for example in examples:
        assert len(example.strip().splitlines()) <= 15
        exec(compile(example, "README.md", "exec"), {})


def test_the_package_ships_its_kernels_and_graphs():
    manifest = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = manifest["tool"]["setuptools"]
    assert setuptools["package-dir"]["pagedkv.mojo_ops"] == "mojo_ops"
    assert setuptools["package-dir"]["pagedkv.graphs"] == "graphs"
    assert "*.mojo" in setuptools["package-data"]["pagedkv.mojo_ops"]
    # The kernels lie in subpackages (attention/cpu/, cache/, ...): the globs
    # (recursive as setuptools reads them) must reach every .mojo file.
    kernels = ROOT / "mojo_ops"
    shipped = {
        path
        for pattern in setuptools["package-data"]["pagedkv.mojo_ops"]
        for path in kernels.glob(pattern)
    }
    assert set(kernels.rglob("*.mojo")) <= shipped
    deps = " ".join(manifest["project"]["optional-dependencies"]["test"])
    assert "torch==2.13.0" in deps  # a looser pin pulls CUDA wheels

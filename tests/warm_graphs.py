"""Model step graphs compiled ahead, in a process of their own, beside the
suite's first tests.

A cold run of the suite spends most of its time compiling, and a compile
keeps about one core busy: on two cores the other one mostly idles. So when
the collected test modules name graphs in `WARM_GRAPHS` (a module-level
tuple of names of WARMERS below), conftest.py starts this file as a script
(`start`) to compile them in the order the tests first need them, by the
calls the tests make, so that each lands in the compile cache under the
name the tests look up. The script notes each name and artifact it begins
and ends in a file.

In the suite's process `install` wraps the compile cache's compile: a
compile of an artifact the script has started waits for it and loads it;
one the script has not reached yet is compiled as usual (the script then
finds it in the cache). A test that compiles in a process of its own (a
command) first waits for its name. A failed or absent script
changes nothing but time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import background

_KEY = "warm graphs"
WAIT_S = 900.0
"""The longest wait for one graph (a cold compile takes about a minute)."""

_notes: Path | None = None
"""The script's notes of this session, once started."""


def start(names: list[str]) -> None:
    """Starts compiling the graphs `names`, in order, in a process of its
    own; nothing where there are none or the compile cache is off."""
    global _notes
    from pagedkv._ops import compile_cache

    if not names or not compile_cache.enabled():
        return
    handle, notes = tempfile.mkstemp(prefix="pagedkv-warm-graphs-")
    os.close(handle)
    _notes = Path(notes)
    background.start(_KEY, [sys.executable, __file__, notes, *names])
    install()


def forget() -> None:
    """Removes the script's notes (the suite's end)."""
    global _notes
    if _notes is not None:
        _notes.unlink(missing_ok=True)
        _notes = None


def install() -> None:
    """Makes this process's compiles wait for the artifacts the script has
    started (see the module docstring)."""
    from pagedkv._ops import compile_cache

    compile_itself = compile_cache.compile_to_disk

    def compile_to_disk(session, key, device, build, custom_extensions):
        path = compile_cache.artifact_path(key, device)
        wait(str(path))
        if path.is_file():
            try:
                return session.compile(str(path))
            except Exception:  # noqa: BLE001  (an unreadable artifact: compile it)
                pass
        return compile_itself(session, key, device, build, custom_extensions)

    compile_cache.compile_to_disk = compile_to_disk


def wait(item: str) -> None:
    """Returns once the script is done with `item` (a name of WARMERS, or
    an artifact's path): at once where it has not begun it or has ended. A
    test that compiles in a process of its own waits for its name here."""
    deadline = time.monotonic() + WAIT_S
    while _notes is not None and time.monotonic() < deadline and background.running(_KEY):
        notes = _notes.read_text().splitlines()
        if f"end {item}" in notes or f"begin {item}" not in notes:
            return
        time.sleep(0.2)


def _note(notes: Path, line: str) -> None:
    with open(notes, "a") as f:
        f.write(line + "\n")


def _demo() -> None:
    from conftest import DEMO_CONFIG, engine_with_pool
    from pagedkv.graphs.model import init_weights

    engine_with_pool(init_weights(DEMO_CONFIG, 0), 16)


def _demo_command() -> None:
    from pagedkv.graphs.demo import DemoOptions, run_demo

    # The random model's graphs do not depend on the requests' count.
    run_demo(DemoOptions(model="random", requests=1, max_new_tokens=1))


def _gemma3_shaped(quantized: bool, kv_dtype: str = "float32") -> None:
    from gemma3_shaped import CONFIG, WEIGHTS_SEED, engine
    from pagedkv.graphs.model import init_weights, quantize_weights

    weights = init_weights(CONFIG, seed=WEIGHTS_SEED)
    if quantized:
        dense, packed = quantize_weights(CONFIG, weights, "Q8_0")
        engine(dense, 16, packed, kv_dtype=kv_dtype)
    else:
        engine(weights, 16)


def _smollm2(weights: str | None) -> None:
    from pagedkv.models import load

    # The pool's size is not the graphs': a small one spares the memory.
    load("smollm2-135m-instruct", weights=weights, kv_memory=16 << 20)


WARMERS = {
    "demo": _demo,
    "demo-command": _demo_command,
    "gemma3-shaped": lambda: _gemma3_shaped(False),
    "gemma3-shaped-q8_0": lambda: _gemma3_shaped(True),
    "gemma3-shaped-q8_0-int8": lambda: _gemma3_shaped(True, "int8"),
    "smollm2-f32": lambda: _smollm2("f32"),
    "smollm2-gguf": lambda: _smollm2(None),
}
"""What each name compiles: the calls its tests make (the demo's model
through conftest's engine, batch-invariant or not: the same graphs;
`pagedkv demo --model random`'s, the Gemma 3-shaped model through its
engine, SmolLM2 by `load` as the tests and `pagedkv generate` load it)."""


def _main(notes: Path, names: list[str]) -> None:
    """The script: compiles `names` in order, noting each artifact."""
    from pagedkv._ops import compile_cache

    compile_itself = compile_cache.compile_to_disk

    def noted(session, key, device, build, custom_extensions):
        path = compile_cache.artifact_path(key, device)
        _note(notes, f"begin {path}")
        try:
            return compile_itself(session, key, device, build, custom_extensions)
        finally:
            _note(notes, f"end {path}")

    compile_cache.compile_to_disk = noted
    for name in names:
        _note(notes, f"begin {name}")
        try:
            WARMERS[name]()
        except Exception:  # noqa: BLE001  (its tests compile it, and fail there if it is broken)
            traceback.print_exc()
        _note(notes, f"end {name}")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here / "graphs")]
    _main(Path(sys.argv[1]), sys.argv[2:])

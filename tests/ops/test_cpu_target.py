"""PAGEDKV_CPU_TARGET: the kernels compile for the CPU it names.

The probe op (simd/isa.mojo) reports the branches a compile took. Without
the variable they follow the CPU the compiler sees on the host (never more
than /proc/cpuinfo lists, sometimes less); with `x86-64-v3` they
are AVX2's (8 float32 lanes, `vpmaddubsw` pairs, no AVX-512), whatever the
host has, and the compile cache names those artifacts apart. The slow set
runs the quantized, linear and attention kernels' tests on an x86 host
under `x86-64-v3`, so the AVX2 code paths are checked against their float64
references on AVX-512 hosts too. Where the CPU has AMX, quantized products
of 16 rows or more run on its tiles (simd/amx.mojo), unless PAGEDKV_AMX is
0: the slow set runs the same kernels' tests that way too.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedkv._ops import cpu_target
from pagedkv._ops.compile_cache import artifact_path
from pagedkv._ops.contract import AMX_ENV, CPU_ISA_FIELDS
from pagedkv._ops.kernels import MAX_BUSY_WAIT_ENV
from pagedkv._ops.tensors import CPU

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine() in ("x86_64", "AMD64")
AVX2_TARGET = "x86-64-v3"

PROBE = """
import json
from pagedkv._ops.compile_cache import artifact_path
from pagedkv._ops.cpu_target import kernel_isa
from pagedkv._ops.tensors import CPU
print(json.dumps({"isa": kernel_isa(), "artifact": str(artifact_path(("probe",), CPU))}))
"""


def probe(target: str | None, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != cpu_target.ENV} | extra_env
    if target is not None:
        env[cpu_target.ENV] = target
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600
    )


def compiler_host_view() -> tuple[str, set[str]]:
    """The CPU the Mojo compiler compiles for when no target is named, and
    the features it gives that CPU (from the LLVM IR of an empty program):
    what MAX's host compiles take too."""
    from mojo.run import subprocess_run_mojo

    with tempfile.TemporaryDirectory() as tmp:
        source, ir = Path(tmp) / "main.mojo", Path(tmp) / "main.ll"
        source.write_text("def main():\n    pass\n")
        built = subprocess_run_mojo(
            ["build", "--emit", "llvm", str(source), "-o", str(ir)], capture_output=True, text=True
        )
        assert built.returncode == 0, built.stderr[-2000:]
        text = ir.read_text()
    cpu = re.search(r'"target-cpu"="([^"]+)"', text).group(1)
    features = re.search(r'"target-features"="([^"]*)"', text).group(1).split(",")
    return cpu, {f[1:] for f in features if f.startswith("+")}


@pytest.mark.skipif(not X86 or not Path("/proc/cpuinfo").exists(), reason="reads x86 cpuinfo")
@pytest.mark.skipif(bool(os.environ.get(cpu_target.ENV)), reason="a CPU target is set")
def test_kernels_compile_for_the_host_by_default():
    """The kernels take the branches of the CPU the compiler sees, which
    never claims a feature the CPU lacks (it may lack some the CPU has:
    `unused_cpu_features`)."""
    isa = cpu_target.kernel_isa()
    cpu, features = compiler_host_view()
    assert set(isa) == set(CPU_ISA_FIELDS)
    assert isa["x86"] == 1
    assert isa["avx2"] == int("avx2" in features), cpu
    assert isa["avx512f"] == int("avx512f" in features), cpu
    assert isa["f32_lanes"] == (16 if "avx512f" in features else 8)
    # vpdpbusd at the vector width: AVX512_VNNI with AVX-512, AVX-VNNI without.
    vnni = "avx512vnni" in features if "avx512f" in features else "avxvnni" in features
    assert isa["vnni"] == int(vnni), cpu
    assert isa["maddubs"] == int("avx2" in features and not vnni)
    assert isa["dot_bf16"] == int("avx512bf16" in features), cpu
    # /proc/cpuinfo's names for the features the kernels branch on.
    named = {"avx2": "avx2", "avx512f": "avx512f", "avx512vnni": "avx512_vnni"}
    named |= {"avxvnni": "avx_vnni", "avx512bf16": "avx512_bf16"}
    flags = cpu_target.cpu_flags()
    # AMX is asked of the running CPU, past the compiler's view of it.
    amx = isa["avx512f"] and isa["vnni"] and {"amx_tile", "amx_int8"} <= flags
    assert isa["amx"] == int(amx and os.environ.get(AMX_ENV) != "0"), flags
    assert {named[f] for f in features if f in named} <= flags, cpu
    unused = cpu_target.unused_cpu_features(isa, flags)
    # What the line reports unused is what the compiler's CPU lacks.
    cpuinfo_name = {flag: feature for feature, flag in named.items()}
    assert all(flag in flags and cpuinfo_name[flag] not in features for flag in unused)
    assert (f"this CPU's {', '.join(unused)} unused" in cpu_target.kernel_isa_line()) == bool(
        unused
    )


@pytest.mark.parametrize(
    ("isa", "flags", "unused"),
    [
        # An AVX-512 compile that lacks AVX512_BF16 where the CPU has it.
        (
            (1, 1, 1, 0),
            {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"},
            ["avx512_bf16"],
        ),
        ((1, 1, 1, 1), {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, []),
        # An AVX2 compile on an AVX-512 CPU: its VNNI is AVX-VNNI.
        ((1, 0, 0, 0), {"avx2", "avx512f", "avx512_vnni", "avx_vnni"}, ["avx512f", "avx_vnni"]),
        ((1, 0, 1, 0), {"avx2", "avx_vnni"}, []),
        ((0, 0, 0, 0), set(), []),
    ],
)
def test_unused_cpu_features_are_the_cpus_features_the_compile_left_out(isa, flags, unused):
    isa = dict(zip(("avx2", "avx512f", "vnni", "dot_bf16"), isa, strict=True))
    assert cpu_target.unused_cpu_features(isa, flags) == unused


def host_artifact() -> str:
    """The probe's artifact path in a process with no CPU target: this one's,
    unless the suite runs under a target itself."""
    if not os.environ.get(cpu_target.ENV):
        return str(artifact_path(("probe",), CPU))
    host = probe(None)
    assert host.returncode == 0, host.stderr[-2000:]
    return json.loads(host.stdout)["artifact"]


@pytest.mark.skipif(not X86, reason="an x86 target")
def test_a_cpu_target_takes_its_branches_and_its_own_artifacts():
    avx2 = probe(AVX2_TARGET)
    assert avx2.returncode == 0, avx2.stderr[-2000:]
    avx2 = json.loads(avx2.stdout)
    isa = avx2["isa"]
    assert (isa["avx2"], isa["avx512f"], isa["vnni"], isa["maddubs"]) == (1, 0, 0, 1)
    assert (isa["f32_lanes"], isa["vector_registers"], isa["dot_bf16"]) == (8, 16, 0)
    assert isa["amx"] == 0
    assert avx2["artifact"] != host_artifact()


def test_pagedkv_amx_0_keeps_the_products_off_amx():
    """The variable the kernels read is the one the contract names, and 0
    turns AMX off (on a host without AMX it is off either way)."""
    source = (ROOT / "mojo_ops" / "simd" / "amx.mojo").read_text()
    assert f'comptime AMX_ENV = "{AMX_ENV}"' in source
    off = probe(None, **{AMX_ENV: "0"})
    assert off.returncode == 0, off.stderr[-2000:]
    assert json.loads(off.stdout)["isa"]["amx"] == 0


@pytest.mark.parametrize("name", ["no-such-cpu", "native"])
def test_an_unknown_cpu_is_a_value_error_not_an_abort(monkeypatch, name):
    monkeypatch.setenv(cpu_target.ENV, name)
    with pytest.raises(ValueError, match=cpu_target.ENV):
        cpu_target.check_cpu_name(name)


def test_maxs_busy_wait_setting_is_a_value_error_not_an_abort():
    """MAX aborts a process whose session starts with its busy-wait
    variable set; pagedkv's first call raises before starting one."""
    env = {**os.environ, MAX_BUSY_WAIT_ENV: "50"}
    code = "import numpy as np, pagedkv\npagedkv.get_seq_lens(np.array([0, 1]), np.array([1]), 16)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"ValueError: {MAX_BUSY_WAIT_ENV} is set" in result.stderr, result.stderr[-2000:]


AVX2_SUITES = [
    "tests/ops/test_qlinear.py",
    "tests/ops/test_decoder_layer.py",
    "tests/ops/test_linear.py",
    "tests/api/test_decode.py",
    "tests/api/test_prefill.py",
    # The int8 pool's products multiply codes: vpmaddwd here, vpdpwssd with VNNI.
    "tests/api/test_int8_cache.py",
]


def run_suites(suites: list[str], **env: str) -> subprocess.CompletedProcess:
    """The test files `suites` in a pytest process of their own, with `env` set."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=3600,
    )


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="an x86 target")
def test_the_avx2_code_paths_pass_the_kernel_tests():
    result = run_suites(AVX2_SUITES, **{cpu_target.ENV: AVX2_TARGET})
    assert result.returncode == 0, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(
    not {"amx_tile", "amx_int8"} <= cpu_target.cpu_flags(), reason="a CPU without AMX"
)
def test_the_avx512_products_of_many_rows_pass_without_amx():
    """Where AMX takes the products of 16 rows or more, the AVX-512 tiles
    that take them elsewhere are checked with it turned off."""
    suites = ["tests/ops/test_qlinear.py", "tests/ops/test_decoder_layer.py"]
    result = run_suites(suites, **{AMX_ENV: "0"})
    assert result.returncode == 0, result.stdout[-4000:]

"""How the comparison with llama.cpp builds llama-server and says how it was
built (benchmarks/llamacpp.py): AMX off on a CPU that has it, and the
header line read back from the build's CMake cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamacpp import AMX_OFF, configure_command, llama_isa


def fake_build(tmp_path: Path, cache: str) -> Path:
    """A build folder holding `cache` as its CMakeCache.txt; returns its
    bin/llama-server (a placeholder file)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "CMakeCache.txt").write_text(cache)
    binary = tmp_path / "bin" / "llama-server"
    binary.write_text("")
    return binary


@pytest.mark.parametrize("isa", [["avx2", "avx512f", "amx"], ["avx2"], []])
def test_the_build_turns_amx_off_exactly_where_the_cpu_has_it(isa):
    command = configure_command(Path("src"), Path("build"), isa)
    assert command[:8] == [
        "cmake",
        "-S",
        "src",
        "-B",
        "build",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
    ]
    flags = command[8:]
    if "amx" in isa:
        assert flags == [f"-DCMAKE_C_FLAGS={AMX_OFF}", f"-DCMAKE_CXX_FLAGS={AMX_OFF}"]
        assert set(AMX_OFF.split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    else:
        assert flags == []


@pytest.mark.parametrize(
    ("cache", "line"),
    [
        (
            "GGML_NATIVE:BOOL=ON\nCMAKE_C_FLAGS:STRING=\n",
            "built with GGML_NATIVE (this host's ISA)",
        ),
        (
            f"GGML_NATIVE:BOOL=ON\nCMAKE_C_FLAGS:STRING={AMX_OFF}\n",
            "built with GGML_NATIVE (this host's ISA), AMX off",
        ),
        (
            "GGML_NATIVE:BOOL=OFF\nGGML_AVX:BOOL=ON\nGGML_AVX2:BOOL=ON\nGGML_FMA:BOOL=ON\n"
            "GGML_AVX512:BOOL=OFF\n",
            "built for AVX AVX2 FMA (GGML_NATIVE off)",
        ),
    ],
)
def test_the_header_says_how_llama_server_was_built(tmp_path, cache, line):
    assert llama_isa(fake_build(tmp_path, cache)) == [line]


def test_a_binary_outside_a_build_folder_says_nothing(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    assert llama_isa(binary) == []

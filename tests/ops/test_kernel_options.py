"""linearize.ops.kernel_options: a run's kernel constants set by name, checked before any is set."""

import pytest

from linearize.ops import fused_dsla, fused_lola, kernel_options


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    for module, name in ((fused_lola, "ONE_KERNEL_ROWS"), (fused_lola, "STAGES"), (fused_lola, "PREFILL_READ_QUERIES"),
                         (fused_dsla, "STATE_TILES")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(kernel_options, "_APPLIED", {})


def test_options_are_set_by_name_and_recorded():
    got = kernel_options.apply(["fused_lola.ONE_KERNEL_ROWS=0", "fused_lola.STAGES=1", "fused_dsla.STATE_TILES=((32, 64, 4, 2),)"])
    assert got == {"fused_lola.ONE_KERNEL_ROWS": 0, "fused_lola.STAGES": 1, "fused_dsla.STATE_TILES": ((32, 64, 4, 2),)}
    assert fused_lola.ONE_KERNEL_ROWS == 0 and fused_lola.STAGES == 1 and fused_lola.one_kernel(1)
    assert fused_dsla.STATE_TILES == ((32, 64, 4, 2),)
    kernel_options.apply(["fused_lola.ONE_KERNEL_ROWS=None"])  # a constant that may be None
    assert fused_lola.ONE_KERNEL_ROWS is None and kernel_options.applied()["fused_lola.ONE_KERNEL_ROWS"] is None
    assert kernel_options.apply([]) == {}


def test_options_applied_for_a_block_are_set_back_after_it():
    """``applied_for``: the options hold inside the block, and after it (also when it raises) every
    constant and ``applied()`` are as before; a bad option sets nothing."""
    kernel_options.apply(["fused_lola.STAGES=2"])
    rows = fused_lola.ONE_KERNEL_ROWS
    with kernel_options.applied_for(iter(["fused_lola.STAGES=1", "fused_lola.ONE_KERNEL_ROWS=0"])) as got:
        assert got == {"fused_lola.STAGES": 1, "fused_lola.ONE_KERNEL_ROWS": 0}
        assert fused_lola.STAGES == 1 and fused_lola.ONE_KERNEL_ROWS == 0 and kernel_options.applied()["fused_lola.STAGES"] == 1
    assert fused_lola.STAGES == 2 and fused_lola.ONE_KERNEL_ROWS == rows and kernel_options.applied() == {"fused_lola.STAGES": 2}
    with pytest.raises(RuntimeError), kernel_options.applied_for(["fused_lola.STAGES=1"]):
        raise RuntimeError("inside")
    assert fused_lola.STAGES == 2 and kernel_options.applied() == {"fused_lola.STAGES": 2}
    with pytest.raises(ValueError, match="fused_lola.STAGES=x"), kernel_options.applied_for(["fused_lola.STAGES=x"]):
        pass
    assert fused_lola.STAGES == 2


@pytest.mark.parametrize(
    "item,says",
    [("fused_lola.NOPE=1", "fused_lola's constants: BLOCK_ROWS"), ("nomodule.X=1", "no module linearize.ops.nomodule"),
     ("fused_lola.STAGES=three", "'three' is not a literal"), ("fused_lola.STAGES=1.5", "fused_lola.STAGES is int (3), got float"),
     ("fused_lola.STAGES", "expected MODULE.NAME=VALUE"), ("STAGES=1", "expected MODULE.NAME=VALUE"),
     ("fused_lola.EMPTY_DENOMINATOR=1.0", "fused_lola's constants"), ("fused_lola.STAGES=None", "fused_lola.STAGES is int (3), got NoneType")],
    ids=["unknown-name", "unknown-module", "not-a-literal", "wrong-type", "no-value", "no-module", "imported-not-own", "none-not-declared"],
)
def test_a_bad_option_names_itself_and_sets_nothing(item, says):
    before = fused_lola.STAGES
    with pytest.raises(ValueError, match="expected MODULE.NAME=VALUE") as info:
        kernel_options.apply(["fused_lola.PREFILL_READ_QUERIES=16", item])
    assert item in str(info.value) and says in str(info.value)
    assert fused_lola.STAGES == before and fused_lola.PREFILL_READ_QUERIES != 16 and kernel_options.applied() == {}
    with pytest.raises(ValueError, match="expected MODULE.NAME=VALUE") as info:
        kernel_options.check(["fused_lola.PREFILL_READ_QUERIES=16", item])
    assert says in str(info.value) and fused_lola.PREFILL_READ_QUERIES != 16


def test_check_sets_nothing():
    before = fused_lola.STAGES
    kernel_options.check([f"fused_lola.STAGES={before + 1}"])
    assert fused_lola.STAGES == before and kernel_options.applied() == {}

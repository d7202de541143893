"""The fused decode kernels (Triton) against the torch decode steps they replace: outputs and the
states they update in place, token by token (on the GPU when there is one, else in Triton's
interpreter on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from linearize.ops import fused_decode
from linearize.ops.dsla import DslaDecodeState, dsla_attention, dsla_decode_step
from linearize.ops.hybrid import HybridDecodeState, hybrid_attention, hybrid_decode_step
from linearize.ops.lola import LolaDecodeState, lola_attention, lola_decode_step
from linearize.ops.states import DecodeClock

pytestmark = pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _phi(x):
    return torch.nn.functional.softplus(x)


@pytest.mark.parametrize("form", ["host", "static", "clocked"])
@pytest.mark.parametrize("mix", ["joint", "gate"])
@pytest.mark.parametrize("feats", [8, 37], ids=["F8", "F37"])  # 37: blocks of the feature and value axes masked
@pytest.mark.parametrize("grouped, hq, layouts", [(True, 4, ("rows", "rows")), (False, 4, ("rows", "rows")), (True, 6, ("rows", "columns")),
                                                   (True, 4, ("columns", "rows"))],
                         ids=["grouped", "per-query-head", "grouped-rep3-fused-column-major", "torch-column-major"])  # fmt: skip
@torch.no_grad()
def test_hybrid_fused_step_equals_the_torch_step(form, mix, feats, grouped, hq, layouts, monkeypatch):
    """From a window half full, 9 tokens (past the 4-token window, so slots leave it): the fused
    step's outputs and every state tensor equal the torch step's (the window read with a program
    per KV head and per query head; either step on a row-major or a column-major [S | z])."""
    monkeypatch.setattr(fused_decode, "WINDOW_GROUPED", grouped)
    monkeypatch.setattr(fused_decode, "COLUMN_STATES", True)
    torch.manual_seed(0)
    b, hkv, d, w = 2, 2, feats, 4
    q, k, v = (torch.randn(b, h, 2, d, device=DEVICE) for h in (hq, hkv, hkv))
    _, state = hybrid_attention(q, k, v, phi_q=_phi, phi_k=_phi, window=w, mix=mix)
    runs, clock = [], DecodeClock(DEVICE)
    for layout in layouts:  # torch, fused
        with fused_decode.use_fused(layout == "columns"):  # from_state makes [S | z] column-major where the fused kernels run
            ds = HybridDecodeState.from_state(state, _phi, hq)
        assert ds.linear.is_contiguous() == (layout == "rows")
        runs.append(ds.make_static() if form == "static" else ds.make_static(clock) if form == "clocked" else ds)
    ptr = runs[1].linear.data_ptr()
    for _ in range(9):
        q, k, v = (torch.randn(b, h, 1, d, device=DEVICE) for h in (hq, hkv, hkv))
        qf, kf = _phi(q)[:, :, 0], _phi(k.repeat_interleave(hq // hkv, dim=1))[:, :, 0]
        outs = []
        for fused, ds in zip((False, True), runs):
            with fused_decode.use_fused(fused):
                outs.append(hybrid_decode_step(ds, q, k, v, qf, kf, mix=mix))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        clock.advance()
    assert runs[1].linear.data_ptr() == ptr  # updated in place
    for got, want in zip(runs[1].canonical().tensors(), runs[0].canonical().tensors()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reads", [(True, True, 0), (True, False, 3), (False, True, 0)], ids=["hybrid", "no-sparse-weight-tokens", "no-state"])
@pytest.mark.parametrize("dims", [(8, 8), (37, 70)], ids=["D8", "D37-Dv70"])
@torch.no_grad()
def test_lola_fused_step_equals_the_torch_step(reads, dims, monkeypatch):
    """LoLA's step with the state's update and read in one kernel pass (the hybrid's state kernel, one
    slot per query head): outputs and memory equal the torch step's over 9 tokens from a state past
    the window and the cache's capacity, and the chunked op's; without the state read the torch
    update runs."""
    torch.manual_seed(2)
    read_state, read_sparse, weight_tokens = reads
    b, hq, hkv, w, lam = 2, 4, 2, 3, 4
    d, dv = dims
    factor = torch.rand(hq, device=DEVICE)
    options = dict(window_factor=factor, sinks=1, linear_weight=[0.2, 0.5, 1.0, 0.0], weight_tokens=weight_tokens,
                   read_state=read_state, read_sparse=read_sparse)  # fmt: skip
    kw = dict(phi_q=_phi, phi_k=_phi, window=w, sparse=lam, **options)
    q, k, v = torch.randn(b, hq, 9, d, device=DEVICE), torch.randn(b, hkv, 9, d, device=DEVICE), torch.randn(b, hkv, 9, dv, device=DEVICE)
    _, state = lola_attention(q, k, v, chunk=3, **kw)
    runs = [LolaDecodeState.from_state(state, phi_q=_phi, phi_k=_phi, scale=d**-0.5, dtype=torch.float32, **options) for _ in range(2)]
    ptr = runs[1].linear.data_ptr()
    calls = []
    kernel = fused_decode.hybrid_linear_step
    monkeypatch.setattr(fused_decode, "hybrid_linear_step", lambda *a: calls.append(1) or kernel(*a))
    for _ in range(9):
        q, k, v = torch.randn(b, hq, 1, d, device=DEVICE), torch.randn(b, hkv, 1, d, device=DEVICE), torch.randn(b, hkv, 1, dv, device=DEVICE)
        want, state = lola_attention(q, k, v, chunk=1, state=state, **kw)
        outs = []
        for fused, ds in zip((False, True), runs):
            with fused_decode.use_fused(fused):
                outs.append(lola_decode_step(ds, q, k, v))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1], want, atol=1e-5, rtol=1e-5)
    assert runs[1].linear.data_ptr() == ptr  # updated in place
    assert len(calls) == (9 if read_state else 0)  # the fused path ran where the state is read
    for got, ref, chunked in zip(runs[1].canonical().tensors(), runs[0].canonical().tensors(), state.tensors()):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, chunked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "plain"])
@pytest.mark.parametrize("dims", [(8, 8), (37, 70), (128, 9)], ids=["F8-D8", "F37-D70", "F128-D9"])
@pytest.mark.parametrize("layouts, by_row", [(("rows", "rows"), True), (("rows", "columns"), True), (("columns", "rows"), True),
                                             (("rows", "rows"), False), (("rows", "columns"), False)],
                         ids=["row-major", "fused-column-major", "torch-column-major", "row-major-options", "fused-column-major-options"])  # fmt: skip
@torch.no_grad()
def test_dsla_fused_step_equals_the_torch_step(normalize, dims, layouts, by_row, monkeypatch):
    """Both gated states decayed and written in one pass: outputs and states equal the torch step's
    over 6 tokens from a prefilled state, with grouped KV heads; either step on row-major or
    column-major states; a row's blocks of value columns adjacent in the state kernel's grid (the
    default) or, with the fused step on either layout, on a grid axis of their own. F8 runs both
    states in one program, the others split their feature rows."""
    monkeypatch.setattr(fused_decode, "DSLA_BLOCKS_BY_ROW", by_row)
    torch.manual_seed(1)
    b, hq, hkv = 2, 4, 2
    feats, dv = dims
    dk = feats if normalize else dv
    runs = []
    start = torch.randn(2, b, hq, dk, dv + normalize, device=DEVICE).abs()
    for layout in layouts:
        states = fused_decode.column_major(start) if layout == "columns" else start.clone()
        runs.append(DslaDecodeState(states, start.new_zeros(b, hkv, dv + normalize).index_fill_(-1, torch.tensor([dv], device=DEVICE), 1.0)
                                    if normalize else start.new_zeros(b, hkv, dv)))  # fmt: skip
        assert runs[-1].states.is_contiguous() == (layout == "rows")
    weights = torch.tensor([0.7, 0.3], device=DEVICE)
    ptr = runs[1].states.data_ptr()
    for _ in range(6):
        qf, kf = torch.rand(b, hq, dk, device=DEVICE), torch.rand(b, hq, dk, device=DEVICE)
        v = torch.randn(b, hkv, 1, dv, device=DEVICE)
        decay = torch.rand(b, 2, hq, dk, device=DEVICE)
        outs = []
        for fused, ds in zip((False, True), runs):
            with fused_decode.use_fused(fused):
                outs.append(dsla_decode_step(ds, qf, kf, v, decay, weights, normalize=normalize))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert runs[1].states.data_ptr() == ptr
    torch.testing.assert_close(runs[1].states, runs[0].states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("align", [1, 4, 8, None], ids=["unpadded", "align4", "align8", "column-major"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@torch.no_grad()
def test_dsla_fused_steps_continue_the_chunked_op(fused, align, monkeypatch):
    """The fused steps (and the torch steps) continue a prefilled dsla_attention exactly as the op
    does on each token, on rows of 17 columns as they are or padded to 20 or 24 (the padding stays
    zero and canonical() drops it), or column-major (what ``from_state`` makes where the fused
    kernels run)."""
    monkeypatch.setattr(fused_decode, "COLUMN_STATES", True)
    torch.manual_seed(2)
    b, hq, hkv, d = 1, 4, 2, 16
    q, k = torch.rand(b, hq, 5, d, device=DEVICE), torch.rand(b, hkv, 5, d, device=DEVICE)
    v = torch.randn(b, hkv, 5, d, device=DEVICE)
    g1, g2 = -torch.rand(b, hq, 5, d, device=DEVICE), -torch.rand(b, hq, 5, d, device=DEVICE) * 3
    gamma = torch.tensor(0.3, device=DEVICE)
    _, state = dsla_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], g1[:, :, :3], g2[:, :, :3], gamma, normalize=True)
    with fused_decode.use_fused(True):  # the layout is chosen where the fused kernels run
        ds = DslaDecodeState.from_state(state, hkv, normalize=True, align=align)
    assert ds.width == d + 1 and ds.states.shape[-1] == -(-(d + 1) // (align or 1)) * (align or 1)
    assert ds.states.is_contiguous() == (align is not None)
    for t in range(3, 5):
        step = slice(t, t + 1)
        want, state = dsla_attention(q[:, :, step], k[:, :, step], v[:, :, step], g1[:, :, step], g2[:, :, step], gamma,
                                     normalize=True, state=state)  # fmt: skip
        decay = torch.stack((g1[:, :, t], g2[:, :, t]), dim=1).exp()  # (B, 2, Hq, Dk)
        with fused_decode.use_fused(fused):
            got = dsla_decode_step(ds, q[:, :, t], k[:, :, t].repeat_interleave(hq // hkv, dim=1), v[:, :, step], decay,
                                   torch.stack((gamma, 1 - gamma)), normalize=True)  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not ds.states[..., d + 1 :].any()
        torch.testing.assert_close(ds.canonical().history, state.history, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ds.canonical().recent, state.recent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@torch.no_grad()
def test_dsla_step_in_a_pool_updates_its_rows_in_place(fused):
    """Batch rows decoding in rows 4, 0 and 2 of a pool of 5 (float32, rows padded from 17 to 20
    columns): each gets what the same step gives on its gathered rows, in the pool's own memory; rows
    1 and 3 and the padding are untouched."""
    torch.manual_seed(3)
    n, b, hq, hkv, d, width = 5, 3, 4, 2, 16, 17
    pool = torch.zeros(2, n, hq, d, 20, device=DEVICE)
    pool[..., :width] = torch.rand(2, n, hq, d, width, device=DEVICE)
    index = torch.tensor([4, 0, 2], device=DEVICE)
    before = pool.clone()
    qf, kf = torch.rand(b, hq, d, device=DEVICE), torch.rand(b, hq, d, device=DEVICE)
    v, decay = torch.randn(b, hkv, 1, d, device=DEVICE), torch.rand(b, 2, hq, d, device=DEVICE)
    weights = torch.tensor([0.3, 0.7], device=DEVICE)
    gathered = DslaDecodeState(before[:, index].contiguous(), torch.zeros(b, hkv, 20, device=DEVICE), width)
    gathered.values[..., d] = 1.0
    in_pool = DslaDecodeState.in_pool(pool, index, hkv, width, normalize=True)
    address = pool.data_ptr()
    with fused_decode.use_fused(fused):
        want = dsla_decode_step(gathered, qf, kf, v, decay, weights, normalize=True)
        got = dsla_decode_step(in_pool, qf, kf, v, decay, weights, normalize=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert pool.data_ptr() == address and in_pool.states is pool
    torch.testing.assert_close(pool[:, index], gathered.states, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[:, [1, 3]], before[:, [1, 3]]) and not pool[..., width:].any()
    torch.testing.assert_close(in_pool.canonical().history, gathered.canonical().history)
    with pytest.raises(ValueError, match="states hold 5 rows for a batch of 3"):
        fused_decode.dsla_state_step(pool, qf, kf, v.view(b, hkv, d), decay, True)
    with pytest.raises(ValueError, match="index must be torch.int64"):
        fused_decode.dsla_state_step(pool, qf, kf, v.view(b, hkv, d), decay, True, index.int())


def test_dsla_state_rows_are_split_until_a_step_fills_the_gpu():
    """A small batch spreads each state's feature rows over more programs (at least 16 rows each);
    a batch that fills the GPU alone keeps one program per head and state. The partial reads add up
    to the read: the fused step tests above run with 1, 2, 4 and 8 splits."""
    assert fused_decode.dsla_splits(1 * 9, 128) == 8  # SmolLM2, batch 1: 144 programs of 16 rows
    assert fused_decode.dsla_splits(1 * 32, 256) == 4  # Llama shape, batch 1: 64 rows each
    assert fused_decode.dsla_splits(8 * 32, 256) == 1
    assert fused_decode.dsla_splits(64 * 9, 128) == 1
    assert fused_decode.dsla_splits(2 * 4, 8) == 1  # never fewer than 16 rows a program
    assert [fused_decode.dsla_splits(2 * 4, f) for f in (37, 70, 128)] == [2, 4, 8]
    partials = torch.arange(12.0).view(3, 2, 1, 1, 2)
    torch.testing.assert_close(fused_decode.dsla_read(partials), partials.sum(0))
    assert fused_decode.dsla_read(partials[:1]).shape == (2, 1, 1, 2)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="align must be a positive number of columns, got 0"):
        DslaDecodeState.from_state(dsla_attention(*(torch.rand(1, 2, 3, 4) for _ in range(5)), torch.tensor(0.5))[1], 2, True, align=0)
    linear = torch.zeros(4, 8, 9)
    with pytest.raises(ValueError, match=r"features must have shape \(2, 3, 16\)"):
        fused_decode.hybrid_linear_step(linear, torch.zeros(2, 3, 8), torch.zeros(2, 3, 9), torch.zeros(4, 8), None, 0)
    with pytest.raises(ValueError, match="contiguous float32"):
        fused_decode.hybrid_linear_step(linear.double(), torch.zeros(2, 3, 16), torch.zeros(2, 3, 9), torch.zeros(4, 8), None, 0)
    states = torch.zeros(2, 1, 2, 4, 5)
    with pytest.raises(ValueError, match="states have 5 columns"):
        fused_decode.dsla_state_step(states, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 1, 5), torch.zeros(1, 2, 2, 4), True)
    q, keys, values, valid = torch.zeros(1, 4, 8), torch.zeros(2, 5, 8), torch.zeros(2, 5, 9), torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"valid must be torch.bool"):
        fused_decode.hybrid_window_read(q, keys, values, valid.float(), torch.zeros(4, 9), torch.ones(4), 0.3, False)
    with pytest.raises(ValueError, match=r"factor must have shape \(4,\)"):
        fused_decode.hybrid_window_read(q, keys, values, valid, torch.zeros(4, 9), torch.ones(2), 0.3, True)
    with pytest.raises(ValueError, match=r"decay must have shape \(1, 2, 2, 4\)"):
        fused_decode.dsla_state_step(states, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 2, 4), True)


def test_use_fused_switches_the_path():
    x = torch.zeros(1, device=DEVICE)
    with fused_decode.use_fused(False):
        assert not fused_decode.enabled(x)
    with fused_decode.use_fused(True):
        assert fused_decode.enabled(x) == (x.is_cuda or fused_decode.interpreting())
    assert fused_decode.enabled(x) == x.is_cuda


@pytest.mark.parametrize("columns", [True, False])
def test_decode_states_are_made_in_the_kernels_layout(columns, monkeypatch):
    """``new_state`` lays a state out column-major where the fused kernels run and COLUMN_STATES is
    on (float32 only), else contiguous; from_state copies the canonical state into it unchanged."""
    monkeypatch.setattr(fused_decode, "COLUMN_STATES", columns)
    like = torch.zeros(1, device=DEVICE)
    with fused_decode.use_fused(True):
        if not fused_decode.enabled(like):
            pytest.skip("the fused kernels do not run here (no GPU, not interpreting)")
        made = fused_decode.new_state((2, 3, 5, 7), like)
        assert made.shape == (2, 3, 5, 7) and made.transpose(-1, -2).is_contiguous() == columns and made.is_contiguous() != columns
        assert fused_decode.new_state((3, 5, 7), like.half()).is_contiguous()  # only float32 states change layout
        torch.manual_seed(0)
        _, state = dsla_attention(torch.rand(2, 4, 3, 8, device=DEVICE), torch.rand(2, 2, 3, 8, device=DEVICE),
                                  torch.randn(2, 2, 3, 8, device=DEVICE), -torch.rand(2, 4, 3, 8, device=DEVICE),
                                  -torch.rand(2, 4, 3, 8, device=DEVICE), torch.tensor(0.3, device=DEVICE), normalize=True)  # fmt: skip
        ds = DslaDecodeState.from_state(state, 2, True)
    assert ds.states.is_contiguous() != columns
    torch.testing.assert_close(ds.states[0, ..., : ds.width], state.history, rtol=0, atol=0)
    torch.testing.assert_close(ds.states[1, ..., : ds.width], state.recent, rtol=0, atol=0)


@torch.no_grad()
def test_custom_ops_pass_torch_library_checks():
    """The custom ops' registrations (in-place mutation, fake tensors for torch.compile) are consistent."""
    linear = torch.randn(4, 8, 9, device=DEVICE)
    args = (linear, torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 3, 9, device=DEVICE), torch.randn(4, 8, device=DEVICE),
            torch.tensor(1, device=DEVICE), 0)  # fmt: skip
    torch.library.opcheck(fused_decode.hybrid_linear_step, args, test_utils=("test_schema", "test_faketensor"))
    states = torch.randn(2, 1, 2, 4, 5, device=DEVICE)
    args = (states, torch.randn(1, 2, 4, device=DEVICE), torch.randn(1, 2, 4, device=DEVICE), torch.randn(1, 1, 4, device=DEVICE),
            torch.rand(1, 2, 2, 4, device=DEVICE), True)  # fmt: skip
    torch.library.opcheck(fused_decode.dsla_state_step, args, test_utils=("test_schema", "test_faketensor"))
    args = (torch.randn(2, 4, 8, device=DEVICE), torch.randn(4, 5, 8, device=DEVICE), torch.randn(4, 5, 9, device=DEVICE),
            torch.ones(2, 5, dtype=torch.bool, device=DEVICE), torch.rand(8, 9, device=DEVICE), torch.rand(4, device=DEVICE), 0.3, False)  # fmt: skip
    torch.library.opcheck(fused_decode.hybrid_window_read, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dsla_state_tiles_are_tuned_per_batch_size():
    """The state kernel's tile is tuned again for a batch in another power-of-2 bucket (the tile best
    at batch 1 is not at 40), and not for one in the same bucket."""
    kernel = fused_decode._kernels().dsla

    def step(b):
        h, dk, dv = 4, 64, 64
        states = torch.zeros(2, b, h, dk, dv + 4, device="cuda")
        x = [torch.randn(b, h, dk, device="cuda") for _ in range(2)]
        fused_decode.dsla_state_step(states, *x, torch.randn(b, h, dv, device="cuda"), torch.rand(b, 2, h, dk, device="cuda"), True)
        return len(kernel.cache)

    tuned = step(1)
    assert step(40) == tuned + 1
    assert step(33) == tuned + 1  # 33 and 40: both in the bucket of 64


def test_state_tiles_are_timed_for_their_layout_only():
    """The state kernels' autotuner times the row-major tiles for a row-major state (SV 1) and the
    column-major tiles for a column-major one; every config where none matches."""
    import triton

    configs = [triton.Config({"BK": bk, "BV": bv}, num_warps=w) for bk, bv, w in dict.fromkeys(fused_decode.STATE_TILES + fused_decode.COLUMN_TILES)]

    def kept(**kwargs):
        return [(c.kwargs["BK"], c.kwargs["BV"], c.num_warps) for c in fused_decode.tiles_for_layout(configs, {}, **kwargs)]

    assert kept(SV=1, V=65) == list(fused_decode.STATE_TILES)
    assert kept(SV=128, V=65) == list(fused_decode.COLUMN_TILES)
    assert len(fused_decode.tiles_for_layout(configs[:1], {}, SV=128)) == 1  # none matches: all kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_hybrid_state_tiles_are_tuned_per_batch_size():
    """The hybrid's state kernel is tuned again for rows in another power-of-2 bucket, and not for
    rows in the same bucket."""
    kernel = fused_decode._kernels().hybrid

    def step(b):
        h, f, dv, w = 4, 64, 64, 8
        linear = torch.zeros(b * h, f, dv + 1, device="cuda")
        features = torch.rand(b, w, f, device="cuda")  # one KV head per row: n_rep = 4
        values = torch.rand(b, w, dv + 1, device="cuda")
        fused_decode.hybrid_linear_step(linear, features.repeat(1, 1, h), values, torch.rand(b * h, f, device="cuda"), None, 3)
        return len(kernel.cache)

    tuned = step(1)
    assert step(40) == tuned + 1
    assert step(33) == tuned + 1  # 132 and 160 rows: both in the bucket of 256


def dsla_inputs_case(seed: int, *, b: int, hidden: int, rank: int, dtype: torch.dtype, down_dtype: torch.dtype, hq: int = 4, hkv: int = 2,
                     d: int = 16, f: int = 16) -> SimpleNamespace:  # fmt: skip
    """Random inputs of ``dsla_decode_inputs``: q (b, hq, d), k (b, hkv, d), x (b, hidden) and both
    Hedgehog maps' weight (2 hq, d, f) and bias in ``dtype``; the gates' down projection (2 rank,
    hidden) in ``down_dtype``; their up projection (2, hq 2f, rank) and its bias in float32."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)

    q, k, x = rand(b, hq, d).to(dtype), rand(b, hkv, d).to(dtype), rand(b, hidden).to(dtype)
    weight, bias = rand(2 * hq, d, f, scale=0.3).to(dtype), rand(2 * hq, 1, f, scale=0.1).to(dtype)
    down = rand(2 * rank, hidden, scale=hidden**-0.5).to(down_dtype)
    up, up_bias = rand(2, hq * 2 * f, rank, scale=0.5), rand(2, hq * 2 * f) - 3
    return SimpleNamespace(q=q, k=k, x=x, weight=weight, bias=bias, down=down, up=up, up_bias=up_bias, b=b, hq=hq, nf=2 * f, hidden=hidden,
                           rank=rank)  # fmt: skip


@pytest.mark.parametrize("parts, down_in_kernel", [(4, True), (1, True), (4, False)], ids=["parts4", "parts1", "parts4-xr-given"])
@pytest.mark.parametrize("batch, rank, dtype", [(3, 8, torch.float32), (19, 16, torch.float32), (3, 8, torch.bfloat16)],
                         ids=["b3-rank8", "b19-rank16", "bf16"])  # fmt: skip
@torch.no_grad()
def test_dsla_decode_inputs_equal_the_torch_maps_and_gates(batch, rank, dtype, parts, down_in_kernel, monkeypatch):
    """One kernel for DSLA's decode inputs: both Hedgehog maps of a token (k's for every query head of
    its KV head) and both gates, against ``hedgehog_pair`` and the low-rank gates in torch; a rank
    padded to 16, a batch over two blocks of rows; in bfloat16 the features rounded as the torch
    form rounds them; each part a program of its own, or all four in one; the gates' down
    projection in the kernel or given (``xr``, as a GEMM before it makes it)."""
    monkeypatch.setattr(fused_decode, "DSLA_INPUT_PARTS", parts)
    from linearize.ops import fused_dsla
    from linearize.ops.dsla import log_gate
    from linearize.ops.feature_maps import hedgehog_pair

    case = dsla_inputs_case(batch + rank, b=batch, hidden=72, rank=rank, dtype=dtype, down_dtype=dtype)
    b, hq, nf, hidden = case.b, case.hq, case.nf, case.hidden
    q, k, x, weight, bias, down, up, up_bias = case.q, case.k, case.x.view(b, 1, hidden), case.weight, case.bias, case.down, case.up, case.up_bias
    u, c = fused_dsla.gate_weights(up, up_bias, rank)
    xr = fused_dsla.gate_inputs(x, down, rank).view(b, 2, -1)
    with fused_decode.use_fused(True):
        assert fused_decode.dsla_inputs_apply(q, weight)
        qf, kf, decay = fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), down, weight, bias, u, c, None if down_in_kernel else xr)
    want_q, want_k = hedgehog_pair(q, k, weight, bias)
    z = torch.einsum("bsr,sor->bso", xr[..., :rank], up.float()) + up_bias.float()
    want_decay = log_gate(z).exp().view(b, 2, hq, nf)
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the projection's sum is rounded at a different point
    torch.testing.assert_close(qf.float(), want_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kf.float(), want_k.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(decay, want_decay, atol=2e-6, rtol=2e-6)
    assert qf.dtype == kf.dtype == weight.dtype and decay.dtype == torch.float32  # the features in the maps' dtype (the default)
    with pytest.raises(ValueError, match=r"x must have shape"):
        fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden)[:, :8], down, weight, bias, u, c)
    with pytest.raises(ValueError, match=r"up must be torch.float32"):
        fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), down, weight, bias, u.double(), c)
    with pytest.raises(ValueError, match=r"xr must have shape"):
        fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), down, weight, bias, u, c, xr[:, :1])
    monkeypatch.setattr(fused_decode, "DSLA_INPUT_PARTS", 3)
    with pytest.raises(ValueError, match=r"DSLA_INPUT_PARTS must be 1 or 4, got 3"):
        fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), down, weight, bias, u, c)


@pytest.mark.parametrize("gate_heads, groups", [(1, 5), (2, 3), (4, 2), (8, 1)])
@torch.no_grad()
def test_dsla_gate_programs_share_the_down_projection_across_heads(gate_heads, groups, monkeypatch):
    """Each gate program computes its rows' down projection once for a group of query heads
    (``DSLA_GATE_HEADS``, split evenly: 5 heads in groups of 1, 2 (the last of one), 3 or 5): every
    grouping gives the gates of a program per head, bitwise, from the float32 weight's bfloat16
    parts and from a given ``xr``."""
    from linearize.ops import fused_dsla

    case = dsla_inputs_case(7, b=19, hidden=200, rank=16, dtype=torch.bfloat16, down_dtype=torch.float32, hq=5, hkv=1)
    b, hidden = case.b, case.hidden
    u, c = fused_dsla.gate_weights(case.up, case.up_bias, case.rank)
    xr = fused_dsla.gate_inputs(case.x.view(b, 1, hidden), case.down, case.rank).view(b, 2, -1)
    split = fused_decode.bf16_parts(case.down)
    runs = {}
    for heads in (1, gate_heads):
        monkeypatch.setattr(fused_decode, "DSLA_GATE_HEADS", heads)
        assert -(-case.hq // fused_decode.dsla_gate_heads(case.hq)) == (5 if heads == 1 else groups)
        with fused_decode.use_fused(True):
            runs[heads] = [fused_decode.dsla_decode_inputs(case.q, case.k, case.x, split, case.weight, case.bias, u, c),
                           fused_decode.dsla_decode_inputs(case.q, case.k, case.x, case.down, case.weight, case.bias, u, c, xr)]  # fmt: skip
    for one, grouped in zip(runs[1], runs[gate_heads], strict=True):
        for want, got in zip(one, grouped, strict=True):
            assert torch.equal(want, got)
    monkeypatch.setattr(fused_decode, "DSLA_INPUT_PARTS", 1)
    assert fused_decode.dsla_gate_heads(case.hq) == 1
    for bad in (0, 2.0, True):
        monkeypatch.setattr(fused_decode, "DSLA_GATE_HEADS", bad)
        with pytest.raises(ValueError, match=rf"DSLA_GATE_HEADS must be an integer >= 1, got {bad!r}"):
            fused_decode.dsla_gate_heads(case.hq)


@pytest.mark.parametrize("parts", [4, 1], ids=["parts4", "parts1"])
@torch.no_grad()
def test_gates_down_projection_from_bf16_parts_is_the_float32_one(parts, monkeypatch):
    """A bfloat16 model's float32 gate weights: three bfloat16 parts sum to the weight exactly, and
    the inputs kernel's down projection from them (tensor-core products of a bfloat16 x) gives the
    gates of the float32 projection (``fused_dsla.gate_inputs``); the parts take a bfloat16 x and
    no ``xr``."""
    monkeypatch.setattr(fused_decode, "DSLA_INPUT_PARTS", parts)
    from linearize.ops import fused_dsla
    from linearize.ops.dsla import log_gate

    case = dsla_inputs_case(5, b=19, hidden=200, rank=16, dtype=torch.bfloat16, down_dtype=torch.float32)
    b, hq, nf, hidden, rank = case.b, case.hq, case.nf, case.hidden, case.rank
    q, k, x, weight, bias, down, up, up_bias = case.q, case.k, case.x.view(b, 1, hidden), case.weight, case.bias, case.down, case.up, case.up_bias
    split = fused_decode.bf16_parts(down)
    assert split.shape == (3, 2 * rank, hidden) and split.dtype == torch.bfloat16
    assert torch.equal(split.float().sum(0), down)  # all 24 bits
    assert not torch.equal(split[0].float(), down)  # (one part would round)
    u, c = fused_dsla.gate_weights(up, up_bias, rank)
    xr = fused_dsla.gate_inputs(x, down, rank).view(b, 2, -1)  # float32, as the GEMM before the kernel makes it
    with fused_decode.use_fused(True):
        _, _, decay = fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), split, weight, bias, u, c)
        _, _, given = fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), down, weight, bias, u, c, xr)
        with pytest.raises(ValueError, match=r"down as bfloat16 parts takes a bfloat16 x and no xr, got x torch.bfloat16 and xr"):
            fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden), split, weight, bias, u, c, xr)
        with pytest.raises(ValueError, match=r"got x torch.float32"):
            fused_decode.dsla_decode_inputs(q, k, x.view(b, hidden).float(), split, weight, bias, u, c)
    z = torch.einsum("bsr,sor->bso", xr[..., :rank], up.float()) + up_bias.float()
    want = log_gate(z).exp().view(b, 2, hq, nf)
    torch.testing.assert_close(decay, want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(decay, given, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match=r"bf16_parts takes a float32 weight, got torch.bfloat16"):
        fused_decode.bf16_parts(down.bfloat16())


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("normalize, dtype", [(True, torch.bfloat16), (True, torch.float32), (False, torch.float32)],
                         ids=["normalised-bf16", "normalised-fp32", "raw-fp32"])  # fmt: skip
@torch.no_grad()
def test_dsla_mix_equals_the_elementwise_mix(splits, normalize, dtype):
    """DSLA's decode output in one kernel (``dsla_mix``): the state reads' partial sums added, each
    divided by its normaliser (0 where it is empty, as for a row with no keys yet), mixed by the
    layer's weights and rounded to the output's dtype: the numbers of ``dsla_read`` and the
    elementwise mix (``ops.dsla._mix_reads``), with padded columns past the normaliser ignored."""
    from linearize.ops.dsla import _mix_reads

    b, hq, dv, width = 5, 3, 24, 32  # columns past dv + 1: the rows' alignment padding
    gen = torch.Generator().manual_seed(splits)
    partials = torch.rand(splits, 2, b, hq, width, generator=gen).to(DEVICE)
    partials[:, 0, 1, 2, dv] = 0.0  # an empty normaliser in the history read
    weights = torch.tensor([0.3, 0.7], device=DEVICE)
    with fused_decode.use_fused(True):
        got = fused_decode.dsla_mix(partials, weights, dv, normalize, dtype)
        with pytest.raises(ValueError, match=r"partials have 32 columns; 40 values and the normaliser need 41"):
            fused_decode.dsla_mix(partials, weights, 40, True, dtype)
        with pytest.raises(ValueError, match=r"weights must have shape \(2,\)"):
            fused_decode.dsla_mix(partials, weights[:1], dv, normalize, dtype)
    o = fused_decode.dsla_read(partials).view(2, b, hq, 1, width)
    want = _mix_reads(o, weights.view(2, 1, 1, 1, 1), dv, normalize).to(dtype).view(b, hq, dv)
    assert got.shape == (b, hq, dv) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if normalize:  # the empty history read counted as 0: the recent read's share alone
        recent = o[1, 1, 2, 0]
        torch.testing.assert_close(got[1, 2], (recent[:dv] * (0.7 / recent[dv])).to(dtype), atol=tol, rtol=tol)


@pytest.mark.parametrize("shared", [False, True], ids=["per-row", "one-position"])
@torch.no_grad()
def test_dsla_decode_inputs_rotate_q_and_k_by_rope(shared):
    """Given the token's cos and sin, the inputs kernel takes q and k before RoPE and rotates them
    itself: the features of the kernel given ``ops.rope.rope``'s q and k (exactly in Triton's
    interpreter, which contracts no products; to a unit of bfloat16 rounding on a GPU), gates
    unchanged; cos and sin per row or one for all rows; bad shapes named."""
    from linearize.ops import fused_dsla
    from linearize.ops.rope import rope

    case = dsla_inputs_case(13, b=19, hidden=64, rank=16, dtype=torch.bfloat16, down_dtype=torch.float32, hq=4, hkv=2, d=32)
    b, d = case.b, 32
    u, c = fused_dsla.gate_weights(case.up, case.up_bias, case.rank)
    gen = torch.Generator().manual_seed(3)
    angle = torch.rand(1 if shared else b, 1, d // 2, generator=gen).mul(40.0).repeat(1, 1, 2)
    cos, sin = angle.cos().to(DEVICE, torch.bfloat16), angle.sin().to(DEVICE, torch.bfloat16)
    parts = fused_decode.bf16_parts(case.down)
    with fused_decode.use_fused(True):
        q_rot, k_rot = (rope(t.unsqueeze(2), cos, sin).squeeze(2) for t in (case.q, case.k))
        want = fused_decode.dsla_decode_inputs(q_rot, k_rot, case.x, parts, case.weight, case.bias, u, c)
        got = fused_decode.dsla_decode_inputs(case.q, case.k, case.x, parts, case.weight, case.bias, u, c, cos=cos[:, 0], sin=sin[:, 0])
        plain = fused_decode.dsla_decode_inputs(case.q, case.k, case.x, parts, case.weight, case.bias, u, c)
        with pytest.raises(ValueError, match=r"cos and sin come together"):
            fused_decode.dsla_decode_inputs(case.q, case.k, case.x, parts, case.weight, case.bias, u, c, cos=cos[:, 0])
        with pytest.raises(ValueError, match=rf"sin must be \({b} or 1, {d}\) torch.bfloat16"):
            fused_decode.dsla_decode_inputs(case.q, case.k, case.x, parts, case.weight, case.bias, u, c, cos=cos[:, 0], sin=sin[:, 0, :8])
    assert not torch.equal(plain[0], want[0])  # RoPE moved the features
    assert torch.equal(got[2], want[2])
    for w, g in zip(want[:2], got[:2], strict=True):
        if fused_decode.interpreting():
            assert torch.equal(w, g)
        else:
            torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("steps, splits", [(1, 4), (2, 2), (4, 1)])
@torch.no_grad()
def test_gates_down_projection_split_over_the_hidden_size(steps, splits, monkeypatch):
    """From ``DSLA_DOWN_SPLIT_ROWS`` rows the gates' down projection runs in a kernel of its own,
    split over the hidden size (200 units in slices of ``DSLA_DOWN_STEPS`` x 64: 4, 2 or 1 partial
    sums): the partials add up to the float32 projection (zero past the rank), and the gates and
    features equal those of the gate programs' own loop; below the threshold nothing is split."""
    from linearize.ops import fused_dsla

    case = dsla_inputs_case(11, b=19, hidden=200, rank=12, dtype=torch.bfloat16, down_dtype=torch.float32, hq=4, hkv=2)
    b, hidden, rank = case.b, case.hidden, case.rank
    u, c = fused_dsla.gate_weights(case.up, case.up_bias, rank)
    parts = fused_decode.bf16_parts(case.down)
    want_xr = fused_dsla.gate_inputs(case.x.view(b, 1, hidden), case.down, rank).view(b, 2, -1)
    monkeypatch.setattr(fused_decode, "DSLA_DOWN_STEPS", steps)
    runs = {}
    for threshold in (None, 1):
        monkeypatch.setattr(fused_decode, "DSLA_DOWN_SPLIT_ROWS", threshold)
        assert fused_decode.dsla_down_splits(b, hidden) == (0 if threshold is None else splits)
        with fused_decode.use_fused(True):
            runs[threshold] = fused_decode.dsla_decode_inputs(case.q, case.k, case.x, parts, case.weight, case.bias, u, c)
            if threshold:
                partial = fused_decode.dsla_gate_down(case.x, parts, u.shape[1], splits)
    assert partial.shape == (splits, b, 2, 16) and partial.dtype == torch.float32
    assert torch.equal(partial[..., rank:], torch.zeros_like(partial[..., rank:]))
    torch.testing.assert_close(partial.sum(0), want_xr, atol=1e-6, rtol=1e-5)
    (q0, k0, d0), (q1, k1, d1) = runs[None], runs[1]
    assert torch.equal(q0, q1) and torch.equal(k0, k1)  # the maps' programs are untouched
    torch.testing.assert_close(d1, d0, atol=2e-6, rtol=2e-6)
    monkeypatch.setattr(fused_decode, "DSLA_DOWN_SPLIT_ROWS", 20)
    assert fused_decode.dsla_down_splits(b, hidden) == 0
    for name, bad, valid in (("DSLA_DOWN_SPLIT_ROWS", 0, "an integer >= 1 or None"), ("DSLA_DOWN_SPLIT_ROWS", True, "an integer >= 1 or None"),
                             ("DSLA_DOWN_STEPS", 0, "an integer >= 1"), ("DSLA_DOWN_STEPS", 2.0, "an integer >= 1")):  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(fused_decode, name, bad)
            with pytest.raises(ValueError, match=rf"fused_decode.{name} must be {valid}, got {bad!r}"):
                fused_decode.dsla_down_splits(b, hidden)


@torch.no_grad()
def test_dsla_decode_inputs_write_features_in_the_maps_dtype(monkeypatch):
    """With ``DSLA_FEATURES_IN_MAPS_DTYPE`` the inputs kernel writes a bfloat16 model's query and key
    features in bfloat16, the same numbers as the float32 ones (they are rounded through the maps'
    dtype either way); the gates stay float32."""
    from linearize.ops import fused_dsla

    case = dsla_inputs_case(6, b=5, hidden=40, rank=16, dtype=torch.bfloat16, down_dtype=torch.float32)
    q, k, x, weight, bias, down = case.q, case.k, case.x, case.weight, case.bias, case.down
    u, c = fused_dsla.gate_weights(case.up, case.up_bias, case.rank)
    runs = []
    for narrow in (False, True):
        monkeypatch.setattr(fused_decode, "DSLA_FEATURES_IN_MAPS_DTYPE", narrow)
        with fused_decode.use_fused(True):
            runs.append(fused_decode.dsla_decode_inputs(q, k, x, fused_decode.bf16_parts(down), weight, bias, u, c))
    (qf, kf, decay), (qn, kn, dn) = runs
    assert qn.dtype == kn.dtype == torch.bfloat16 and dn.dtype == qf.dtype == torch.float32
    assert torch.equal(qn.float(), qf) and torch.equal(kn.float(), kf) and torch.equal(dn, decay)


def test_autotuned_choices_report_what_the_autotuner_chose(monkeypatch):
    """A kernel tuned through ``fused_decode.autotune`` is recorded, and ``autotuned_choices`` gives
    its key, the key's dtypes and the chosen config (meta-parameters, warps, stages, register cap),
    one entry per key; before a launch it has none. Timed by the wall clock here (in Triton's
    interpreter there is no GPU benchmarker), the fastest of two real runs."""
    import time

    import triton
    import triton.language as tl

    if not (fused_decode.interpreting() or torch.cuda.is_available()):
        pytest.skip("runs Triton kernels on CUDA or in Triton's interpreter")
    monkeypatch.setattr(fused_decode, "_AUTOTUNERS", [])

    def wall(fn, quantiles=None, **_):
        t = time.perf_counter()
        fn()
        t = (time.perf_counter() - t) * 1e3
        return [t, t, t] if quantiles else t

    configs = [triton.Config({"B": 16}, num_warps=4, num_stages=1), triton.Config({"B": 32}, num_warps=8, num_stages=2, maxnreg=128)]

    @fused_decode.autotune(configs, key=["N"], restore_value=["x"], do_bench=wall)
    @triton.jit
    def add_one(x, N, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(x + i, tl.load(x + i, mask=i < N) + 1, mask=i < N)

    assert fused_decode.autotuned_choices() == []
    for n in (64, 40, 64):
        x = torch.zeros(n, device=DEVICE)
        add_one[lambda m, n=n: (triton.cdiv(n, m["B"]),)](x, n)
        assert torch.equal(x, torch.ones_like(x))  # the trials' writes restored, then one real run
    choices = fused_decode.autotuned_choices()
    assert [(c["kernel"], c["key"], c["dtypes"]) for c in choices] == [("add_one", {"N": 64}, ["torch.float32"]),
                                                                        ("add_one", {"N": 40}, ["torch.float32"])]  # fmt: skip
    allowed = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages, "maxnreg": c.maxnreg} for c in configs]
    assert all(c["config"] in allowed for c in choices)

"""The fused CPU decode kernels against the reference ops: outputs token by token and final states,
from empty and from prefilled (left-padded) states; the setting that turns them off; the build cache."""

from __future__ import annotations

import itertools
import logging
import shutil

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from linearize.ops import cpu_kernels
from linearize.ops.common import repeat_kv
from linearize.ops.dsla import DslaDecodeState, log_gate
from linearize.ops.feature_maps import hedgehog_reference
from linearize.ops.hybrid import HybridDecodeState, hybrid_state_empty
from linearize.ops.naive import dsla_attention_reference, hybrid_attention_reference
from linearize.ops.states import DslaState

COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module")
def lib():
    if cpu_kernels.setting() == "off":
        pytest.skip(f"{cpu_kernels.ENV}=off")
    built = cpu_kernels.library()
    if built is None:
        assert not COMPILER, "a C compiler is installed but the CPU kernels did not build (see the logged warning)"
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    return built


def rope_tables(b: int, t: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (B, T, D) of random angles, halves repeated as transformers builds them."""
    angles = torch.rand(b, t, d // 2, generator=gen) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def hedgehog_maps(heads: int, d: int, half: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(wq, bq, wk, bk): two Hedgehog maps (H, D, half), (H, half)."""
    return tuple(torch.randn(*shape, generator=gen) * 0.5 for shape in ((heads, d, half), (heads, half)) * 2)


def heads_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H D) -> (B, H, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, heads, -1).transpose(1, 2)


# ----------------------------------------------------------------------------- DSLA

DSLA_CASES = [  # (B, Hq, Hkv, D, rank, hidden, normalize, rope)
    (2, 4, 2, 8, 3, 12, True, False),
    (1, 3, 1, 8, 2, 10, True, True),
    (2, 4, 4, 6, 3, 12, False, True),  # identity map: raw q, k, no normaliser
]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch):
    """The kernels on one thread, or on two however small the state (their work split and barriers)."""
    if request.param > 1:
        monkeypatch.setattr(cpu_kernels, "GRAIN", 0)
        teams = cpu_kernels.Teams()
        monkeypatch.setattr(teams, "observe", lambda *args: None)  # a slow call on a busy machine keeps the team
        monkeypatch.setattr(cpu_kernels, "teams", teams)
        before = torch.get_num_threads()
        torch.set_num_threads(request.param)
        yield request.param
        torch.set_num_threads(before)
    else:
        yield 1


@pytest.mark.parametrize("case", DSLA_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-D{}-R{}-H{}-{}-{}".format(
    *c[:6], "normalized" if c[6] else "identity", "rope" if c[7] else "nope"))  # fmt: skip
@pytest.mark.parametrize("start", ["empty", "state"])
def test_dsla_kernel_matches_reference_outputs_and_states(lib, case, start, threads):
    b, hq, hkv, d, rank, hidden, normalize, rope = case
    t, f = 7, (2 * d if normalize else d)
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    x = torch.randn(b, t, hidden, generator=gen)
    q, k, v = (torch.randn(b, t, h * d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = rope_tables(b, t, d, gen)
    wq, bq, wk, bk = hedgehog_maps(hq, d, d, gen)
    down = torch.randn(2 * rank, hidden, generator=gen) * 0.5
    up = torch.randn(2, hq * f, rank, generator=gen)
    up_bias = torch.randn(2, hq * f, generator=gen) * 3
    up_bias[1, ::5] = -150.0  # gates far below float32's sigmoid range: alpha = exp(z / 16)
    gamma = torch.tensor(0.3)
    scale = 1.0 if normalize else d**-0.5
    width = d + normalize
    init = DslaState(*(torch.rand(b, hq, f, width, generator=gen) for _ in range(2))) if start == "state" else \
        DslaState(*(torch.zeros(b, hq, f, width) for _ in range(2)))  # fmt: skip

    qh, kh, vh = heads_view(q, hq), heads_view(k, hkv), heads_view(v, hkv)
    if rope:
        qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
    kh, vh = repeat_kv(kh, hq // hkv), repeat_kv(vh, hq // hkv)
    if normalize:
        qh, kh = hedgehog_reference(qh, wq, bq), hedgehog_reference(kh, wk, bk)
    gates = [heads_view(log_gate(x @ down[s * rank : (s + 1) * rank].T @ up[s].T + up_bias[s]), hq) for s in (0, 1)]
    ref, ref_state = dsla_attention_reference(qh, kh, vh, *gates, gamma, state=init.clone(), scale=scale, normalize=normalize)

    weights = cpu_kernels.Weights(down=down, up=up.transpose(1, 2).contiguous(), up_bias=up_bias, mix=torch.stack((gamma, 1 - gamma)) * scale,
                                  **({"wq": wq, "bq": bq, "wk": wk, "bk": bk} if normalize else {}))  # fmt: skip
    state = DslaDecodeState.from_state(init, hkv, normalize)
    outs = [cpu_kernels.dsla_step(lib, state, x[:, i : i + 1].contiguous(), *(y[:, i : i + 1].contiguous() for y in (q, k, v)),
                                  weights, heads=hq, kv_heads=hkv, head_dim=d, normalize=normalize,
                                  rope=(cos[:, i : i + 1].contiguous(), sin[:, i : i + 1].contiguous()) if rope else None)
            for i in range(t)]  # fmt: skip
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, atol=2e-5, rtol=2e-5)
    for got, want in zip(state.canonical().tensors(), ref_state.tensors(), strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- hybrid

HYBRID_MODES = list(itertools.product(["joint", "gate"], [False, True], ["both", "window", "linear"]))


@pytest.mark.parametrize("mode", HYBRID_MODES, ids=lambda m: f"{m[0]}-{'overlap' if m[1] else 'nooverlap'}-{m[2]}")
@pytest.mark.parametrize("linear_rope", [True, False], ids=["rope", "nope"])
def test_hybrid_kernel_matches_reference_outputs_and_states(lib, mode, linear_rope, threads):
    """Token by token from an empty state, past the window, B = 2 with GQA: the reference's outputs
    at every token and its state after the last (the window's slots and the linear sums)."""
    mix, overlap, branches = mode
    b, hq, hkv, d, window, t = 2, 4, 2, 8, 3, 9
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, t, h * d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = rope_tables(b, t, d, gen)
    wq, bq, wk, bk = hedgehog_maps(hq, d, d // 2, gen)
    factor = torch.rand(hq, generator=gen) * 0.8 + 0.1

    qh, kh, vh = heads_view(q, hq), heads_view(k, hkv), heads_view(v, hkv)
    qr, kr = apply_rotary_pos_emb(qh, kh, cos, sin)
    linear = {} if linear_rope else {"q_lin": qh, "k_lin": kh}
    ref, ref_state = hybrid_attention_reference(
        qr, kr, vh, phi_q=lambda y: hedgehog_reference(y, wq, bq), phi_k=lambda y: hedgehog_reference(y, wk, bk),
        window=window, mix=mix, overlap=overlap, branches=branches, scale=d**-0.5,
        **({"window_factor": factor} if mix == "joint" else {"gate": factor}), **linear)  # fmt: skip

    empty = hybrid_state_empty(b, hkv, hq, window, d, d, d, linear_keys=not linear_rope)
    state = HybridDecodeState.from_state(empty, lambda y: hedgehog_reference(y, wk, bk), hq)
    weights = cpu_kernels.Weights(wq=wq, bq=bq, wk=wk, bk=bk, factor=factor)
    outs = [cpu_kernels.hybrid_step(lib, state, *(y[:, i : i + 1].contiguous() for y in (q, k, v)),
                                    (cos[:, i : i + 1].contiguous(), sin[:, i : i + 1].contiguous()), weights,
                                    heads=hq, kv_heads=hkv, mix=mix, overlap=overlap, branches=branches, scale=d**-0.5,
                                    linear_rope=linear_rope)
            for i in range(t)]  # fmt: skip
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, atol=2e-5, rtol=2e-5)
    got = state.canonical()
    torch.testing.assert_close(got.window.valid, ref_state.window.valid)
    torch.testing.assert_close(got.window.positions, ref_state.window.positions)
    for name in ("keys", "values") + (() if linear_rope else ("linear_keys",)):
        torch.testing.assert_close(getattr(got.window, name), getattr(ref_state.window, name), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.linear.kv, ref_state.linear.kv, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.linear.k_sum, ref_state.linear.k_sum, atol=2e-5, rtol=2e-5)


def test_hybrid_kernel_continues_a_left_padded_prefill(lib):
    """From the reference's state after a left-padded prefill (rows of different lengths, a window
    not yet full in one of them) with positions broadcast over the batch (cos/sin (1, 1, D)): the
    reference's outputs of the whole sequence at the decoded tokens."""
    b, hq, hkv, d, window, t, prefill = 2, 4, 2, 8, 4, 10, 5
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, t, h * d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = rope_tables(1, t, d, gen)
    wq, bq, wk, bk = hedgehog_maps(hq, d, d // 2, gen)
    factor = torch.rand(hq, generator=gen)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False  # row 1: 2 real tokens before decoding, fewer than the window

    qh, kh, vh = heads_view(q, hq), heads_view(k, hkv), heads_view(v, hkv)
    qr, kr = apply_rotary_pos_emb(qh, kh, cos, sin)  # positions shared by both rows (padding is masked anyway)
    maps = {"phi_q": lambda y: hedgehog_reference(y, wq, bq), "phi_k": lambda y: hedgehog_reference(y, wk, bk)}
    args = {"window": window, "window_factor": factor, "scale": d**-0.5, **maps}
    ref, _ = hybrid_attention_reference(qr, kr, vh, valid=valid, **args)
    _, prefilled = hybrid_attention_reference(qr[:, :, :prefill], kr[:, :, :prefill], vh[:, :, :prefill],
                                              valid=valid[:, :prefill], **args)  # fmt: skip
    state = HybridDecodeState.from_state(prefilled, maps["phi_k"], hq)
    weights = cpu_kernels.Weights(wq=wq, bq=bq, wk=wk, bk=bk, factor=factor)
    outs = [cpu_kernels.hybrid_step(lib, state, *(y[:, i : i + 1].contiguous() for y in (q, k, v)),
                                    (cos[:, i : i + 1].contiguous(), sin[:, i : i + 1].contiguous()), weights,
                                    heads=hq, kv_heads=hkv, scale=d**-0.5)
            for i in range(prefill, t)]  # fmt: skip
    torch.testing.assert_close(torch.cat(outs, dim=2), ref[:, :, prefill:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["dsla", "hybrid"])
def test_weights_that_bfloat16_holds_exactly_are_read_as_bfloat16_with_the_same_results(lib, kind):
    """Weight matrices whose values bfloat16 holds exactly (trained or stored in bfloat16) are kept in
    bfloat16 (half the bytes): the outputs and states of the same weights in float32 (to rounding:
    the compiler may fuse a multiply-add in one loop and not in the other)."""
    b, hq, hkv, d, rank, hidden, t = 2, 4, 2, 8, 3, 12, 5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(b, t, hidden, generator=gen)
    q, k, v = (torch.randn(b, t, h * d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = rope_tables(b, t, d, gen)
    maps = dict(zip(("wq", "bq", "wk", "bk"), (w.bfloat16().float() for w in hedgehog_maps(hq, d, d, gen))))
    if kind == "dsla":
        extra = {"down": torch.randn(2 * rank, hidden, generator=gen).bfloat16().float(),
                 "up": torch.randn(2, rank, hq * 2 * d, generator=gen).bfloat16().float(),
                 "up_bias": torch.randn(2, hq * 2 * d, generator=gen), "mix": torch.tensor([0.3, 0.7])}  # fmt: skip
    else:
        extra = {"factor": torch.rand(hq, generator=gen)}
    results = []
    for compact in (True, False):
        weights = cpu_kernels.Weights(compact=compact, **maps, **extra)
        assert weights.bf16 == compact and (weights.tensors["wq"].dtype == torch.bfloat16) == compact
        if kind == "dsla":
            state = DslaDecodeState.from_state(DslaState(torch.zeros(b, hq, 2 * d, d + 1), torch.zeros(b, hq, 2 * d, d + 1)), hkv, True)
            outs = [cpu_kernels.dsla_step(lib, state, x[:, i : i + 1].contiguous(), *(y[:, i : i + 1].contiguous() for y in (q, k, v)),
                                          weights, heads=hq, kv_heads=hkv, head_dim=d, normalize=True) for i in range(t)]  # fmt: skip
        else:
            empty = hybrid_state_empty(b, hkv, hq, 3, d, d, 2 * d)
            state = HybridDecodeState.from_state(empty, lambda y: hedgehog_reference(y, maps["wk"], maps["bk"]), hq)
            outs = [cpu_kernels.hybrid_step(lib, state, *(y[:, i : i + 1].contiguous() for y in (q, k, v)),
                                            (cos[:, i : i + 1].contiguous(), sin[:, i : i + 1].contiguous()), weights,
                                            heads=hq, kv_heads=hkv, scale=d**-0.5) for i in range(t)]  # fmt: skip
        results.append((torch.cat(outs, dim=2), state.canonical().tensors()))
    (out_a, states_a), (out_b, states_b) = results
    torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=1e-6)
    for got, want in zip(states_a, states_b, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_team_calls_that_keep_stalling_turn_teams_off_for_a_while(monkeypatch):
    """Team calls are timed against the fastest of their kernel and size: one slow call is noise;
    calls that stay slow (another process holding a core) turn teams off for the backoff, doubling
    while they keep stalling."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    teams = cpu_kernels.Teams()
    big, key = 10 * cpu_kernels.GRAIN, ("dsla", 10 * cpu_kernels.GRAIN)
    assert teams.threads(cpu_kernels.GRAIN - 1, 0.0) == 1  # too little work for a team
    assert teams.threads(big, 0.0) == 2
    for seconds in (200e-6, 100e-6, 100e-6, 2e-3, 100e-6):  # one slow call among fast ones
        teams.observe(key, seconds, 0.0)
    assert teams.fastest[key] == 100e-6 and teams.threads(big, 1.0) == 2
    teams.observe(key, 20e-3, 1.0)  # slow calls, one after another
    assert teams.threads(big, 1.5) == 1 and teams.threads(big, 3.1) == 2
    teams.observe(key, 20e-3, 3.1)  # still stalling: twice the backoff
    assert teams.threads(big, 7.0) == 1 and teams.threads(big, 7.2) == 2
    teams.observe(key, 110e-6, 7.2)  # a fast team call resets the backoff
    assert teams.backoff_s == cpu_kernels.Teams.BACKOFF_S


def test_kernel_calls_check_what_the_kernel_reads(lib):
    """A missing weight, a weight or token of the wrong size, or a state of another dtype is a
    ValueError naming it, before the kernel reads anything."""
    b, hq, hkv, d, rank, hidden = 1, 2, 1, 4, 2, 6
    x, q, k, v = torch.randn(b, 1, hidden), torch.randn(b, 1, hq * d), torch.randn(b, 1, hkv * d), torch.randn(b, 1, hkv * d)
    gates = {"down": torch.randn(2 * rank, hidden), "up": torch.randn(2, rank, hq * d), "up_bias": torch.randn(2, hq * d)}

    def step(weights, q=q, dtype=torch.float32):
        zeros = torch.zeros(b, hq, d, d, dtype=dtype)
        state = DslaDecodeState.from_state(DslaState(zeros, zeros.clone()), hkv, False)
        return cpu_kernels.dsla_step(lib, state, x, q, k, v, weights, heads=hq, kv_heads=hkv, head_dim=d, normalize=False)

    with pytest.raises(ValueError, match="mix is missing"):
        step(cpu_kernels.Weights(**gates))
    with pytest.raises(ValueError, match="up_bias has 6 elements"):
        step(cpu_kernels.Weights(**{**gates, "up_bias": torch.randn(6)}, mix=torch.ones(2)))
    with pytest.raises(ValueError, match="are not the expected"):
        step(cpu_kernels.Weights(**gates, mix=torch.ones(2), factor=torch.ones(hq)))
    with pytest.raises(ValueError, match="q has 4 elements"):
        step(cpu_kernels.Weights(**gates, mix=torch.ones(2)), q=torch.randn(b, 1, d))
    with pytest.raises(ValueError, match="contiguous float32"):
        step(cpu_kernels.Weights(**gates, mix=torch.ones(2)), dtype=torch.float64)
    assert step(cpu_kernels.Weights(**gates, mix=torch.ones(2))).shape == (b, hq, 1, d)


# ----------------------------------------------------------------------------- setting and build


def test_setting_values_and_bad_value(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    assert cpu_kernels.setting() == "auto"
    monkeypatch.setenv(cpu_kernels.ENV, " OFF ")
    assert cpu_kernels.setting() == "off"
    assert cpu_kernels.library() is None
    monkeypatch.setenv(cpu_kernels.ENV, "fast")
    with pytest.raises(ValueError, match="LINEARIZE_CPU_KERNELS='fast'.*auto, on, off"):
        cpu_kernels.setting()


def test_disabled_block_turns_the_kernels_off(lib):
    with cpu_kernels.disabled():
        assert cpu_kernels.library() is None
    assert cpu_kernels.library() is lib


def test_missing_compiler_falls_back_with_auto_and_raises_with_on(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.logger.name):
        assert cpu_kernels.library() is None
    assert "no-such-cc" in caplog.text
    monkeypatch.setenv(cpu_kernels.ENV, "on")
    with pytest.raises(RuntimeError, match="LINEARIZE_CPU_KERNELS=on.*no-such-cc"):
        cpu_kernels.library()


@pytest.mark.skipif(not COMPILER, reason="no C compiler")
def test_build_is_cached_per_source_and_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    path = cpu_kernels._build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    built = path.stat().st_mtime_ns
    assert cpu_kernels._build() == path and path.stat().st_mtime_ns == built  # the second call compiles nothing
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert cpu_kernels._open(path).linearize_abi_version() == cpu_kernels.ABI_VERSION

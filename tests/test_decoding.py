"""Static-buffer decoding (``StaticDecoder``): every step equals the model's forward on the whole sequence."""

from __future__ import annotations

import pytest
import torch

from linearize.decoding import StaticDecoder, static_decoding_supported
from linearize.layers import dsla as dsla_layers
from linearize.ops import cpu_kernels, fused_decode, fused_dsla, fused_lola, fused_prefill
from linearize.ops.hybrid import HybridDecodeState, hybrid_attention, hybrid_decode_step
from linearize.ops.lola import LolaDecodeState, lola_attention, lola_decode_step
from linearize.ops.states import DecodeClock

from .test_model import VARIANTS, convert, tiny

STATIC = ["softmax", "hybrid-joint", "hybrid-joint-overlap", "hybrid-gate", "hybrid-nope", "hybrid-nope-la_only", "hybrid-swa_only",
          "dsla", "dsla-partial", "dsla-nope", "dsla-recent_only", "lola", "lola-no_state", "lola-nope-sinks-weight", "lola-nope-s0-C3",
          "lola-nope-memory"]


def _model(name: str | None):
    if name is None:
        return tiny()
    spec, mode = VARIANTS[name]
    return convert(tiny(), spec, mode)


def _prefill_and_step(decoder: StaticDecoder, prompt, steps: int) -> tuple[list, list]:
    """The prefill's token and logits, then ``steps`` static steps': (tokens, logits), one per call."""
    tokens, logits = [decoder.prefill(prompt)], [decoder.logits.clone()]
    for _ in range(steps):
        tokens.append(decoder.step())
        logits.append(decoder.logits.clone())
    return tokens, logits


def _lola_torch_and_fused_decoders():
    """The tiny LoLA model decoding 6 tokens after a 5-token prompt (2 rows) without graphs, with the
    torch steps and with the fused kernels: (model, [(tokens, logits, decoder)] torch first)."""
    model = _model("lola-nope-sinks-weight")
    prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    runs = []
    for fused in (False, True):
        decoder = StaticDecoder(model, batch_size=2, max_length=14, graphs=False)
        with fused_decode.use_fused(fused):
            tokens, logits = _prefill_and_step(decoder, prompt, 6)
        runs.append((torch.stack(tokens, dim=1), torch.stack(logits, dim=1), decoder))
    return model, runs


@pytest.mark.parametrize("name", [None, *STATIC], ids=["teacher", *STATIC])
@pytest.mark.parametrize("rows", [1, 3], ids=["one-row", "three-rows"])
@torch.no_grad()
def test_static_decoding_matches_full_forward(name, rows):
    """Prefill, then 9 static steps (past the 4-token windows): each step's logits equal the full
    forward's at that position, and the tokens are its greedy choices. LoLA to 1e-3: this model's
    greedy tokens repeat, and a repeated token's self-recall errors tie but for rounding, which
    products of other shapes (the chunked op's, another machine's) may break either way
    (tests/ops/test_fused_lola.py checks the steps against each other on distinct tokens)."""
    model = _model(name)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (rows, 7), generator=gen)
    decoder = StaticDecoder(model, batch_size=3, max_length=20)
    tokens, logits = _prefill_and_step(decoder, prompt, 9)
    seq = torch.cat([prompt.expand(3, -1), torch.stack(tokens[:-1], dim=1)], dim=1)  # (3, 16): every token fed
    full = model(seq).logits[:, prompt.shape[1] - 1 :]  # (3, 10): the logits each new token came from
    tol = 1e-3 if name and name.startswith("lola") else 2e-5
    torch.testing.assert_close(torch.stack(logits, dim=1), full, atol=tol, rtol=tol)
    assert torch.equal(torch.stack(tokens, dim=1), full.argmax(dim=-1))
    assert decoder.length == 16
    hybrid = [m.decode_state for m in decoder.memory if isinstance(getattr(m, "decode_state", None), HybridDecodeState)]
    assert all(s.clock is decoder.clock and s.count is None for s in hybrid)  # the hybrid layers count on the decoder's clock
    assert decoder.clock.now() == 9


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@pytest.mark.parametrize("name", [None, "softmax"], ids=["teacher", "softmax"])
@torch.no_grad()
def test_softmax_layers_decode_with_the_flash_decoding_kernel(name, monkeypatch):
    """With the fused kernels (in Triton's interpreter without a GPU) the softmax layers read each
    row's keys so far with the flash-decoding kernel, one call per layer and step, and every step's
    logits still equal the full forward's; left-padded prompts, or ``ops.softmax.DECODE_FLASH`` off,
    take the masked matmul over the whole buffer."""
    from linearize.ops import softmax as softmax_ops

    calls = []
    kernel = softmax_ops.slot_attention
    monkeypatch.setattr(softmax_ops, "slot_attention", lambda *a: calls.append(a[4].tolist()) or kernel(*a))
    model = _model(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(7)).to(device)
    decoder = StaticDecoder(model, batch_size=3, max_length=14, graphs=False)
    with fused_decode.use_fused(True):
        tokens, logits = _prefill_and_step(decoder, prompt, 6)
    assert decoder.softmax_path == "flash-decoding"
    layers = model.config.num_hidden_layers
    assert calls == [[5 + i + 1] * 3 for i in range(6) for _ in range(layers)]  # each step: slots 0 .. its own, every row
    seq = torch.cat([prompt.expand(3, -1), torch.stack(tokens[:-1], dim=1)], dim=1)
    full = model(seq).logits[:, prompt.shape[1] - 1 :]
    tol = 2e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(torch.stack(logits, dim=1), full, atol=tol, rtol=tol)
    calls.clear()
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [1] * 5], device=device)
    with fused_decode.use_fused(True):
        decoder.prefill(prompt.expand(3, -1), attention_mask=mask)
        decoder.step()
    assert decoder.softmax_path == "matmul" and calls == []
    monkeypatch.setattr(softmax_ops, "DECODE_FLASH", False)
    with fused_decode.use_fused(True):
        decoder.prefill(prompt)
        decoder.step()
    assert decoder.softmax_path == "matmul" and calls == []


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@pytest.mark.parametrize("name", ["hybrid-joint", "hybrid-gate", "hybrid-nope", "dsla", "dsla-nope"])
@pytest.mark.parametrize("options", [False, True], ids=["defaults", "row-states-grouped-window-inputs-in-one-blocks-per-axis"])
@torch.no_grad()
def test_fused_decode_kernels_match_full_forward(name, options, monkeypatch):
    """With the fused kernels (in Triton's interpreter without a GPU), the prefill's logits (the
    hybrid's fused prefill, DSLA's token-major one) and each step's still equal the full forward's
    at that position; DSLA's prefill runs its two fused kernels (the gates made inside them), and each
    decode step its features and gates in one kernel beside its state kernel; the states column-major
    (the default). The same with the other kernel options: row-major states, the window read per KV
    head, DSLA's inputs in one program per head and block of rows, and DSLA's state kernel with
    its blocks of value columns on a grid axis of their own, RoPE applied before DSLA's inputs
    kernel instead of in it, and DSLA's two reads mixed elementwise instead of in one kernel."""
    monkeypatch.setattr(fused_decode, "COLUMN_STATES", True)
    if options:
        for name_, value in (("COLUMN_STATES", False), ("WINDOW_GROUPED", True), ("DSLA_INPUT_PARTS", 1), ("DSLA_GATE_DOWN", False),
                             ("DSLA_BLOCKS_BY_ROW", False), ("DSLA_ROPE_IN_KERNEL", False), ("DSLA_MIX_KERNEL", False)):  # fmt: skip
            monkeypatch.setattr(fused_decode, name_, value)
    made = []  # the decode states made column-major
    new_state = fused_decode.new_state

    def tracked(shape, like):
        state = new_state(shape, like)
        if not state.is_contiguous():
            made.append(shape)
        return state

    monkeypatch.setattr(fused_decode, "new_state", tracked)
    calls, prefills = [], []
    for op in ("hybrid_linear_step", "hybrid_window_read", "dsla_state_step", "dsla_decode_inputs"):
        kernel = getattr(fused_decode, op)
        monkeypatch.setattr(fused_decode, op, lambda *a, kernel=kernel, op=op: calls.append(op) or kernel(*a))
    for module, fn in ((fused_prefill, "hybrid_prefill"), (dsla_layers, "dsla_prefill"), (fused_dsla, "dsla_prefill_fused")):
        prefill = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, prefill=prefill, fn=fn, **kw: prefills.append(fn) or prefill(*a, **kw))
    model = _model(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5)).to(device)
    decoder = StaticDecoder(model, batch_size=2, max_length=14, graphs=False)
    with fused_decode.use_fused(True):
        tokens, logits = _prefill_and_step(decoder, prompt, 6)
    fused_prefills = list(prefills)  # the decoder's (on CUDA the full forward below takes the fused form too)
    seq = torch.cat([prompt, torch.stack(tokens[:-1], dim=1)], dim=1)
    full = model(seq).logits[:, prompt.shape[1] - 1 :]
    tol = 2e-5 if device == "cpu" else 2e-3  # on CUDA the full forward's fla kernels multiply in TF32
    torch.testing.assert_close(torch.stack(logits, dim=1), full, atol=tol, rtol=tol)
    ops = {"dsla_state_step", "dsla_decode_inputs"} if name.startswith("dsla") else {"hybrid_linear_step", "hybrid_window_read"}
    assert set(calls) == ops
    assert len(calls) == 6 * model.config.num_hidden_layers * len(ops)  # every layer is converted: each op once per layer and step
    fused = "dsla_prefill_fused" if name.startswith("dsla") else "hybrid_prefill"
    assert fused_prefills == [fused] * model.config.num_hidden_layers  # every layer's prefill took its fused form
    assert len(made) == (0 if options else model.config.num_hidden_layers)  # column-major: each layer's state, once, at the prefill


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@torch.no_grad()
def test_bf16_dsla_steps_take_the_gates_down_projection_from_bf16_parts(monkeypatch):
    """A bfloat16 DSLA model (its gates' weights float32): with the gates' down projection in the
    inputs kernel, each step hands the kernel the weights' three bfloat16 parts (kept between
    tokens), and the logits are those of the steps with the float32 GEMM before the kernel; with
    the features written in the other dtype (float32 or bfloat16), exactly the same."""
    downs = []
    kernel = fused_decode.dsla_decode_inputs
    monkeypatch.setattr(fused_decode, "dsla_decode_inputs", lambda *a: downs.append(a[3]) or kernel(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec, mode = VARIANTS["dsla"]
    model = convert(tiny().to(torch.bfloat16), spec, mode).to(device)
    assert model.model.layers[0].self_attn.gate_history.down.weight.dtype == torch.float32
    prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(7)).to(device)
    runs = []
    for inside in (False, True):
        monkeypatch.setattr(fused_decode, "DSLA_GATE_DOWN", inside)
        downs.clear()
        decoder = StaticDecoder(model, batch_size=2, max_length=8, graphs=False)
        with fused_decode.use_fused(True):
            runs.append(_prefill_and_step(decoder, prompt, 2))
        assert {(d.dim(), d.dtype) for d in downs} == ({(3, torch.bfloat16)} if inside else {(2, torch.float32)})
        assert len({d.data_ptr() for d in downs}) == model.config.num_hidden_layers  # each layer's kept
    torch.testing.assert_close(torch.stack(runs[1][1]), torch.stack(runs[0][1]), atol=1e-2, rtol=0)
    assert [t.tolist() for t in runs[1][0]] == [t.tolist() for t in runs[0][0]]
    monkeypatch.setattr(fused_decode, "DSLA_DOWN_SPLIT_ROWS", 1)  # the projection in a kernel of its own, split over the hidden size
    split = fused_decode.dsla_gate_down
    monkeypatch.setattr(fused_decode, "dsla_gate_down", lambda *a: downs.append(a[1]) or split(*a))
    downs.clear()
    decoder = StaticDecoder(model, batch_size=2, max_length=8, graphs=False)
    with fused_decode.use_fused(True):
        tokens, logits = _prefill_and_step(decoder, prompt, 2)
    assert len(downs) == 2 * 2 * model.config.num_hidden_layers  # each layer's step: the inputs kernel and the split projection
    torch.testing.assert_close(torch.stack(logits), torch.stack(runs[1][1]), atol=1e-2, rtol=0)
    assert [t.tolist() for t in tokens] == [t.tolist() for t in runs[1][0]]
    monkeypatch.setattr(fused_decode, "DSLA_DOWN_SPLIT_ROWS", None)
    monkeypatch.setattr(fused_decode, "DSLA_FEATURES_IN_MAPS_DTYPE", not fused_decode.DSLA_FEATURES_IN_MAPS_DTYPE)
    decoder = StaticDecoder(model, batch_size=2, max_length=8, graphs=False)
    with fused_decode.use_fused(True):
        _, logits = _prefill_and_step(decoder, prompt, 2)
    assert torch.equal(torch.stack(logits), torch.stack(runs[1][1]))


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
def test_dsla_layers_take_the_fused_prefill_for_inference_only(monkeypatch):
    """A DSLA model's forward hands its layers' prefill to the fused kernels only without gradients
    and without padding, and only where the fused kernels are on; the logits are the same either way."""
    calls = []
    real = fused_dsla.dsla_prefill_fused
    monkeypatch.setattr(fused_dsla, "dsla_prefill_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU the kernels run in Triton's interpreter
    model = _model("dsla").to(device)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2)).to(device)
    padded = torch.ones(2, 9, dtype=torch.long, device=device)
    padded[0, :3] = 0

    def run(grad: bool = False, fused: bool = True, mask=None):
        calls.clear()
        with fused_decode.use_fused(fused), torch.set_grad_enabled(grad):
            logits = model(ids, attention_mask=mask).logits
        return len(calls), logits

    taken, logits = run()
    assert taken == layers
    assert run(grad=True)[0] == 0
    assert run(mask=padded)[0] == 0
    untaken, exact = run(fused=False)
    assert untaken == 0
    tol = 2e-5 if device == "cpu" else 2e-3  # on CUDA the torch path's fla kernels multiply in TF32
    torch.testing.assert_close(logits, exact, atol=tol, rtol=tol)


@pytest.mark.skipif(not fused_decode.triton_available(), reason="needs Triton (the test extra installs it)")
@torch.no_grad()
def test_lola_decoder_with_the_fused_state_pass_equals_the_torch_decoder(monkeypatch):
    """LoLA layers under the static decoder with the state's update and read as one kernel (in
    Triton's interpreter without a GPU), the selection in torch (as for a feature map the fused
    step does not compute): the same tokens and logits as the torch steps, and the same
    memory after (compared with each other rather than with a full forward: LoLA's selection can
    flip on a near-tie between candidates when the projections are batched differently)."""
    if not fused_decode.interpreting():
        pytest.skip("runs the kernels in Triton's interpreter on the CPU (set where there is no GPU)")
    calls = []
    kernel = fused_decode.hybrid_linear_step
    monkeypatch.setattr(fused_decode, "hybrid_linear_step", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(fused_lola, "supports", lambda dtype: False)
    model, runs = _lola_torch_and_fused_decoders()
    assert torch.equal(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-5, rtol=1e-5)
    assert len(calls) == 6 * model.config.num_hidden_layers  # the fused pass ran once per layer and step
    for torch_mem, fused_mem in zip(runs[0][2].memory, runs[1][2].memory):
        for got, want in zip(fused_mem.decode_state.canonical().tensors(), torch_mem.decode_state.canonical().tensors()):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_lola_decoder_with_the_fused_step_follows_the_torch_decoder(monkeypatch):
    """The same decoder with the whole step as two kernels per layer and step (``fused_lola``, the
    layers' Hedgehog key maps): the torch decoder's tokens, and its logits to
    1e-3. Not to 1e-5: this model's greedy tokens repeat, and a repeated token's prefill and decode
    projections differ in rounding only, so its errors tie but for the last bit and either may be
    kept (the kernel's exactness is tested on distinct tokens in tests/ops/test_fused_lola.py)."""
    if not fused_decode.interpreting():
        pytest.skip("runs the kernels in Triton's interpreter on the CPU (set where there is no GPU)")
    if not fused_decode.triton_available():
        pytest.skip("needs Triton (the test extra installs it)")
    calls = []
    kernel = fused_lola.lola_step
    monkeypatch.setattr(fused_lola, "lola_step", lambda *a: calls.append(1) or kernel(*a))
    model, runs = _lola_torch_and_fused_decoders()
    assert len(calls) == 6 * model.config.num_hidden_layers
    assert torch.equal(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name,fused", [("hybrid-nope", False), ("dsla-partial", False), ("hybrid-joint", True), ("lola-nope-sinks-weight", False),
                                        ("lola-nope-sinks-weight", True), ("lola-nope-sinks-weight", "kept-recalls"),
                                        ("lola-nope-sinks-weight", "kept-recalls-one-kernel"), ("lola-nope-sinks-weight", "kept-recalls-vectors")],
                         ids=["hybrid-nope", "dsla-partial", "hybrid-joint-fused", "lola", "lola-fused", "lola-fused-kept-recalls",
                              "lola-fused-kept-recalls-one-kernel", "lola-fused-kept-recalls-vectors"])
@torch.no_grad()
def test_compiled_step_equals_the_eager_step(name, fused, monkeypatch):
    """torch.compile'd steps (one compilation: nothing in the step changes a Python value) give the
    eager steps' tokens and logits; with the fused kernels (custom ops inside the compiled step) too,
    LoLA's scoring its slots from the state (the default) and from kept recalls, its step as two
    kernels or as one (which marks the rows' recalls current after its launch)."""
    if fused and not fused_decode.triton_available():
        pytest.skip("needs Triton (the test extra installs it)")
    model = _model(name)
    keep = isinstance(fused, str) and fused.startswith("kept-recalls")
    scalars = fused != "kept-recalls-vectors"  # how kept recalls are kept: 4 scalars per slot (the default) or [phi S, phi z]
    if fused == "kept-recalls-one-kernel":
        monkeypatch.setattr(fused_lola, "ONE_KERNEL_ROWS", 0)
    if fused == "kept-recalls-vectors":  # [phi S, phi z] per slot, the writes deferred (the default keeps 4 scalars per slot)
        monkeypatch.setattr(fused_lola, "SCALAR_RECALLS", False)
    if name.startswith("lola"):
        from dataclasses import replace

        from linearize.layers.lola import LolaAttention

        for m in model.modules():
            if isinstance(m, LolaAttention):
                assert m.options.keep_recalls is False  # the default
                m.spec = replace(m.spec, options=replace(m.options, keep_recalls=keep))
    fused = bool(fused)
    device = "cuda" if fused and torch.cuda.is_available() else "cpu"  # without a GPU the kernels run in Triton's interpreter
    model.to(device)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4)).to(device)
    runs = []
    for compile in (False, True):
        decoder = StaticDecoder(model, batch_size=2, max_length=16, compile=compile)
        with fused_decode.use_fused(fused):
            runs.append((decoder.generate(prompt, max_new_tokens=8), decoder.logits.clone()))
        if fused and name.startswith("lola"):  # the fused LoLA step ran: on the cache slots' kept recalls, or with none kept
            states = [m.decode_state for m in decoder.memory if isinstance(getattr(m, "decode_state", None), LolaDecodeState)]
            assert states
            if keep:
                assert all(st.recall_ok is not None and bool(st.recall_ok.all()) for st in states)
                assert all((st.deferred is None) == scalars for st in states)  # the vectors' writes are deferred, the scalars' not
            else:
                assert all(st.recall is None and st.deferred is None for st in states)
    assert torch.equal(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_lola_keep_recalls_option_reaches_the_decode_state():
    """LoLA's ``keep_recalls`` option decides whether the fused step's decode states keep the cache
    slots' recalls; the tokens and logits are the same either way."""
    if not (fused_decode.interpreting() or torch.cuda.is_available()) or not fused_decode.triton_available():
        pytest.skip("the fused step runs on CUDA or in Triton's interpreter")
    from dataclasses import replace

    from linearize.layers.lola import LolaAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU the kernels run in Triton's interpreter
    model = _model("lola-nope-sinks-weight").to(device)
    prompt = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(8)).to(device)
    runs = []
    for keep in (True, False):
        for m in model.modules():
            if isinstance(m, LolaAttention):
                m.spec = replace(m.spec, options=replace(m.options, keep_recalls=keep))
        decoder = StaticDecoder(model, batch_size=2, max_length=14)
        with fused_decode.use_fused(True):
            runs.append(_prefill_and_step(decoder, prompt, 4))
        states = [m.decode_state for m in decoder.memory if isinstance(getattr(m, "decode_state", None), LolaDecodeState)]
        assert states and all((st.recall is not None) == keep for st in states)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [None, "hybrid-nope", "dsla"], ids=["teacher", "hybrid-nope", "dsla"])
@torch.no_grad()
def test_steps_project_through_stacked_weights_lent_for_the_step(name, monkeypatch):
    """Each step projects q/k/v through the weights stacked at prefill (one matmul), the MLP's gate
    and up too; the modules hold nothing of it after a step; fuse_projections=False keeps them
    apart; the tokens and logits are the same either way."""
    import linearize.layers.base as base
    from linearize.decoding import FUSED_QKV

    seen = []
    plain = base.qkv_heads
    monkeypatch.setattr(base, "qkv_heads", lambda attn, h: seen.append(FUSED_QKV in attn.__dict__) or plain(attn, h))
    model = _model(name)
    prompt = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    runs = []
    for fuse in (True, False):
        decoder = StaticDecoder(model, batch_size=2, max_length=12, fuse_projections=fuse)
        decoder.prefill(prompt)
        seen.clear()
        with cpu_kernels.disabled():  # DSLA's CPU kernel projects inside itself
            runs.append((torch.stack([decoder.step() for _ in range(4)]), decoder.logits.clone()))
        assert seen and all(seen) == fuse and not any(seen) != fuse
        assert all(FUSED_QKV not in layer.self_attn.__dict__ for layer in decoder.layers)
        assert all((f.gate_up is not None) == fuse for f in decoder.fused)
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_failed_compilation_falls_back_to_the_eager_step(caplog):
    from torch._dynamo.exc import BackendCompilerFailed

    model = _model("hybrid-joint")
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    want = StaticDecoder(model, batch_size=1, max_length=12).generate(prompt, max_new_tokens=5)
    decoder = StaticDecoder(model, batch_size=1, max_length=12, compile=True)

    def failing(_decoder):
        raise BackendCompilerFailed(lambda: None, RuntimeError("inductor failed"), None)

    decoder._compiled_step = failing
    with caplog.at_level("WARNING", logger="linearize.decoding"):
        assert torch.equal(decoder.generate(prompt, max_new_tokens=5), want)
    assert not decoder.compiled and "torch.compile failed on the decode step" in caplog.text


@pytest.mark.parametrize("name", [None, "hybrid-joint", "dsla-nope", "lola-nope-sinks-weight"])
def test_a_dropped_decoder_frees_its_buffers_at_once(name):
    """A decoder holds no reference to itself: dropping it frees its buffers and states without the
    cycle collector, so a larger decoder made next (a larger batch) has the memory back."""
    import gc
    import weakref

    model = _model(name)
    prompt = torch.randint(3, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    enabled = gc.isenabled()
    gc.disable()
    try:
        decoder = StaticDecoder(model, batch_size=2, max_length=10, graphs=False)
        decoder.prefill(prompt)
        decoder.step()
        refs = [weakref.ref(decoder), weakref.ref(decoder.logits)]
        del decoder
        assert [r() for r in refs] == [None, None]
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("name", [None, "softmax", "hybrid-joint", "hybrid-nope", "dsla-nope", "lola-nope-sinks-weight"],
                         ids=["teacher", "softmax", "hybrid-joint", "hybrid-nope", "dsla-nope", "lola"])
@torch.no_grad()
def test_left_padded_prompts_of_different_lengths_decode_as_each_alone(name):
    """A batch of prompts of 7, 3 and 5 tokens (left-padded, past the 4-token windows) gives each row
    the tokens and logits that row gets decoded alone."""
    model = _model(name)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (7, 3, 5)]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 7 - len(p):], mask[row, 7 - len(p):] = p, 1
    batch = StaticDecoder(model, batch_size=3, max_length=20)
    tokens = batch.generate(ids, max_new_tokens=9, attention_mask=mask)
    assert len(batch.nbytes_by_layer()) == 3 and all(n > 0 for n in batch.nbytes_by_layer().values())  # every kind's memory counted
    for row, p in enumerate(prompts):
        alone = StaticDecoder(model, batch_size=1, max_length=20)
        assert torch.equal(tokens[row], alone.generate(p[None], max_new_tokens=9)[0])
        # float32 sums in other orders (~1e-7); LoLA's top-lambda selection can flip on a near tie
        # between candidates under that rounding (here in two of the rows), moving logits by up to ~5e-4
        tol = 2e-3 if name and name.startswith("lola") else 1e-4
        torch.testing.assert_close(batch.logits[row], alone.logits[0], atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="pad on the left"):
        batch.prefill(ids, mask.flip(1))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 6\)"):
        batch.prefill(ids, mask[:, 1:])


@torch.no_grad()
def test_generate_returns_the_new_tokens_and_checks_lengths():
    model = _model("hybrid-joint")
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    decoder = StaticDecoder(model, batch_size=2, max_length=12)
    out = decoder.generate(prompt, max_new_tokens=7)
    assert out.shape == (2, 7) and torch.equal(out[0], out[1])
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], ref[0, 5:])
    with pytest.raises(ValueError, match="exceed max_length 12"):
        decoder.generate(prompt, max_new_tokens=8)
    decoder.step()  # feeds the 7th new token at position 11, the last slot
    with pytest.raises(RuntimeError, match="max_length 12 reached"):
        decoder.step()


def test_bad_settings_and_unsupported_modes_are_named():
    model = _model("hybrid-sinks_only")
    assert not static_decoding_supported(model) and static_decoding_supported(_model("lola"))
    with pytest.raises(ValueError, match=r"layer 0 \(hybrid, mode 'sinks_only'\).*model.generate\(\)"):
        StaticDecoder(model, batch_size=1, max_length=8)
    teacher = tiny()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticDecoder(teacher, batch_size=1, max_length=8, graphs=True)
    with pytest.raises(ValueError, match="max_length"):
        StaticDecoder(teacher, batch_size=1, max_length=1)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        StaticDecoder(teacher, batch_size=1, max_length=10_000)
    decoder = StaticDecoder(teacher, batch_size=2, max_length=8)
    with pytest.raises(RuntimeError, match="prefill a prompt"):
        decoder.step()
    with pytest.raises(ValueError, match=r"input_ids must be \(1 or 2, tokens\)"):
        decoder.prefill(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="1 to 7"):
        decoder.prefill(torch.ones(1, 8, dtype=torch.long))


@pytest.mark.parametrize("mix", ["joint", "gate"])
@torch.no_grad()
def test_static_hybrid_step_equals_the_host_ring_step(mix):
    """The static form (ring index on the device, empty slots always masked) gives the host form's
    outputs and state over 11 tokens past a 4-token window that starts half full."""
    torch.manual_seed(0)
    b, hq, hkv, d, w = 2, 4, 2, 8, 4
    phi = torch.nn.functional.softplus
    q, k, v = torch.randn(b, hq, 2, d), torch.randn(b, hkv, 2, d), torch.randn(b, hkv, 2, d)
    _, state = hybrid_attention(q, k, v, phi_q=phi, phi_k=phi, window=w, mix=mix)
    host = HybridDecodeState.from_state(state, phi, hq)
    static = HybridDecodeState.from_state(state, phi, hq).make_static()
    for _ in range(11):
        q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
        qf, kf = phi(q)[:, :, 0], phi(k.repeat_interleave(hq // hkv, dim=1))[:, :, 0]
        outs = [hybrid_decode_step(s, q, k, v, qf, kf, mix=mix) for s in (host, static)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    assert int(static.index) == host.head and static.steps == 0 and host.steps == int(static.count) == 11
    for name in ("keys", "values", "features", "linear", "valid"):
        torch.testing.assert_close(getattr(static, name), getattr(host, name), atol=1e-6, rtol=1e-6)
    for got, want in zip(static.canonical().tensors(), host.canonical().tensors()):  # the same state back
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_states_on_one_clock_equal_the_host_ring_step():
    """Two layers' static states on one shared clock (made after the clock already counted 3): each
    step derives the ring index from the clock and writes no counter of its own; outputs and states
    equal the host form's, and both states read the same index tensors."""
    torch.manual_seed(1)
    b, hq, hkv, d, w = 2, 4, 2, 8, 4
    phi = torch.nn.functional.softplus
    clock = DecodeClock()
    for _ in range(3):
        clock.advance()
    hosts, clocked = [], []
    for _ in range(2):  # two layers, the same prefill length
        q, k, v = torch.randn(b, hq, 3, d), torch.randn(b, hkv, 3, d), torch.randn(b, hkv, 3, d)
        _, state = hybrid_attention(q, k, v, phi_q=phi, phi_k=phi, window=w, mix="joint")
        hosts.append(HybridDecodeState.from_state(state, phi, hq))
        clocked.append(HybridDecodeState.from_state(state, phi, hq).make_static(clock))
    assert clocked[0].index is clocked[1].index and clocked[0].clock_start is clocked[1].clock_start
    assert clocked[0].count is None and int(clocked[0].index) == hosts[0].head
    for _ in range(9):
        for host, static in zip(hosts, clocked):
            q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
            qf, kf = phi(q)[:, :, 0], phi(k.repeat_interleave(hq // hkv, dim=1))[:, :, 0]
            outs = [hybrid_decode_step(s, q, k, v, qf, kf, mix="joint") for s in (host, static)]
            torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
        clock.advance()
    for host, static in zip(hosts, clocked):
        assert static.decoded() == host.steps == 9 and int(static.ring_index()) == host.head
        assert int(static.index) == (host.head - 9) % w  # never written: the ring index comes from the clock
        for got, want in zip(static.canonical().tensors(), host.canonical().tensors()):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_clock_on_another_device_is_refused():
    phi = torch.nn.functional.softplus
    _, state = hybrid_attention(*(torch.randn(1, 2, 2, 4) for _ in range(3)), phi_q=phi, phi_k=phi, window=4, mix="joint")
    with pytest.raises(ValueError, match="the clock is on meta"):
        HybridDecodeState.from_state(state, phi, 2).make_static(DecodeClock("meta"))


LOLA_STEPS = {  # name: (prompt tokens, sparse slots, sinks, read_state, read_sparse, weight_tokens)
    "full": (9, 4, 1, True, True, 3),  # past the window and the cache's capacity from the start
    "filling": (2, 4, 0, True, True, 0),  # the window and the cache fill during the steps
    "empty": (0, 3, 2, True, True, 2),  # from no token at all, two sinks
    "no-cache": (5, 0, 0, True, True, 0),  # lambda 0: the hybrid
    "no-state": (9, 4, 1, False, True, 0),
    "no-sparse": (9, 4, 1, True, False, 0),
}


@pytest.mark.parametrize("case", list(LOLA_STEPS))
@pytest.mark.parametrize("linear", [False, True], ids=["rope-maps", "separate-maps"])
@pytest.mark.parametrize("recall", ["state", "memory"])
@torch.no_grad()
def test_lola_decode_step_equals_the_op_on_one_token(linear, case, recall):
    """lola_decode_step (state updated in place, constants on the device) gives lola_attention's
    outputs and states token by token, with per-head weights, sinks and a length-scaled weight, from
    prefilled states full, filling and empty, with and without a sparse cache, in every read, for
    both recall rules."""
    torch.manual_seed(0)
    t0, lam, sinks, read_state, read_sparse, weight_tokens = LOLA_STEPS[case]
    b, hq, hkv, d, w = 2, 4, 2, 8, 3
    phi = torch.nn.functional.softplus
    factor = torch.rand(hq)
    options = dict(window_factor=factor, sinks=sinks, linear_weight=[0.2, 0.5, 1.0, 0.0], weight_tokens=weight_tokens,
                   read_state=read_state, read_sparse=read_sparse, recall=recall)  # fmt: skip
    kw = dict(phi_q=phi, phi_k=phi, window=w, sparse=lam, **options)

    def inputs(t):
        q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
        return (q, k, v, {"q_lin": torch.randn(b, hq, t, d), "k_lin": torch.randn(b, hkv, t, d)} if linear else {})

    q, k, v, lin = inputs(t0)
    _, state = lola_attention(q, k, v, chunk=3, **kw, **lin)
    ds = LolaDecodeState.from_state(state, phi_q=phi, phi_k=phi, scale=d**-0.5, dtype=torch.float32, **options)
    tensors = {name: t.data_ptr() for name, t in vars(ds).items() if isinstance(t, torch.Tensor)}
    for _ in range(11):
        q, k, v, lin = inputs(1)
        want, state = lola_attention(q, k, v, chunk=1, state=state, **kw, **lin)
        torch.testing.assert_close(lola_decode_step(ds, q, k, v, **lin), want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(ds.canonical().tensors(), state.tensors()):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert {name: t.data_ptr() for name, t in vars(ds).items() if isinstance(t, torch.Tensor)} == tensors  # updated in place
    with pytest.raises(ValueError, match="separate feature-map keys"):
        lola_decode_step(ds, q, k, v, **({} if linear else {"q_lin": q, "k_lin": k}))


@torch.no_grad()
def test_lola_decode_step_breaks_ties_as_the_op():
    """Equal self-recall errors (every key and value the same): the newest candidate is the one not
    kept, as in the chunked op's stable sort, so the cache keeps the oldest tokens."""
    b, hq, hkv, d, w, lam = 1, 2, 1, 4, 2, 3
    phi = torch.nn.functional.softplus
    factor = torch.ones(hq)
    kw = dict(phi_q=phi, phi_k=phi, window=w, sparse=lam, window_factor=factor)
    one = torch.ones(b, hkv, 1, d)
    _, state = lola_attention(torch.ones(b, hq, 1, d), one, one, chunk=1, **kw)
    ds = LolaDecodeState.from_state(state, phi_q=phi, phi_k=phi, window_factor=factor, scale=d**-0.5, dtype=torch.float32)
    for _ in range(8):
        want, state = lola_attention(torch.ones(b, hq, 1, d), one, one, chunk=1, state=state, **kw)
        torch.testing.assert_close(lola_decode_step(ds, torch.ones(b, hq, 1, d), one, one), want)
    got = ds.canonical()
    assert torch.equal(got.sparse.positions, state.sparse.positions) and got.sparse.positions[0, 0].tolist() == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [None, "hybrid-joint", "hybrid-nope", "dsla-partial", "lola-nope-sinks-weight"],
                         ids=["teacher", "hybrid-joint", "hybrid-nope", "dsla-partial", "lola"])
@torch.no_grad()
def test_cuda_graph_replays_equal_eager_steps(name):
    """On CUDA the step is captured after two eager steps; replays give the eager decoder's logits
    (LoLA to 1e-4 when compiled: the compiled feature map of the query rounds differently, and
    this model's repeated tokens leave near-ties that such rounding may break either way)."""
    model = _model(name).cuda()
    prompt = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3)).cuda()
    runs = []
    for graphs, compile in ((False, False), (True, False), (True, True)):
        decoder = StaticDecoder(model, batch_size=2, max_length=20, graphs=graphs, compile=compile)
        decoder.prefill(prompt)
        runs.append(torch.stack([decoder.step() for _ in range(10)]))
        runs.append(decoder.logits.clone())
        assert (decoder._graph is not None) == graphs
    for (tokens, logits), tol in (((runs[2], runs[3]), 1e-5), ((runs[4], runs[5]), 1e-4 if name and name.startswith("lola") else 1e-5)):
        assert torch.equal(tokens, runs[0])
        torch.testing.assert_close(logits, runs[1], atol=tol, rtol=tol)


class _ByteTokenizer:
    """A byte-level tokenizer for the tiny model's 128-token vocabulary (the real one is tested with
    SmolLM2 in test_smollm2.py)."""

    eos_token_id = pad_token_id = 0
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [3 + b % 125 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + int(i) % 26) for i in ids if not (skip_special_tokens and int(i) == 0))


def test_generate_text_decodes_statically_where_it_can():
    """generate_text's static decoder gives model.generate()'s text; 'auto' picks generate() on CPU;
    a kind without a static step and a bad choice are named."""
    from linearize.generate import generate_text

    tokenizer = _ByteTokenizer()
    model = _model("hybrid-joint")
    results = {d: generate_text(model, tokenizer, "hi there", max_new_tokens=6, chat=False, decoder=d) for d in ("static", "generate", "auto")}
    assert results["static"].text == results["generate"].text and results["static"].new_tokens == results["generate"].new_tokens
    assert [results[d].decoder for d in ("static", "generate", "auto")] == ["static", "generate", "generate"]  # auto: static on CUDA
    assert results["static"].memory_bytes == sum(results["static"].memory_by_layer.values()) > 0
    with pytest.raises(ValueError, match="no static decode step"):
        generate_text(_model("hybrid-none"), tokenizer, "hi", max_new_tokens=2, chat=False, decoder="static")
    with pytest.raises(ValueError, match="unknown decoder 'fast'; valid choices: auto, static, generate"):
        generate_text(model, tokenizer, "hi", decoder="fast")

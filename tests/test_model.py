"""Model-level behaviour on tiny random Llama-family models (CPU, no download)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import linearize
import linearize.cache
from linearize.cache import StateCacheLayer, cache_kwargs, cache_nbytes
from linearize.convert import converted_layers
from linearize.hub import build_tiny_llama
from linearize.layers.base import derived, frozen_derived, tensors_at
from linearize.memory import layer_memory
from linearize.ops import cpu_kernels
from linearize.ops.states import BatchState

VARIANTS = {
    "softmax": ({"attention": "softmax"}, None),
    "hybrid-joint": ({"attention": "hybrid", "window": 4}, None),
    "hybrid-joint-overlap": ({"attention": "hybrid", "window": 4, "overlap": True}, None),
    "hybrid-gate": ({"attention": "hybrid", "window": 4, "mix": "gate"}, None),
    "hybrid-gate-learned-rect": ({"attention": "hybrid", "window": 3, "mix": "gate", "learn_gate": True, "feature_dim": 16}, None),
    "hybrid-relu": ({"attention": "hybrid", "window": 4, "feature_map": "relu"}, None),
    "hybrid-nope": ({"attention": "hybrid", "window": 4, "linear_rope": False}, None),
    "hybrid-nope-la_only": ({"attention": "hybrid", "window": 4, "linear_rope": False}, "la_only"),
    "dsla-nope": ({"attention": "dsla", "linear_rope": False}, None),
    "hybrid-swa_only": ({"attention": "hybrid", "window": 4}, "swa_only"),
    "hybrid-la_only": ({"attention": "hybrid", "window": 4}, "la_only"),
    "hybrid-sinks_only": ({"attention": "hybrid", "window": 4}, "sinks_only"),
    "hybrid-none": ({"attention": "hybrid", "window": 4}, "none"),
    "lola": ({"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 1}, None),
    "lola-no_state": ({"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 1}, "no_state"),
    "lola-nope": ({"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 1, "linear_rope": False}, None),
    "lola-nope-sinks-weight": ({"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 1, "linear_rope": False,
                                "sinks": 2, "linear_weight": 0.3}, None),
    "lola-nope-memory": ({"attention": "lola", "window": 4, "sparse_cache": 3, "chunk": 1, "linear_rope": False, "sinks": 1,
                          "recall": "memory"}, None),
    # with lambda > 0 a chunked prefill may legitimately differ from decoding (the selection runs once
    # per chunk); with lambda = 0 every chunk length equals it: the chunked path at model level
    "lola-nope-s0-C3": ({"attention": "lola", "window": 4, "sparse_cache": 0, "chunk": 3, "linear_rope": False}, None),
    "dsla": ({"attention": "dsla"}, None),
    "dsla-partial": ({"attention": "dsla", "layers": [0, 2]}, None),
    "dsla-identity": ({"attention": "dsla", "feature_map": "identity"}, None),
    "dsla-relu-rope": ({"attention": "dsla", "feature_map": "relu", "linear_rope": True}, None),
    "dsla-recent_only": ({"attention": "dsla"}, "recent_only"),
    "dsla-history_only": ({"attention": "dsla", "linear_rope": False}, "history_only"),
}


def tiny(seed: int = 0):
    return build_tiny_llama(seed=seed, num_hidden_layers=3).eval()


def padded_batch(vocab: int, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, : total - n] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def convert(model, spec: dict, mode: str | None):
    linearize.convert(model, spec)
    if mode:
        linearize.set_mode(model, mode)
    return model


@torch.no_grad()
def test_converting_no_layers_reproduces_teacher_exactly():
    teacher, student = tiny(), tiny()
    ids, mask = padded_batch(teacher.config.vocab_size, [9, 6])
    ref = teacher(ids, attention_mask=mask).logits
    linearize.convert(student, {"layers": []})
    assert student.config.model_type == "linearize_llama"
    assert torch.equal(student(ids, attention_mask=mask).logits, ref)


@torch.no_grad()
def test_softmax_kind_matches_teacher_and_reuses_projections():
    teacher, student = tiny(), tiny()
    projections = [student.model.layers[i].self_attn.q_proj for i in range(len(student.model.layers))]
    linearize.convert(student, {"attention": "softmax"})
    for i, layer in enumerate(student.model.layers):
        assert layer.self_attn.q_proj is projections[i]
    ids, mask = padded_batch(teacher.config.vocab_size, [12, 7])
    pos = positions(mask)
    ref = teacher(ids, attention_mask=mask, position_ids=pos).logits
    out = student(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


# -m "not slow" runs one variant of each attention kind; every variant runs in the full suite.
FAST_VARIANTS = {"softmax", "hybrid-joint", "lola", "dsla"}


@pytest.mark.parametrize("name", [n if n in FAST_VARIANTS else pytest.param(n, marks=pytest.mark.slow) for n in VARIANTS])
@torch.no_grad()
def test_prefill_then_decode_matches_full_forward_with_left_padding(name):
    spec, mode = VARIANTS[name]
    model = convert(tiny(), spec, mode)
    lengths, decode_steps = [11, 7, 9], 5
    ids, mask = padded_batch(model.config.vocab_size, lengths)
    full = model(ids, attention_mask=mask, position_ids=positions(mask)).logits  # (B, T, V)
    prefill = ids.shape[1] - decode_steps
    cache = DynamicCache()
    pos = positions(mask)
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=pos[:, :prefill], **cache_kwargs(cache), use_cache=True)
    logits = [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits)
    stepped = torch.cat(logits, dim=1)
    real = mask.bool()
    torch.testing.assert_close(stepped[real], full[real], atol=2e-5, rtol=2e-5)
    converted = [i for i, layer in enumerate(cache.layers) if isinstance(layer, StateCacheLayer)]
    assert converted == sorted(converted_layers(model))


DECODE_PATH_VARIANTS = [n for n, (spec, mode) in VARIANTS.items()
                        if spec["attention"] in ("hybrid", "dsla", "lola") and mode not in ("sinks_only", "none")]  # fmt: skip


def _decode(model, ids, mask, prefill: int):
    """Logits of a prefill of ``prefill`` tokens (none: token by token from the start), then one token
    per call; the cache after."""
    cache, pos, logits = DynamicCache(), positions(mask), []
    if prefill:
        logits.append(model(ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=pos[:, :prefill],
                            **cache_kwargs(cache), use_cache=True).logits)  # fmt: skip
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1],
                            **cache_kwargs(cache), use_cache=True).logits)  # fmt: skip
    return torch.cat(logits, dim=1), cache


def kernel_applies(spec: dict) -> bool:
    """Whether the CPU kernels run this variant's decode step (Hedgehog maps; DSLA also identity)."""
    if spec["attention"] == "lola":  # LoLA's step runs as PyTorch operations only
        return False
    feature_map = spec.get("feature_map", "hedgehog")
    return feature_map == "hedgehog" or (spec["attention"] == "dsla" and feature_map == "identity")


@contextlib.contextmanager
def decode_path(path: str):
    """The decode path a test runs: "kernels" (the CPU kernels; skipped where they cannot be built)
    or "torch" (the PyTorch decode ops)."""
    if path == "torch":
        with cpu_kernels.disabled():
            yield
        return
    if cpu_kernels.setting() == "off" or cpu_kernels.library() is None:
        pytest.skip("the CPU kernels are off or cannot be built here (tests/ops/test_cpu_kernels.py says which)")
    yield


@pytest.mark.parametrize("name", [n if n in FAST_VARIANTS else pytest.param(n, marks=pytest.mark.slow) for n in DECODE_PATH_VARIANTS])
@pytest.mark.parametrize("prefill", [0, 6])
@pytest.mark.parametrize("path", ["kernels", "torch"])
@torch.no_grad()
def test_decode_path_matches_reference_ops_outputs_and_states(name, prefill, path):
    """The per-token decode path (states updated in place; through the CPU kernels or the PyTorch
    decode ops) gives the reference ops' logits and states, past the window, from an empty cache or
    after a left-padded prefill."""
    spec, mode = VARIANTS[name]
    model = convert(tiny(), spec, mode)
    ids, mask = padded_batch(model.config.vocab_size, [14, 9], seed=3)
    with decode_path(path):
        fast, fast_cache = _decode(model, ids, mask, prefill)
    with linearize.cache.reference_decoding():
        ref, ref_cache = _decode(model, ids, mask, prefill)
    real = mask.bool()
    torch.testing.assert_close(fast[real], ref[real], atol=2e-5, rtol=2e-5)
    for layer in converted_layers(model):
        a, b = fast_cache.layers[layer], ref_cache.layers[layer]
        assert a.decode_state is not None and b.decode_state is None  # the fast path ran, the reference did not
        assert (getattr(a.decode_state, "kernel_args", None) is not None) == (path == "kernels" and kernel_applies(spec))
        assert a.seen == b.seen
        for x, y in zip(a.state.tensors(), b.state.tensors(), strict=True):  # reading the state turns it canonical
            torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spec", [{"attention": "hybrid", "window": 4}, {"attention": "hybrid", "window": 3, "linear_rope": False},
                                  {"attention": "dsla"}, {"attention": "dsla", "linear_rope": False}], ids=str)
@torch.no_grad()
def test_kernel_decode_token_by_token_equals_full_forward(spec):
    """Token by token from an empty cache through the CPU kernels, batch 2 without position ids (one
    RoPE table shared by the rows), and switching to the PyTorch decode ops and back mid-sequence
    (both update the same decode state): a full forward pass's logits."""
    model = convert(tiny(), spec, None)
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=gen)
    full = model(ids).logits
    cache, logits = DynamicCache(), []
    with decode_path("kernels"):
        for t in range(ids.shape[1]):
            with cpu_kernels.disabled() if t in (5, 6) else contextlib.nullcontext():
                logits.append(model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=2e-5, rtol=2e-5)
    assert all(cache.layers[i].decode_state.kernel_args is not None for i in converted_layers(model))


@torch.no_grad()
def test_dsla_stacked_gates_equal_each_gate():
    """Both DSLA gates from one projection (down projections side by side, up block-diagonal: what
    the token-major prefill and the decode step read) equal each gate's own module, history first."""
    model = convert(tiny(), {"attention": "dsla"}, None)
    layer = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(3)
    for p in layer.gate_history.parameters():
        p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(2, 7, model.config.hidden_size, generator=gen)
    stacked = layer.stacked_log_gates(x)  # (B, T, 2, Hq, F)
    history, recent = layer.log_gates(x)  # (B, Hq, T, F) each
    assert stacked.shape == (2, 7, 2, layer.num_heads, layer.features)
    torch.testing.assert_close(stacked[:, :, 0], history.transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stacked[:, :, 1], recent.transpose(1, 2), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(stacked[:, :, 0], stacked[:, :, 1])
    torch.testing.assert_close(layer.decode_gates(x[:, :1], torch.float32), stacked[:, 0].exp())


@pytest.mark.parametrize("name", ["hybrid-joint", "hybrid-gate-learned-rect", "dsla"])
@torch.no_grad()
def test_decode_path_sees_parameters_updated_between_tokens(name):
    """The decode path keeps weights it derives (stacked feature maps and gates, mix factors) only
    until a parameter changes: after an in-place update between two tokens it still gives the
    reference ops' logits. (Not phi_k of a hybrid: the window keeps each key's features from when
    it arrived, by design.)"""
    spec, mode = VARIANTS[name]
    updated = ("feature_map_q", "gate", "window_factor", "gamma") + (("feature_map_k",) if spec["attention"] == "dsla" else ())
    model = convert(tiny(), spec, mode)
    ids, mask = padded_batch(model.config.vocab_size, [8, 6], seed=5)
    gen = torch.Generator().manual_seed(0)

    def run():
        cache, pos, logits = DynamicCache(), positions(mask), []
        for t in range(ids.shape[1]):
            if t == 4:  # as an optimiser step would, in place
                for name_, p in model.named_parameters():
                    if any(part in name_ for part in updated):
                        p.add_(0.3 * torch.randn(p.shape, generator=gen))
            logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=pos[:, t : t + 1],
                                **cache_kwargs(cache), use_cache=True).logits)  # fmt: skip
        return torch.cat(logits, dim=1)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = model(ids, attention_mask=mask, position_ids=positions(mask)).logits  # (B, T, V) without the update
    fast = run()
    model.load_state_dict(state)
    gen.manual_seed(0)
    with linearize.cache.reference_decoding():
        ref = run()
    real = mask.bool()
    torch.testing.assert_close(fast[real], ref[real], atol=2e-5, rtol=2e-5)
    assert not torch.allclose(fast[:, 5:][real[:, 5:]], before[:, 5:][real[:, 5:]], atol=1e-3)  # the update took effect


@pytest.mark.parametrize("spec,second", [({"attention": "hybrid", "window": 3}, "swa_only"), ({"attention": "dsla"}, "history_only")],
                         ids=["hybrid", "dsla"])
@torch.no_grad()
def test_kernel_decode_follows_a_mode_switched_mid_sequence(spec, second):
    """Modes that keep the same state can be switched between tokens: the CPU kernels then read the
    new mode (branches, mix), as the reference ops do."""
    model = convert(tiny(), spec, None)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))

    def run():
        cache, logits = DynamicCache(), []
        for t in range(ids.shape[1]):
            linearize.set_mode(model, "hybrid" if t < 5 else second)
            logits.append(model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits)
        linearize.set_mode(model, "hybrid")
        return torch.cat(logits, dim=1)

    with decode_path("kernels"):
        fast = run()
    with linearize.cache.reference_decoding():
        ref = run()
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=2e-5)


def test_derived_is_rebuilt_when_a_source_changes():
    """What the decode path derives from parameters is rebuilt after an in-place update, a new
    tensor or new storage (``.data`` replaced), and kept otherwise."""
    module = torch.nn.Linear(3, 2)
    builds = []

    def get():
        return derived(module, "w", tensors_at(module, ("weight", "bias")), lambda: builds.append(1) or module.weight.sum().item())

    first = get()
    assert get() == first and len(builds) == 1
    with torch.no_grad():
        module.weight.add_(1.0)
    assert get() == pytest.approx(first + 6) and len(builds) == 2
    module.weight.data = torch.zeros(2, 3)
    assert get() == 0 and len(builds) == 3
    module.bias = torch.nn.Parameter(torch.ones(2))
    get()
    assert len(builds) == 4
    assert tensors_at(module, ("bias",))[0] is module.bias


def test_a_compiled_call_reads_the_kept_value_only_when_frozen():
    """Inside torch.compile ``derived`` builds its value in the graph (it cannot check its sources
    there); within ``frozen_derived`` it reads the value an eager call kept instead, as it is (the
    static decoder's compiled steps: stacked weights become inputs of the graph, not kernels)."""
    module = torch.nn.Linear(3, 2)
    x = torch.ones(2)

    def step(x):
        return x + derived(module, "w", tensors_at(module, ("weight",)), lambda: module.weight.sum())

    kept = step(x)  # eager: builds and keeps
    with torch.no_grad():
        module.weight.add_(1.0)  # an eager call would now rebuild (+ 6)
    torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(x), kept + 6)
    torch._dynamo.reset()
    with frozen_derived():
        torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(x), kept)
    torch._dynamo.reset()
    module.__dict__.pop("_derived")
    with frozen_derived():  # nothing kept: built in the graph
        torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(x), kept + 6)


def test_decode_path_runs_a_model_loaded_under_inference_mode():
    """Parameters made under torch.inference_mode (a model loaded there, as the decode-speed
    benchmark does) have no version counter; the decode path still keeps what it derives from them
    and gives the reference ops' logits."""
    with torch.inference_mode():
        for spec in ({"attention": "hybrid", "window": 4}, {"attention": "dsla"}):
            model = convert(tiny(), spec, None)
            assert next(model.parameters()).is_inference()
            ids, mask = padded_batch(model.config.vocab_size, [7, 7], seed=6)
            fast, _ = _decode(model, ids, mask, 3)
            with linearize.cache.reference_decoding():
                ref, _ = _decode(model, ids, mask, 3)
            torch.testing.assert_close(fast, ref, atol=2e-5, rtol=2e-5)


@torch.no_grad()
def test_decode_path_leaves_a_state_handed_out_unchanged():
    model = convert(tiny(), {"attention": "hybrid", "window": 3}, None)
    ids, mask = padded_batch(model.config.vocab_size, [6], seed=4)
    cache = DynamicCache()
    model(ids[:, :4], attention_mask=mask[:, :4], **cache_kwargs(cache), use_cache=True)
    before = cache.layers[0].state
    copies = [t.clone() for t in before.tensors()]
    model(ids[:, 4:5], attention_mask=mask[:, :5], position_ids=torch.tensor([[4]]), **cache_kwargs(cache), use_cache=True)
    for x, y in zip(before.tensors(), copies):
        assert torch.equal(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid-joint", "lola", "dsla", "softmax"])
@torch.no_grad()
def test_generate_matches_greedy_full_forwards(name):
    spec, mode = VARIANTS[name]
    model = convert(tiny(), spec, mode)
    ids, mask = padded_batch(model.config.vocab_size, [8, 5], seed=1)
    new = 6
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    seq, m = ids, mask
    for _ in range(new):
        logits = model(seq, attention_mask=m, position_ids=positions(m)).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_states_split_and_merge_per_request():
    """Decoding requests one by one from a split cache equals decoding the merged batch."""
    model = convert(tiny(), {"attention": "hybrid", "window": 3, "layers": [0, 1]}, None)
    ids, mask = padded_batch(model.config.vocab_size, [9, 6, 8], seed=2)
    pos = positions(mask)
    cache = DynamicCache()
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
    next_ids = torch.tensor([[5], [6], [7]])
    next_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    next_pos = pos[:, -1:] + 1
    layer0 = cache.layers[0]
    parts = layer0.state.split([1, 2])
    merged = type(layer0.state).merge(parts)
    for a, b in zip(merged.tensors(), layer0.state.tensors()):
        assert torch.equal(a, b)
    batch_logits = model(next_ids, attention_mask=next_mask, position_ids=next_pos, **cache_kwargs(cache), use_cache=True).logits
    assert layer0.nbytes() > 0 and isinstance(layer0.state, BatchState)
    # Row 1 alone: rebuild its cache by selecting its row everywhere.
    cache_row = DynamicCache()
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache_row), use_cache=True)
    cache_row.batch_select_indices(torch.tensor([1]))
    row_logits = model(next_ids[1:2], attention_mask=next_mask[1:2], position_ids=next_pos[1:2], **cache_kwargs(cache_row), use_cache=True).logits
    torch.testing.assert_close(row_logits[0], batch_logits[1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("linear_rope", [True, False])
def test_memory_formula_matches_measured_state(linear_rope):
    model = convert(tiny(), {"attention": "hybrid", "window": 4, "layers": [1], "linear_rope": linear_rope}, None)
    ids, mask = padded_batch(model.config.vocab_size, [10])
    cache = DynamicCache()
    model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    measured = cache_nbytes(cache)
    spec = model.model.layers[1].self_attn.spec
    formula = layer_memory(spec, model.config, dtype_bytes=4)
    # the state also holds per-slot validity and positions: a few bytes per window slot
    assert formula.fixed <= measured[1] <= formula.fixed + 16 * spec.options.window
    teacher = layer_memory(None, model.config, dtype_bytes=4)
    assert measured[0] == teacher.at(10)


@torch.no_grad()
@pytest.mark.parametrize("linear_rope", [True, False])
def test_lola_memory_formula_matches_measured_state(linear_rope):
    """LoLA's formula counts the window, the sparse cache (each with its keys before RoPE when
    linear_rope is false) and the linear state, as the cache measures them."""
    window, sparse = 4, 3
    model = convert(tiny(), {"attention": "lola", "window": window, "sparse_cache": sparse, "chunk": 2, "layers": [1],
                             "linear_rope": linear_rope}, None)
    ids, mask = padded_batch(model.config.vocab_size, [10])
    cache = DynamicCache()
    model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    measured = cache_nbytes(cache)
    spec = model.model.layers[1].self_attn.spec
    state = cache.layers[1].state
    assert (state.window.linear_keys is None) == (state.sparse.linear_keys is None) == linear_rope
    formula = layer_memory(spec, model.config, dtype_bytes=4)
    # the state also holds per-slot validity and positions: a few bytes per window and cache slot
    heads = model.config.num_attention_heads
    assert formula.fixed <= measured[1] <= formula.fixed + 16 * (window + heads * sparse)
    if not linear_rope:
        plain = layer_memory(spec.layer_replace(linear_rope=True), model.config, dtype_bytes=4)
        head_dim = model.config.head_dim
        extra = (window * model.config.num_key_value_heads + sparse * heads) * head_dim * 4
        assert formula.fixed - plain.fixed == extra


@torch.no_grad()
@pytest.mark.parametrize("linear_rope", [True, False])
def test_lola_without_sparse_cache_reads_the_hybrid_it_converts(linear_rope):
    """LoLA with lambda = 0 on top of a hybrid is that hybrid, whatever the chunk: the model-level
    check that a lola layer hands the feature maps the same inputs (q/k before RoPE or not)."""
    model = convert(tiny(), {"attention": "hybrid", "window": 3, "linear_rope": linear_rope}, None)
    for p in linearize.new_parameters(model).values():
        p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids, mask = padded_batch(model.config.vocab_size, [12, 9], seed=3)
    pos = positions(mask)
    hybrid = model(ids, attention_mask=mask, position_ids=pos).logits
    linearize.convert(model, {"attention": "lola", "window": 3, "sparse_cache": 0, "chunk": 5, "linear_rope": linear_rope})
    lola = model(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(lola[real], hybrid[real], atol=2e-5, rtol=2e-5)
    linearize.convert(model, {"attention": "lola", "window": 3, "sparse_cache": 0, "chunk": 5, "linear_rope": not linear_rope})
    other = model(ids, attention_mask=mask, position_ids=pos).logits
    assert not torch.allclose(other[real], hybrid[real], atol=1e-3)


@torch.no_grad()
def test_memory_formula_counts_a_nested_familys_teacher_layers():
    """Layers beyond ``active`` run the teacher and hold its KV cache: the formula (request_memory and
    ``info``) must say so, and agree with the measured cache."""
    from linearize.memory import request_memory
    from linearize.spec import ConversionSpec
    from linearize.summary import model_info

    model = tiny()
    linearize.convert(model, {"attention": "dsla", "order": [2, 0, 1], "active": 1})
    ids, mask = padded_batch(model.config.vocab_size, [10])
    cache = DynamicCache()
    model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    measured = cache_nbytes(cache)
    teacher, dsla = layer_memory(None, model.config, 4), layer_memory(ConversionSpec(attention="dsla"), model.config, 4)
    assert measured[0] == measured[1] == teacher.at(10) and measured[2] == dsla.at(10)
    spec = ConversionSpec.from_dict(model.config.linearize)
    assert request_memory(spec, model, 10, dtype_bytes=4) == 2 * teacher.at(10) + dsla.at(10)
    rows = json.loads(model_info(model, as_json=True))["per_layer"]
    assert [r["kv_bytes_per_token"] > 0 for r in rows] == [True, True, False]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"attention": "hybrid", "window": 4, "mix": "gate", "learn_gate": True}, {"attention": "dsla"}])
@torch.no_grad()
def test_save_pretrained_and_adapter_round_trip(tmp_path, spec):
    base_dir = tmp_path / "base"
    tiny().save_pretrained(base_dir)
    model, _ = linearize.load_model(str(base_dir))
    linearize.convert(model, spec)
    for p in linearize.new_parameters(model).values():  # make them differ from the initialisation
        p.add_(0.01 * torch.randn_like(p))
    ids, mask = padded_batch(model.config.vocab_size, [9, 6])
    ref = model(ids, attention_mask=mask).logits

    model.save_pretrained(tmp_path / "full")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    assert loaded.config.linearize == model.config.linearize
    assert torch.equal(loaded(ids, attention_mask=mask).logits, ref)
    again, tok = linearize.load_model(str(tmp_path / "full"))
    assert torch.equal(again.eval()(ids, attention_mask=mask).logits, ref)

    linearize.save_adapter(model, tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter.safetensors", "linearize_adapter.json"]
    adapted, _ = linearize.load_model(str(tmp_path / "adapter"))
    assert torch.equal(adapted.eval()(ids, attention_mask=mask).logits, ref)


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft wrapping, below
def test_adapter_copied_in_bfloat16_loads_as_the_rounded_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the copy names its base model "base": found relative to here
    tiny().save_pretrained(tmp_path / "base")
    model, _ = linearize.load_model(str(tmp_path / "base"))
    linearize.convert(model, {"attention": "hybrid", "window": 4, "mix": "gate", "learn_gate": True})
    for p in linearize.new_parameters(model).values():
        p.add_(0.01 * torch.randn_like(p))
    linearize.save_adapter(model, tmp_path / "adapter", extra={"data": {"cache": str(tmp_path / "cache.pt")}})

    copied = linearize.api.copy_adapter(tmp_path / "adapter", tmp_path / "bf16")
    meta = json.loads((copied / "linearize_adapter.json").read_text())
    assert meta["base_model"] == "base" and meta["data"]["cache"] == "cache.pt"  # no machine paths left
    assert meta["storage_dtype"] == "bfloat16"
    for p in linearize.new_parameters(model).values():  # what the copy holds: each weight rounded once
        p.copy_(p.to(torch.bfloat16).float())
    ids, mask = padded_batch(model.config.vocab_size, [9, 6])
    adapted, _ = linearize.load_model(str(copied))
    assert torch.equal(adapted.eval()(ids, attention_mask=mask).logits, model.eval()(ids, attention_mask=mask).logits)
    with pytest.raises(FileNotFoundError, match="holds no adapter"):
        linearize.api.copy_adapter(tmp_path / "base", tmp_path / "not-an-adapter")

    # a run started from that adapter names it as its base; the copy stands alone on the teacher
    child, _ = linearize.load_model(str(tmp_path / "adapter"))
    for p in linearize.new_parameters(child).values():
        p.add_(0.01 * torch.randn_like(p))
    linearize.save_adapter(child, tmp_path / "child", base_model=str(tmp_path / "adapter"))  # as `train --model` does
    meta = json.loads((linearize.api.copy_adapter(tmp_path / "child", tmp_path / "child-bf16") / "linearize_adapter.json").read_text())
    assert meta["base_model"] == "base" and meta["started_from"] == ["adapter"]
    for p in linearize.new_parameters(child).values():
        p.copy_(p.to(torch.bfloat16).float())
    alone, _ = linearize.load_model(str(tmp_path / "child-bf16"))
    assert torch.equal(alone.eval()(ids, attention_mask=mask).logits, child.eval()(ids, attention_mask=mask).logits)
    assert json.loads((linearize.save_adapter(child, tmp_path / "default") / "linearize_adapter.json").read_text())["base_model"] == str(tmp_path / "base")

    # a parent with LoRA: its merged q/k/v/o are part of what a child trains on
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    linearize.save_adapter(wrapped, tmp_path / "with-lora")
    merged, _ = linearize.load_model(str(tmp_path / "with-lora"))
    default = linearize.save_adapter(merged, tmp_path / "child-of-lora")  # its base defaults to the LoRA adapter
    assert json.loads((default / "linearize_adapter.json").read_text())["base_model"] == str(tmp_path / "with-lora")
    again, _ = linearize.load_model(str(default))
    assert torch.equal(again.eval()(ids, attention_mask=mask).logits, merged.eval()(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="cannot stand alone"):
        linearize.api.copy_adapter(default, tmp_path / "refused")


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft wrapping, below
def test_adapter_on_a_shipped_conversion_loads_only_on_the_same_weights(tmp_path, monkeypatch):
    """A run started from a shipped conversion with LoRA (as LoLA from lolcats) is copied building
    on it by name, with its fingerprint; it loads as trained, and is refused once the shipped
    weights change."""
    import linearize.names
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    monkeypatch.chdir(tmp_path)
    shipped = tmp_path / "checkpoints"
    monkeypatch.setattr(linearize.names, "SHIPPED", ("tiny-shipped",))
    monkeypatch.setattr(linearize.names, "checkpoint_dir", lambda name: shipped / name)
    tiny().save_pretrained(tmp_path / "base")
    model, _ = linearize.load_model(str(tmp_path / "base"))
    linearize.convert(model, {"attention": "hybrid", "window": 4})
    for p in linearize.new_parameters(model).values():
        p.add_(0.01 * torch.randn_like(p))
    wrapped = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    linearize.save_adapter(wrapped, tmp_path / "parent-run")
    linearize.api.copy_adapter(tmp_path / "parent-run", shipped / "tiny-shipped")

    child, _ = linearize.load_model("tiny-shipped")
    linearize.convert(child, {"attention": "lola", "window": 4, "sparse_cache": 2, "chunk": 2})
    for p in linearize.new_parameters(child).values():
        p.add_(0.01 * torch.randn_like(p))
    linearize.save_adapter(child, tmp_path / "child")  # its base: the shipped name it was loaded by
    copied = linearize.api.copy_adapter(tmp_path / "child", tmp_path / "child-bf16")
    meta = json.loads((copied / "linearize_adapter.json").read_text())
    assert meta["base_model"] == "tiny-shipped"
    assert meta["base_fingerprint"] == linearize.api.adapter_fingerprint(shipped / "tiny-shipped")
    for p in linearize.new_parameters(child).values():
        p.copy_(p.to(torch.bfloat16).float())
    ids, mask = padded_batch(child.config.vocab_size, [9, 6])
    loaded, _ = linearize.load_model(str(copied))
    expected = child.eval()(ids, attention_mask=mask).logits
    assert torch.equal(loaded.eval()(ids, attention_mask=mask).logits, expected)

    # the child's LoRA (trained on the parent's merged weights) and the parent's, composed into one
    child_lora = get_peft_model(loaded, LoraConfig(r=3, lora_alpha=3, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    linearize.save_adapter(child_lora, tmp_path / "child-lora")
    with_lora = linearize.api.copy_adapter(tmp_path / "child-lora", tmp_path / "child-lora-bf16")
    chained, _ = linearize.load_model(str(with_lora))
    alone = linearize.api.stand_alone(with_lora, tmp_path / "alone")
    meta = json.loads((alone / "linearize_adapter.json").read_text())
    assert "base_fingerprint" not in meta and meta["base_model"] == "base" and meta["started_from"][0] == "tiny-shipped"
    assert meta["lora"]["r"] == 5 and meta["lora"]["lora_alpha"] == 5.0  # scales 2 and 1 differ: B carries them
    composed, _ = linearize.load_model(str(alone))
    chained_logits = chained.eval()(ids, attention_mask=mask).logits
    assert not torch.allclose(chained_logits, expected, atol=1e-3)  # the child's LoRA does change the model
    torch.testing.assert_close(composed.eval()(ids, attention_mask=mask).logits, chained_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not build on a shipped conversion with LoRA"):
        linearize.api.stand_alone(alone, tmp_path / "again")

    lora = load_file(str(shipped / "tiny-shipped" / "lora.safetensors"))
    name = sorted(lora)[0]
    save_file({**lora, name: lora[name] + 0.01}, str(shipped / "tiny-shipped" / "lora.safetensors"))
    with pytest.raises(ValueError, match="trained on top of the shipped conversion 'tiny-shipped' with fingerprint"):
        linearize.load_model(str(copied))
    with pytest.raises(ValueError, match="trained on another 'tiny-shipped'"):
        linearize.api.stand_alone(with_lora, tmp_path / "refused-alone")
    torch.testing.assert_close(linearize.load_model(str(alone))[0].eval()(ids, attention_mask=mask).logits, chained_logits,
                               atol=1e-5, rtol=1e-5)  # no longer needs the parent  # fmt: skip


def test_reconverting_keeps_trained_parameters_and_can_restore_teacher():
    model = convert(tiny(), {"attention": "hybrid", "window": 4}, None)
    fm = model.model.layers[0].self_attn.feature_map_q.weight
    with torch.no_grad():
        fm.add_(1.0)
    linearize.convert(model, {"attention": "lola", "window": 4, "sparse_cache": 2})
    assert torch.equal(model.model.layers[0].self_attn.feature_map_q.weight, fm)
    linearize.convert(model, {"layers": []})
    teacher = tiny()
    ids, mask = padded_batch(model.config.vocab_size, [7])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, teacher(ids).logits)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@torch.no_grad()
def test_other_llama_family_architectures(family):
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(0)
    model = (MistralForCausalLM(MistralConfig(**common)) if family == "mistral" else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    ids, mask = padded_batch(128, [9, 6])
    pos = positions(mask)
    ref = model(ids, attention_mask=mask, position_ids=pos).logits
    linearize.convert(model, {"attention": "softmax"})
    torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=pos).logits[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    linearize.convert(model, {"attention": "hybrid", "window": 3})
    assert model.config.model_type == f"linearize_{family}"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, ids.shape[1] + 3)


def test_bad_input_errors_name_the_value():
    model = tiny()
    with pytest.raises(linearize.SpecError, match="layer index 99 out of range"):
        linearize.convert(model, {"layers": [99]})
    with pytest.raises(linearize.SpecError, match="valid choices: softmax, hybrid, lola, dsla"):
        linearize.convert(model, {"attention": "mamba"})
    with pytest.raises(linearize.SpecError, match="window must be an integer >= 1"):
        linearize.convert(model, {"window": 0})
    with pytest.raises(linearize.SpecError, match="sparse_cache must be an integer >= 0"):
        linearize.convert(model, {"attention": "lola", "sparse_cache": -1})
    with pytest.raises(linearize.SpecError, match="unknown spec field"):
        linearize.convert(model, {"windw": 3})
    with pytest.raises(linearize.SpecError, match=r"sinks must be an integer in \[0, sparse_cache=2\], got 3"):
        linearize.convert(model, {"attention": "lola", "sparse_cache": 2, "sinks": 3})
    with pytest.raises(linearize.SpecError, match=r"\['linear_weight'\] do not apply to attention 'hybrid'"):
        linearize.convert(model, {"attention": "hybrid", "linear_weight": 0.5})
    linearize.convert(model, {"attention": "dsla", "layers": [0]})
    with pytest.raises(ValueError, match="valid modes: hybrid, history_only, recent_only, sinks_only, none"):
        linearize.set_mode(model, "swa_only")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        linearize.set_mode(model, "fast")
    with pytest.raises(linearize.SpecError, match="layer 1 is not converted"):
        linearize.set_mode(model, "none", layers=[1])


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(linearize.UnsupportedModelError, match="unsupported architecture 'gpt2'; supported: llama, mistral, qwen2"):
        linearize.convert(model, {"attention": "hybrid"})


@torch.no_grad()
def test_teacher_mode_runs_the_original_attention_with_plain_kv():
    teacher = tiny()
    model = convert(tiny(), {"attention": "dsla"}, None)
    linearize.set_mode(model, "teacher", layers=[1])
    linearize.set_mode(model, "teacher", layers=[0, 2])
    ids, mask = padded_batch(model.config.vocab_size, [9, 6])
    pos = positions(mask)
    assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, teacher(ids, attention_mask=mask, position_ids=pos).logits)
    cache = DynamicCache()
    model(ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache))
    assert not any(isinstance(layer, StateCacheLayer) for layer in cache.layers)
    assert model.model.layers[0].self_attn.gate_history.up.bias.requires_grad  # parameters kept


def test_shipped_names_resolve_or_say_they_are_not_shipped_yet():
    from linearize.api import SHIPPED, shipped_path

    assert shipped_path("smollm2-135m") is None
    for name in SHIPPED:
        try:
            path = shipped_path(name)
        except ValueError as err:
            assert f"conversion {name!r} has not been trained and shipped yet" in str(err)
        else:
            assert (path / "linearize_adapter.json").is_file()


@pytest.mark.parametrize("name", ["hybrid-joint", "lola", "dsla", "dsla-identity"])
@torch.no_grad()
def test_bfloat16_model_runs_with_float32_new_parameters(name):
    """Shipped conversions load into bf16 models on GPUs: the new float32 modules must accept it."""
    spec, mode = VARIANTS.get(name) or ({"attention": "dsla", "feature_map": "identity"}, None)
    model = convert(tiny().to(torch.bfloat16), spec, mode)
    ids, mask = padded_batch(model.config.vocab_size, [7, 5])
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits[mask.bool()].float()).all()


@pytest.mark.parametrize("linear_rope,mode,rotates", [(False, "hybrid", False), (False, "recent_only", False), (True, "hybrid", True),
                                                       (False, "sinks_only", True)], ids=str)  # fmt: skip
@torch.no_grad()
def test_dsla_skips_rope_only_where_its_mode_reads_no_rotated_qk(monkeypatch, linear_rope, mode, rotates):
    """A DSLA mode that reads only q/k before RoPE does not compute RoPE, and gives the same
    logits as with RoPE computed and ignored."""
    from linearize.layers import base

    model = convert(tiny(), {"attention": "dsla", "linear_rope": linear_rope}, mode)
    ids, mask = padded_batch(model.config.vocab_size, [9, 6])
    pos = positions(mask)
    calls = []
    apply_rope = base.apply_rope
    monkeypatch.setattr(base, "apply_rope", lambda *a: calls.append(1) or apply_rope(*a))
    got = model(ids, attention_mask=mask, position_ids=pos).logits
    assert bool(calls) == rotates
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "reads_rotated", lambda mode: True)
    assert torch.equal(got, model(ids, attention_mask=mask, position_ids=pos).logits)

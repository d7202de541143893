"""lola: the joint, non-overlapping hybrid plus a sparse cache kept by self-recall error (LoLA)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_int, is_int
from ..ops.lola import RECALLS, LolaDecodeState, lola_attention, lola_decode_step, lola_state_empty
from ..ops.states import LolaState
from .base import STATE_BYTES, AttentionKind, Attend, SpecError, expect_state, head_sizes
from .feature_map import HedgehogFeatureMap
from .hybrid import WindowedLinearAttention, WindowOptions, linear_state_bytes, window_bytes


@dataclass
class LolaOptions(WindowOptions):
    """Spec fields of a LoLA layer (its mix is always joint and non-overlapping)."""

    sparse_cache: int = 0
    """LoLA's lambda: sparse global cache slots per head."""
    sinks: int = 0
    """The first ``sinks`` tokens of a sequence never leave the sparse cache (attention sinks, as in
    StreamingLLM); they take ``sinks`` of its ``sparse_cache`` slots."""
    linear_weight: float | list[float] = 1.0
    """Weight of the linear state's term in the shared numerator and denominator (1 is the trained
    hybrid's read; below 1 keeps the linear term from swamping the explicit entries): one number, or
    one per query head (``linearize calibrate`` fits them)."""
    linear_weight_tokens: int = 0
    """N > 0: a query that reads n > N tokens through the linear term reads it with ``linear_weight``
    x N / n (the term sums over those tokens, so without this its weight against the explicit entries
    grows with the context; e.g. N = the tokens it reads at the length the weights were calibrated
    at); 0: never."""
    chunk: int = 16
    """LoLA's prefill chunk length C (queries of a chunk share the linear state)."""
    recall: str = "state"
    """What decides which tokens the sparse cache keeps: "state" (LoLA: each candidate's self-recall
    error against the linear state) or "memory" (the smaller of that and how well the older
    candidates recall it, so a repeated token is not held twice; decoding runs the torch step)."""
    keep_recalls: bool = False
    """Decoding with the fused step (CUDA): true keeps 4 floats per sparse-cache slot and query head
    (v . phi S, |phi S|^2 and phi z of its key and value) and updates them with each token's write, so
    a slot's self-recall error does not read the linear state; false (the default) scores every slot
    against the state each token. The same choices either way (up to rounding). On an H100, for a
    Llama-3-8B-shaped layer at 32K, true took the batch-64 step from 0.333 to 0.263 of softmax's and
    the tokens/s at equal memory from 6.30x to 8.06x the teacher's, and at SmolLM2's shape from 16.0x
    to 19.1x (both with blocks of 64 candidates; against a teacher decoding with a masked matmul: 4.9x
    and 8.3x against its flash-decoding); at batch 1 it was about 6 in 100 slower, for 1.05x
    the memory per request."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.keep_recalls, bool):
            raise SpecError(f"keep_recalls must be true or false, got {self.keep_recalls!r}")
        check_int("sparse_cache", self.sparse_cache, 0, error=SpecError)
        check_int("chunk", self.chunk, 1, error=SpecError)
        check_int("linear_weight_tokens", self.linear_weight_tokens, 0, error=SpecError)
        if self.recall not in RECALLS:
            raise SpecError(f"recall must be one of {RECALLS}, got {self.recall!r}")
        if not is_int(self.sinks) or not 0 <= self.sinks <= self.sparse_cache:
            raise SpecError(f"sinks must be an integer in [0, sparse_cache={self.sparse_cache}], got {self.sinks!r}")
        w = self.linear_weight
        values = list(w) if isinstance(w, (list, tuple)) else [w]
        if not values or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 for x in values):
            raise SpecError(f"linear_weight must be a number >= 0 or a list of them (one per query head), got {w!r}")
        if isinstance(w, tuple):
            self.linear_weight = list(w)


class LolaAttention(WindowedLinearAttention):
    """Three memories per head: window, sparse cache (top lambda by self-recall error), linear state.
    The same parameters as a joint hybrid layer, so a trained hybrid can be read with LoLA."""

    def attend_modes(self):
        return {
            "hybrid": self._lola(read_state=True, read_sparse=True),
            "no_state": self._lola(read_state=False, read_sparse=True),
            "no_sparse": self._lola(read_state=True, read_sparse=False),
            "window_only": self._lola(read_state=False, read_sparse=False),
        }

    READS = {"hybrid": (True, True), "no_state": (False, True), "no_sparse": (True, False), "window_only": (False, False)}
    """Mode -> (read_state, read_sparse)."""

    def has_static_decoding(self) -> bool:
        return self.mode in self.READS

    def static_decode_state(self, slot, batch: int, device, dtype, clock=None) -> LolaDecodeState:
        state = expect_state(slot.state, LolaState, self)
        o = self.options
        if state is None:  # nothing prefilled: the empty memory
            state = lola_state_empty(batch, self.num_heads, self.num_kv_heads, o.window, o.sparse_cache, self.head_dim, self.head_dim,
                                     o.features(self.head_dim), device, linear_keys=self.separate_linear_inputs)  # fmt: skip
        read_state, read_sparse = self.READS[self.mode]
        phi_k = self.feature_map_k
        key_map = (phi_k.weight, phi_k.bias) if isinstance(phi_k, HedgehogFeatureMap) else None  # for the fused step's key features
        return LolaDecodeState.from_state(
            state, phi_q=self.feature_map_q, phi_k=phi_k, window_factor=self.window_factor(), scale=self.scaling,
            dtype=dtype, read_state=read_state, read_sparse=read_sparse, sinks=o.sinks, linear_weight=o.linear_weight,
            weight_tokens=o.linear_weight_tokens, key_map=key_map, recall=o.recall, keep_recalls=o.keep_recalls)  # fmt: skip

    def decode_step(self, x, position_embeddings, slot):
        """The per-token path (``lola_decode_step``, memory updated in place): on the slot's decode
        state, made from its state before the first token (and kept by static decoding); None in a
        mode without it (the general op decodes)."""
        reads = self.READS.get(self.mode)
        if reads is None:
            return None
        ds = slot.decode_state
        if not isinstance(ds, LolaDecodeState):
            ds = self.static_decode_state(slot, x.shape[0], x.device, x.dtype)
        elif (ds.context.read_state, ds.context.read_sparse) != reads:
            return None  # (a mode switched since: the general op reads the state in the new mode)
        p = self.project(x, position_embeddings)
        out = lola_decode_step(ds, p.q, p.k, p.v, **self.linear_inputs(p))
        slot.advance(ds, 1)
        return out

    def _lola(self, *, read_state: bool, read_sparse: bool) -> Attend:
        def attend(p, x, valid, state):
            return self.lola(p, valid, state, read_state=read_state, read_sparse=read_sparse)

        return attend

    def lola(self, p, valid=None, state=None, *, read_state: bool = True, read_sparse: bool = True, linear_weight=None):
        """``lola_attention`` on projected inputs ``p`` with this layer's weights and options;
        ``linear_weight`` (one number or one per query head) replaces the option's for this call."""
        o = self.options
        return lola_attention(
            p.q, p.k, p.v,
            phi_q=self.feature_map_q, phi_k=self.feature_map_k,
            window=o.window, sparse=o.sparse_cache, window_factor=self.window_factor(),
            chunk=o.chunk, valid=valid, state=expect_state(state, LolaState, self), scale=self.scaling,
            read_state=read_state, read_sparse=read_sparse,
            sinks=o.sinks, linear_weight=o.linear_weight if linear_weight is None else linear_weight,
            weight_tokens=o.linear_weight_tokens, recall=o.recall,
            **self.linear_inputs(p),
        )


def lola_memory(options: LolaOptions, config, dtype_bytes: int) -> tuple[int, int]:
    """Window + linear state as a hybrid, plus the sparse cache (which keeps keys before RoPE too:
    its entries' self-recall error and write need them). The method's memory: decoding with the
    fused step (CUDA) and ``keep_recalls`` also keeps each cache slot's recall, sparse_cache x 4
    float32 per query head more, and one pending write (``fused_lola``'s default scalar recalls; more
    with its vector recalls or kept features) (``ops.lola.LolaDecodeState``; the capacity
    benchmark measures the decode state itself)."""
    h, _, head_dim = head_sizes(config)
    sparse = options.sparse_cache * (2 + (not options.linear_rope)) * h * head_dim * STATE_BYTES
    return 0, window_bytes(options, config) + sparse + linear_state_bytes(options, config)


KIND = AttentionKind(
    name="lola",
    layer=LolaAttention,
    options=LolaOptions,
    state=LolaState,
    modes=("hybrid", "no_state", "no_sparse", "window_only"),
    ablation_modes=("hybrid", "no_state", "no_sparse", "window_only"),
    memory=lola_memory,
    diagnostics=("self_recall", "attention_mass"),
    description="hybrid + sparse cache chosen by self-recall error (LoLA)",
)

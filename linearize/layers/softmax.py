"""softmax: the teacher's causal softmax, re-implemented over a KVState (reference and diagnostics host)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.softmax import softmax_attention
from ..ops.states import KVState
from .base import AttentionKind, ConvertedAttention, KindOptions, expect_state, head_sizes


@dataclass
class SoftmaxOptions(KindOptions):
    """The softmax kind has no fields of its own."""


class SoftmaxAttention(ConvertedAttention):
    """The teacher's causal softmax over a KVState."""

    def attend_modes(self):
        def softmax(p, x, valid, state):
            return softmax_attention(p.q, p.k, p.v, valid=valid, state=expect_state(state, KVState, self), scale=self.scaling)

        return {"hybrid": softmax}


def kv_memory(options, config, dtype_bytes: int) -> tuple[int, int]:
    """Keys and values of every token, in the model dtype."""
    _, hkv, head_dim = head_sizes(config)
    return 2 * hkv * head_dim * dtype_bytes, 0


KIND = AttentionKind(
    name="softmax",
    layer=SoftmaxAttention,
    options=SoftmaxOptions,
    state=KVState,
    modes=("hybrid",),
    ablation_modes=("hybrid", "sinks_only", "none"),
    memory=kv_memory,
    description="the teacher's attention, re-implemented",
)

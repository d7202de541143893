"""`linearize info`: what a (converted) model is made of and what it holds per request."""

from __future__ import annotations

import json

from .convert import converted_layers, new_parameters
from .memory import running_memory
from .modeling import decoder_layers


def model_info(model, *, as_json: bool = False, dtype_bytes: int | None = None) -> str:
    config = model.config
    layers = decoder_layers(model)
    converted = converted_layers(model)
    memories = running_memory(model, dtype_bytes)
    rows = []
    for i, mem in enumerate(memories):
        spec = converted[i].spec if i in converted else None
        rows.append({
            "layer": i,
            "attention": spec.attention if spec else "teacher",
            "mode": converted[i].mode if i in converted else "-",
            "kv_bytes_per_token": mem.per_token,
            "state_bytes": mem.fixed,
        })
    total = sum(p.numel() for p in model.parameters())
    new = sum(p.numel() for p in new_parameters(model).values())
    info = {
        "model_type": config.model_type,
        "base_model": getattr(config, "linearize_base_model", None),
        "layers": len(layers),
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "parameters": total,
        "new_parameters": new,
        "spec": getattr(config, "linearize", None),
        "per_layer": rows,
    }
    if as_json:
        return json.dumps(info, indent=2)
    lines = [
        f"model type     {info['model_type']}  (base: {info['base_model']})",
        f"layers         {info['layers']}  heads {info['heads']}  kv heads {info['kv_heads']}  head dim {info['head_dim']}",
        f"parameters     {total:,}  (new from conversion: {new:,})",
        f"spec           {json.dumps(info['spec']) if info['spec'] else 'none (teacher)'}",
        "",
        f"{'layer':>5}  {'attention':<9}  {'mode':<11}  {'KV bytes/token':>14}  {'state bytes':>11}",
    ]
    for r in rows:
        lines.append(f"{r['layer']:>5}  {r['attention']:<9}  {r['mode']:<11}  {r['kv_bytes_per_token']:>14,}  {r['state_bytes']:>11,}")
    kv = sum(r["kv_bytes_per_token"] for r in rows)
    state = sum(r["state_bytes"] for r in rows)
    lines.append(f"{'total':>5}  {'':<9}  {'':<11}  {kv:>14,}  {state:>11,}")
    lines.append(f"memory per request at 1K / 8K tokens: {(kv * 1024 + state) / 2**20:.2f} / {(kv * 8192 + state) / 2**20:.2f} MiB")
    return "\n".join(lines)

"""Held-out loss of the teacher and every shipped conversion, as a fresh CPU machine loads them.

    python scripts/shipped_heldout.py --out docs/results/shipped_heldout.json [--models NAME_OR_DIR ...] [--source essays]

Same held-out documents as the training recipes (wiki, seq_len 1024, seed 0, every held-out row),
float32 on CPU. dsla-chained is measured at several active prefixes. ``--source`` measures on
another source's held-out documents instead (essays: out of the training domain).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import linearize
from linearize.api import SHIPPED
from linearize.io import atomic_write_text
from linearize.data import DataConfig, build_dataset
from linearize.train.finetune import heldout_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dsla-prefixes", default="0,5,10,15,20,25,30")
    parser.add_argument("--source", default="wiki", help="held-out data source (default wiki, the training source)")
    parser.add_argument("--models", nargs="+", help="only these (names or adapter dirs) instead of the teacher and every shipped one")
    args = parser.parse_args()
    rows = []
    teacher, tokenizer = linearize.load_model("smollm2-135m")
    heldout = build_dataset(DataConfig(source=args.source, seq_len=1024), tokenizer).heldout

    def measure(name: str, model, **extra) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            loss = heldout_loss(model.eval(), heldout, batch_size=args.batch_size, max_batches=None, device="cpu")
        rows.append({"model": name, **extra, "source": args.source, "heldout_loss": loss, "heldout_ppl": math.exp(loss),
                     "tokens": int(heldout.numel()), "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
        atomic_write_text(args.out, json.dumps(rows, indent=2))

    if args.models:
        for name in args.models:
            model, _ = linearize.load_model(name)
            measure(name, model)
        return
    measure("smollm2-135m", teacher)
    del teacher
    for name in SHIPPED:
        if name.endswith("dsla-chained"):
            for k in [int(x) for x in args.dsla_prefixes.split(",")]:
                model, _ = linearize.load_model(name, active=k)
                measure(name, model, active=k)
        else:
            model, _ = linearize.load_model(name)
            measure(name, model)


if __name__ == "__main__":
    main()

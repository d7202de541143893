"""Two GPU-only questions, answered on the real model (run on a GPU machine):

1. LoLA retrieval: the trained lolcats conversion with a LoLA window of 1,024 and no sparse cache is
   exact softmax at 1K (the window holds prompt and answer). CPU retrieves 10/10 niah_single_1
   needles; the GPU scored 0. Here: niah_single_1 @ 1024 on CUDA in float32 and bfloat16, batched
   (left padding) and one prompt at a time, and the last-position logits of the converted model
   against the teacher (every converted layer in 'teacher' mode) on the same prompt.
2. DSLA prefill: 1.6 s at 1K and 10 s at 8K in the session-3 benchmark. Here: one untrained DSLA
   prefill at 1K and 4K with the resolved kernel named, and the top CUDA kernels and CPU ops of a
   profiled 1K prefill.

    python scripts/gpu_probe.py [--skip-lola] [--skip-dsla]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import linearize
from linearize.convert import converted_layers
from linearize.eval.synthetic import generate_samples, run_synthetic
from linearize.train.transfer import teacher_modes

log = logging.getLogger("gpu_probe")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def lola_probe(samples: int, device: str) -> None:
    lola = {"attention": "lola", "window": 1024, "sparse_cache": 0, "chunk": 64, "kernel": "torch"}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = linearize.load_model("smollm2-135m-lolcats", device=device, dtype=dtype)
        linearize.convert(model, lola)
        for n, batch in ((samples, samples), (3, 1)):  # batched with left padding, then 3 prompts one at a time
            result = run_synthetic(model, tok, ["niah_single_1"], [1024], n, batch_size=batch, device=device, examples=2)
            r = result["niah_single_1"][1024]
            log.info("LoLA w1024 s0 %s batch %d: niah_single_1 @ 1024 = %.1f (n=%d) e.g. %s", dtype, batch, r["score"], r["n"],
                     [e["prediction"][:40] for e in r["examples"]])
        sample = generate_samples("niah_single_1", tok, 1024, 1)[0]
        ids = torch.tensor([tok(sample.prompt)["input_ids"]], device=device)
        with torch.no_grad():
            got = model(input_ids=ids).logits[0, -1].float()
            with teacher_modes(model):
                want = model(input_ids=ids).logits[0, -1].float()
        log.info("LoLA w1024 s0 %s: last-position logits vs teacher mode: max |diff| %.4f, argmax %d vs %d",
                 dtype, (got - want).abs().max().item(), got.argmax().item(), want.argmax().item())
        layer = next(iter(converted_layers(model).values()))
        log.info("layer 0 spec %s mode %s", layer.spec, layer.mode)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def dsla_probe(device: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from linearize.layers.base import resolve_kernel

    model, _ = linearize.load_model("smollm2-135m", device=device)
    linearize.convert(model, {"attention": "dsla"})
    layer = next(iter(converted_layers(model).values()))
    log.info("DSLA spec %s resolved kernel %s", layer.spec, resolve_kernel(layer.options.kernel, torch.device(device)))
    for length in (1024, 4096):
        ids = torch.randint(0, 1000, (1, length), device=device)
        with torch.inference_mode():
            for i in range(3):
                sync(device)
                start = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                sync(device)
                log.info("DSLA prefill %d, call %d: %.1f ms", length, i, 1e3 * (time.perf_counter() - start))
    ids = torch.randint(0, 1000, (1, 1024), device=device)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
    log.info("DSLA 1K prefill by CUDA time:\n%s", prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    log.info("DSLA 1K prefill by CPU time:\n%s", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-lola", action="store_true")
    parser.add_argument("--skip-dsla", action="store_true")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.skip_dsla:
        dsla_probe(args.device)
    if not args.skip_lola:
        lola_probe(args.samples, args.device)


if __name__ == "__main__":
    main()

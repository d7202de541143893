"""The runner: rows at different conversion levels in one batch give what each request gives alone."""

import pytest
import torch

from linearize.convert import convert, set_active
from linearize.hub import build_tiny_llama
from linearize.serve.levels import LevelMemory
from linearize.serve.runner import Runner
from linearize.spec import ConversionSpec

ORDER = [2, 0, 3]  # layer 1 is never converted


def family():
    model = build_tiny_llama(0, num_hidden_layers=4)
    spec = ConversionSpec.from_dict({"attention": "dsla", "layers": ORDER, "order": ORDER})
    convert(model, spec)
    return model, LevelMemory.from_spec(spec, model.config, dtype_bytes=4)


def reference_logits(model, ids: torch.Tensor, level: int) -> torch.Tensor:
    """(T, vocab) logits of one request run alone through the model with ``level`` layers active."""
    set_active(model, level)
    with torch.inference_mode():
        return model(input_ids=ids[None]).logits[0].float()


def test_mixed_levels_in_one_batch_equal_each_request_alone():
    model, levels = family()
    runner = Runner(model, levels)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen) for n in (9, 4, 13)]
    seqs = [runner.new_sequence(level) for level in (0, 2, 3)]
    got = [[] for _ in prompts]
    for s, prompt, out in zip(seqs, prompts, got):  # prefill, the last prompt in two chunks
        chunks = [prompt[:8], prompt[8:]] if len(prompt) > 8 else [prompt]
        for chunk in chunks:
            logits = runner.forward([s], chunk[None])
        out.append(logits[0])
    tokens = [torch.randint(3, 128, (5,), generator=gen) for _ in prompts]  # forced continuations
    for step in range(5):
        logits = runner.forward(seqs, torch.stack([t[step] for t in tokens])[:, None])
        for b in range(3):
            got[b].append(logits[b])
    for b, (level, prompt) in enumerate(zip((0, 2, 3), prompts)):
        want = reference_logits(model, torch.cat([prompt, tokens[b]]), level)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(got[b]), want, rtol=1e-4, atol=1e-4)
    assert [s.position for s in seqs] == [14, 9, 18]


def test_sequence_bytes_match_the_level_formula():
    model, levels = family()
    runner = Runner(model, levels)
    for level in range(4):
        s = runner.new_sequence(level)
        runner.forward([s], torch.randint(3, 128, (1, 11)))
        runner.forward([s], torch.randint(3, 128, (1, 1)))
        assert s.nbytes() == levels.bytes(level, 12)


def test_runner_rejects_bad_rows_and_levels():
    model, levels = family()
    runner = Runner(model, levels)
    with pytest.raises(ValueError, match=r"level must be an integer in 0\.\.3"):
        runner.new_sequence(4)
    with pytest.raises(ValueError, match="one row per sequence"):
        runner.forward([runner.new_sequence()], torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_on_device_gives_the_values(device):
    """The runners' host-to-device index copies (pinned and not blocking on CUDA) hold the values."""
    from linearize.serve.runner import on_device

    x = on_device([[3, 1], [4, 1]], device)
    assert x.device.type == device and x.dtype == torch.long and x.tolist() == [[3, 1], [4, 1]]

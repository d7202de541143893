"""Sampling parameters validate; samplers are per-request reproducible; stop strings stream correctly."""

import math

import pytest
import torch

from linearize.serve.sampling import SamplingParams, StopChecker, filter_logits, make_generator, sample


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", 2.5), ("temperature", -0.1), ("temperature", 3),
                                         ("temperature", math.nan), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("seed", -1),
                                         ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("max_tokens", True)])
def test_bad_params_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw))).tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_p=0.81) == [True, True, True, False]


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(50)
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, g) for g in [make_generator(params)] for _ in range(20)]
    b = [sample(logits, params, g) for g in [make_generator(params)] for _ in range(20)]
    assert a == b and len(set(a)) > 1
    assert sample(logits, SamplingParams(temperature=0.0), None) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=1e-300, top_p=1e-300), make_generator(params)) == int(logits.argmax())
    assert sample(logits * 1e30, SamplingParams(temperature=1e-5, top_p=1e-300), make_generator(params)) == int(logits.argmax())


def test_stop_checker_holds_back_possible_prefixes():
    checker = StopChecker(("END", "\n\n"))
    out = []
    for piece in ["Hello E", "N", "x world\n", "\nafter"]:
        text, stopped = checker.feed(piece)
        out.append(text)
        if stopped:
            break
    assert out[:2] == ["Hello ", ""]  # "E", then "EN", held back: they may start "END"
    assert "".join(out) == "Hello ENx world" and stopped
    checker = StopChecker(("END",))
    assert checker.feed("a EN") == ("a ", False) and checker.feed("D b") == ("", True)
    checker = StopChecker(("END",))
    assert checker.feed("abcE") == ("abc", False)
    assert checker.flush() == "E"
    assert StopChecker(()).feed("xyz") == ("xyz", False)

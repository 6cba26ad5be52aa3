"""Sampler and detokenizer on hand-made logits and the real SmolLM2 tokenizer."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, apply_penalties, filter_top_k_top_p_min_p
from splitserve.engine.sampling_params import SamplingParams

NEG = float("-inf")


def test_top_k_keeps_the_k_largest() -> None:
    out = filter_top_k_top_p_min_p(torch.tensor([1.0, 4.0, 3.0, 2.0]), 2, 1.0, 0.0)
    assert out.tolist() == [NEG, 4.0, 3.0, NEG]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_top_k_top_p_min_p(logits, 0, 0.8, 0.0)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = filter_top_k_top_p_min_p(logits, 0, 0.81, 0.0)
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_min_p_drops_tokens_below_fraction_of_the_best() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    kept = filter_top_k_top_p_min_p(logits, 0, 1.0, 0.1)
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_penalties_follow_their_definitions() -> None:
    req = Request(
        "r",
        [0, 1],
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
    )
    req.output_token_ids = [2, 2, 3]
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 1.0])
    apply_penalties(logits, req)
    # token 0: repetition only; 1: negative -> multiplied; 2: /2 then -(2*0.5 + 0.25)
    assert logits.tolist() == [1.0, -4.0, 0.5 - 1.25, 0.5 - 0.75, 1.0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    req = Request("r", [0], SamplingParams(min_tokens=2, stop_token_ids=[3]), eos_token_ids=(1,))
    logits = torch.zeros(5)
    apply_penalties(logits, req)
    assert logits.tolist() == [0.0, NEG, 0.0, NEG, 0.0]


def test_seeded_rows_ignore_their_neighbours() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def draw(rows: list[int]) -> list[int]:
        reqs = [Request(str(r), [1], SamplingParams(temperature=1.0, seed=r)) for r in rows]
        return [s.token_id for s in Sampler(seed=0)(logits[rows], reqs)]

    assert draw([0, 1, 2])[1] == draw([1])[0]
    greedy = Request("g", [1], SamplingParams(temperature=0))
    assert Sampler(0)(logits[:1], [greedy])[0].token_id == int(logits[0].argmax())


def test_a_seeded_draw_depends_on_the_seed_and_the_token_index_alone() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))

    def draws(outputs: int, resumed: int = 0, seed: int = 7) -> list[int]:
        """The tokens drawn for output index outputs + resumed, over 20 draws of the sampler's
        own (shared) generator in between."""
        req = Request("r", [1] * (resumed + 1), SamplingParams(temperature=1.0, seed=seed))
        req.output_token_ids, req.num_resumed = [2] * outputs, resumed
        sampler = Sampler(seed=outputs)
        return [sampler(logits, [req])[0].token_id for _ in range(20)]

    third = draws(3)
    assert third == [third[0]] * 20  # no state carried from one draw to the next
    assert draws(3) == draws(0, resumed=3) == draws(1, resumed=2)
    assert len({draws(i)[0] for i in range(12)}) > 4  # the index moves the draw
    assert len({draws(3, seed=s)[0] for s in range(12)}) > 4  # and so does the seed


def test_incremental_detokenizer_matches_full_decode_with_multibyte_text(
    smollm2_tokenizer: Any,
) -> None:
    text = "Grüße aus Köln! 東京タワー 🚀🎉 naïve café — done."
    ids = smollm2_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm2_tokenizer, [1, 2, 3], stop=[])
    seen = []
    for token in ids:
        detok.add(token)
        visible = detok.visible_text(finished=False)
        assert "\ufffd" not in visible
        seen.append(visible)
    detok.flush()
    assert detok.text == smollm2_tokenizer.decode(ids)
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))


def test_stop_string_across_tokens_is_cut_and_never_shown(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], stop=["ma del", "zzzz"])
    found = None
    for token in ids:
        found = detok.add(token)
        assert "ma del" not in detok.visible_text(finished=False)
        if found:
            break
    assert found == "ma del"
    assert detok.visible_text(finished=True) == "alpha beta gam"

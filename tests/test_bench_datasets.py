"""Request generators of the load generator: lengths, structure, parsing, seeds."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitserve.bench import datasets
from splitserve.bench.datasets import BenchRequest, Message
from splitserve.bench.text import WORDS, Endpoint, TextSource
from splitserve.engine.loader import NumericTokenizer

WORDS_ONLY = TextSource()


@pytest.fixture(scope="module")
def tokenized() -> TextSource:
    """A word-level tokenizer over the fallback words: one word is one token."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    return TextSource(tokenizer)


def test_random_prompts_have_exact_token_lengths_with_a_tokenizer(tokenized: TextSource) -> None:
    reqs = datasets.random_dataset(tokenized, 20, 30, 7, 0.0, seed=0)
    assert [tokenized.prompt_len(r.messages, "completions") for r in reqs] == [30] * 20
    assert [r.output_len for r in reqs] == [7] * 20
    assert all(len(r.messages) == 1 and r.messages[0].role == "user" for r in reqs)


def test_random_prompts_without_tokenizer_count_words() -> None:
    reqs = datasets.random_dataset(WORDS_ONLY, 5, 12, 3, 0.0, seed=0)
    assert [len(r.messages[0].content.split()) for r in reqs] == [12] * 5
    assert WORDS_ONLY.prompt_len(reqs[0].messages, "chat") is None


def test_random_range_ratio_bounds_lengths() -> None:
    reqs = datasets.random_dataset(WORDS_ONLY, 200, 100, 10, 0.5, seed=3)
    inputs = [len(r.messages[0].content.split()) for r in reqs]
    outputs = [r.output_len for r in reqs]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 20
    assert min(outputs) >= 5 and max(outputs) <= 15
    with pytest.raises(ValueError):
        datasets.random_dataset(WORDS_ONLY, 1, 10, 10, 1.0, seed=0)


def test_datasets_are_reproducible_from_the_seed() -> None:
    def build(seed: int) -> list[BenchRequest]:
        return datasets.random_dataset(WORDS_ONLY, 10, 20, 5, 0.3, seed)

    assert build(7) == build(7)
    assert build(7) != build(8)
    turns = datasets.multi_turn_dataset(WORDS_ONLY, 2, 3, 5, 4, seed=1)
    assert turns == datasets.multi_turn_dataset(WORDS_ONLY, 2, 3, 5, 4, seed=1)


def test_shared_prefix_has_n_system_prompts_times_m_users() -> None:
    reqs = datasets.shared_prefix_dataset(WORDS_ONLY, 3, 4, 20, 6, 9, seed=0)
    assert len(reqs) == 12
    systems = [r.messages[0].content for r in reqs]
    assert [r.messages[0].role for r in reqs] == ["system"] * 12
    assert len(set(systems)) == 3
    assert systems[:3] * 4 == systems  # user-major: every prefix active from the start
    assert len({r.messages[1].content for r in reqs}) == 12
    assert all(len(r.messages[1].content.split()) == 6 and r.output_len == 9 for r in reqs)


def test_multi_turn_context_grows_and_extends_the_previous_turn() -> None:
    reqs = datasets.multi_turn_dataset(WORDS_ONLY, 2, 3, 5, 4, seed=0)
    assert len(reqs) == 6
    assert [len(r.messages) for r in reqs] == [2, 2, 4, 4, 6, 6]  # turn-major order
    for conversation in (0, 1):
        turns = reqs[conversation::2]
        for earlier, later in itertools.pairwise(turns):
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert later.messages[len(earlier.messages)].role == "assistant"
            assert len(later.messages[len(earlier.messages)].content.split()) == 4
    assert reqs[0].messages[0] != reqs[1].messages[0]


def test_file_dataset_parses_prompts_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello there"}\n'
        "\n"
        '{"messages": [{"role": "system", "content": "be brief"},'
        ' {"role": "user", "content": "hi"}], "max_tokens": 5}\n'
    )
    reqs = datasets.file_dataset(path, output_len=32)
    assert reqs == [
        BenchRequest((Message("user", "hello there"),), 32),
        BenchRequest((Message("system", "be brief"), Message("user", "hi")), 5),
    ]


@pytest.mark.parametrize("line", ['{"text": "x"}', "not json", '{"prompt": 3}'])
def test_file_dataset_reports_the_bad_line_number(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match="line 2"):
        datasets.file_dataset(path, output_len=8)


def test_take_cycles_through_a_short_dataset() -> None:
    reqs = [BenchRequest((Message("user", str(i)),), 1) for i in range(3)]
    assert datasets.take(reqs, 7) == [*reqs, *reqs, reqs[0]]
    assert datasets.take(reqs, 2) == reqs[:2]


def test_render_for_completions_and_prompt_len_through_chat_template(
    tokenized: TextSource,
) -> None:
    single = (Message("user", "time year"),)
    pair = (Message("system", "day"), Message("user", "time year"))
    assert WORDS_ONLY.render(single) == "time year"
    assert WORDS_ONLY.render(pair) == "system: day\n\nuser: time year\n\nassistant:"
    assert tokenized.render(pair) == "<s> system day <s> user time year assistant"
    assert tokenized.prompt_len(single, "completions") == 2
    assert tokenized.prompt_len(single, "chat") == 5


def test_sample_len_stays_in_range() -> None:
    rng = random.Random(0)
    assert {datasets.sample_len(rng, 10, 0.0) for _ in range(10)} == {10}
    assert datasets.sample_len(rng, 1, 0.9) >= 1


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_generated_dataset_encodes_with_a_shape_tokenizer(endpoint: Endpoint) -> None:
    """A random-weight shape's tokenizer reads numbers only: every dataset's prompt, rendered
    for either endpoint, encodes to the counted length, and a shared system prompt (or an
    earlier turn) is a shared prefix of ids, which is what prefix caching reuses."""
    tokenizer = NumericTokenizer(vocab_size=512)
    shape = TextSource(tokenizer)
    random_reqs = datasets.random_dataset(shape, 3, 12, 4, 0.0, seed=0)
    shared = datasets.shared_prefix_dataset(shape, 2, 3, 40, 8, 4, seed=0)
    turns = datasets.multi_turn_dataset(shape, 2, 3, 10, 4, seed=0)
    for req in [*random_reqs, *shared, *turns]:
        ids = _server_ids(tokenizer, shape, req.messages, endpoint)
        assert len(ids) == shape.prompt_len(req.messages, endpoint)
        assert len(ids) == sum(len(m.content.split()) for m in req.messages)
    assert [len(_server_ids(tokenizer, shape, r.messages, endpoint)) for r in shared] == [48] * 6
    first, same_system = (
        _server_ids(tokenizer, shape, shared[i].messages, endpoint) for i in (0, 2)
    )
    assert first[:40] == same_system[:40] and first[40:] != same_system[40:]
    assert [len(_server_ids(tokenizer, shape, r.messages, endpoint)) for r in turns] == [
        20, 20, 34, 34, 48, 48,  # system + user, then each turn adds a reply (4) and a user (10)
    ]  # fmt: skip
    earlier, later = (_server_ids(tokenizer, shape, turns[i].messages, endpoint) for i in (0, 2))
    assert later[: len(earlier)] == earlier


def _server_ids(
    tokenizer: NumericTokenizer,
    source: TextSource,
    messages: tuple[Message, ...],
    endpoint: Endpoint,
) -> list[int]:
    """The ids the API server computes from what the load generator sends."""
    if endpoint == "completions":
        return tokenizer.encode(source.render(messages))
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert isinstance(ids, list)
    return ids

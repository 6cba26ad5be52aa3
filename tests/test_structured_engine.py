"""Structured outputs in the engine, on the real SmolLM2: constraints checked before they run,
outputs that satisfy them, greedy tokens equal to transformers under the same xgrammar mask,
and the same outputs batched with unconstrained requests, overlapped, and across the
prefill -> decode handoff."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from splitserve import LLM, SamplingParams, StructuredOutputsParams
from splitserve.engine.structured.grammar import (
    MAX_SOURCE_BYTES,
    GrammarCompiler,
    GrammarError,
    parse,
    settle_compiles,
)
from splitserve.engine.structured.matcher import RequestGrammar, apply_masks
from tests.support.handoff import disaggregated

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["sku", "price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ARITHMETIC = r"""
root ::= expr
expr ::= term ((" + " | " - ") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""
CHOICES = ["red", "green", "blue"]
ASK = "Describe a user of a web shop as JSON."


def greedy(max_tokens: int = 48, **spec: Any) -> SamplingParams:
    structured = StructuredOutputsParams(**spec)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured)


@pytest.fixture(scope="module")
def compiler(smollm2_llm: LLM) -> GrammarCompiler:
    engine = smollm2_llm.engine
    eos = list(engine.eos_token_ids)
    return GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, eos)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"regex": "([a-z"}, "invalid regex: Regex parsing error at position 6: Unclosed '['"),
        ({"grammar": 'root ::= "a" |'}, "invalid grammar: EBNF parser error at line 1"),
        ({"grammar": 'start ::= "a"'}, "invalid grammar: "),
        ({"json": {"type": "objec"}}, "invalid JSON schema: 'objec' is not valid"),
        ({"json": "{not json"}, "the JSON schema is not valid JSON: "),
        ({"json": {"type": "array", "minItems": -1}}, "invalid JSON schema: -1 is less than"),
        ({"json": {"type": "integer", "not": {"const": 3}}}, "unsupported JSON schema keyword"),
        (
            {
                "json": {
                    "type": "object",
                    "properties": {"a": {"type": "array", "uniqueItems": True}},
                }
            },
            "unsupported JSON schema keyword 'uniqueItems' at #/properties/a",
        ),
        ({"json": {"$ref": "http://example.com/s.json"}}, "unsupported JSON schema $ref"),
        (
            {"regex": "a" * (MAX_SOURCE_BYTES + 1)},
            "the regex is 65537 bytes, over the limit of 65536",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None,
)
def test_an_unusable_constraint_is_refused_with_its_reason(
    spec: dict[str, Any], reason: str
) -> None:
    with pytest.raises(GrammarError) as error:
        parse(StructuredOutputsParams(**spec))
    assert str(error.value).startswith(reason), str(error.value)
    assert "/project/cpp" not in str(error.value)


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}])
def test_structured_outputs_takes_exactly_one_constraint(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


def test_a_constraint_that_compiles_too_slowly_is_refused_then_the_next_compiles(
    compiler: GrammarCompiler,
) -> None:
    slow = StructuredOutputsParams(regex="[a-z]{1,1200}")  # about 0.2 s on this machine
    with pytest.raises(GrammarError, match=r"regex took longer than 0\.001 s to compile"):
        compiler.compile(slow, timeout_s=0.001)
    assert settle_compiles(0.0) == 1  # the refused compile goes on in its thread
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]+")) is not None
    assert settle_compiles(30.0) == 0  # what `splitserve serve` waits for before it exits


def test_compiled_grammars_are_cached_by_content(compiler: GrammarCompiler) -> None:
    first = compiler.compile(StructuredOutputsParams(json=PERSON))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON)))
    assert again is first
    assert compiler.compile(StructuredOutputsParams(json=ORDER)) is not first


def test_a_mask_leaves_rows_without_a_grammar_alone(compiler: GrammarCompiler) -> None:
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(choice=CHOICES)))
    logits = torch.randn(2, compiler.vocab_size)
    before = logits.clone()
    apply_masks(logits, [None, grammar])
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < 50
    assert torch.equal(logits[1, allowed], before[1, allowed])


class XGrammarMask(LogitsProcessor):
    """transformers' generate under a request's xgrammar matcher: the oracle's constraint."""

    def __init__(self, grammar: RequestGrammar, prompt_len: int) -> None:
        self.grammar, self.prompt_len = grammar, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.grammar.accept(int(input_ids[0, -1]))
        scores = scores.float().clone()
        apply_masks(scores, [self.grammar])
        return scores


@pytest.mark.parametrize(
    "spec", [{"json": PERSON}, {"regex": PHONE}, {"grammar": ARITHMETIC}], ids=str
)
def test_constrained_greedy_tokens_equal_transformers_under_the_same_mask(
    smollm2_llm: LLM, hf_smollm2: Any, compiler: GrammarCompiler, spec: dict[str, Any]
) -> None:
    params = greedy(40, **spec)
    prompt = smollm2_llm.apply_chat_template([{"role": "user", "content": ASK}])
    ours = smollm2_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert params.structured_outputs is not None
    mask = XGrammarMask(RequestGrammar(compiler.compile(params.structured_outputs)), len(prompt))
    eos = smollm2_llm.engine.eos_token_ids
    with torch.no_grad():
        out = hf_smollm2.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=40,
            do_sample=False,
            logits_processor=LogitsProcessorList([mask]),
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    assert ours == out[0, len(prompt) :].tolist()


def is_arithmetic(node: ast.AST) -> bool:
    """Python's parser read an ARITHMETIC sentence: sums and differences of integers."""
    if isinstance(node, ast.BinOp):
        plus_minus = isinstance(node.op, ast.Add | ast.Sub)
        return plus_minus and is_arithmetic(node.left) and is_arithmetic(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def check_outputs(texts: list[str], sampled: bool = False) -> None:
    """The texts of CASES, in order: each satisfies its constraint (sampled: the json_object
    text may be "", see run_cases)."""
    person, order, phone, colour, sum_, anything = texts
    jsonschema.validate(json.loads(person), PERSON)
    jsonschema.validate(json.loads(order), ORDER)
    assert re.fullmatch(PHONE, phone), phone
    assert colour in CHOICES
    assert is_arithmetic(ast.parse(sum_, mode="eval").body), sum_
    assert (sampled and anything == "") or isinstance(json.loads(anything), dict)


CASES = [
    ({"json": PERSON}, ASK),
    ({"json": ORDER}, "Write an order with two items as JSON."),
    ({"regex": PHONE}, "What is the phone number of the shop?"),
    ({"choice": CHOICES}, "Name a colour."),
    ({"grammar": ARITHMETIC}, "Write a sum of three numbers."),
    ({"json_object": True}, "Write a JSON object with a name and an age."),
]


def run_cases(
    llm: LLM, params_of: Callable[[dict[str, Any]], SamplingParams], sampled: bool = False
) -> list[str]:
    """CASES and one unconstrained prompt, in one batch: the constrained texts. sampled: the
    json_object case (the one unbounded constraint) may run to its length limit, and its
    text is then left out ("")."""
    conversations = [[{"role": "user", "content": ask}] for _, ask in CASES]
    conversations.append([{"role": "user", "content": ASK}])
    params = [params_of(spec) for spec, _ in CASES]
    params.append(SamplingParams(temperature=0, max_tokens=24))
    free = [o.outputs[0] for o in llm.chat(conversations, params, use_tqdm=False)]
    alone = llm.chat(conversations[-1], params[-1], use_tqdm=False)[0].outputs[0]
    assert free[-1].token_ids == alone.token_ids  # the constraints' neighbours are unchanged
    reasons = [o.finish_reason for o in free[:-1]]
    if sampled and reasons[-1] == "length":
        reasons[-1] = "stop"
        free[-2].text = ""
    assert reasons == ["stop"] * len(CASES), reasons
    return [o.text for o in free[:-1]]


@pytest.fixture(scope="module")
def greedy_texts(smollm2_llm: LLM) -> list[str]:
    return run_cases(smollm2_llm, lambda spec: greedy(120, **spec))


@pytest.fixture(scope="module")
def overlapped(make_llm: Callable[..., LLM]) -> LLM:
    """An engine that overlaps its decode steps, as a GPU decode worker does."""
    return make_llm(overlap_scheduling=True)


def test_greedy_outputs_satisfy_their_constraints_batched_with_a_free_request(
    greedy_texts: list[str],
) -> None:
    check_outputs(greedy_texts)


def test_sampled_outputs_satisfy_their_constraints(smollm2_llm: LLM) -> None:
    def sampled(spec: dict[str, Any]) -> SamplingParams:
        structured = StructuredOutputsParams(**spec)
        return SamplingParams(
            temperature=0.9, top_p=0.95, seed=7, max_tokens=160, structured_outputs=structured
        )

    check_outputs(run_cases(smollm2_llm, sampled, sampled=True), sampled=True)


def test_the_overlapped_engine_gives_the_same_constrained_outputs(
    overlapped: LLM, greedy_texts: list[str]
) -> None:
    assert run_cases(overlapped, lambda spec: greedy(120, **spec)) == greedy_texts
    before = overlapped.engine.num_overlapped_steps
    alone = overlapped.generate(ASK, greedy(40, json=PERSON), use_tqdm=False)[0].outputs[0]
    # Every decode step of a constrained request alone overlapped: one per token after the
    # prefill step's, and one launched before the last token was read (its token dropped).
    assert overlapped.engine.num_overlapped_steps - before == len(alone.token_ids)


def test_constrained_requests_through_the_handoff_equal_colocated(
    smollm2_llm: LLM, overlapped: LLM
) -> None:
    """Prefilled (the first token sampled under the grammar) on one engine, decoded on an
    overlapping one whose matcher resumes from that token."""
    prompts = [
        smollm2_llm.apply_chat_template([{"role": "user", "content": ask}]) for _, ask in CASES
    ]
    params = [greedy(120, **spec) for spec, _ in CASES]
    colocated = smollm2_llm.generate(prompts, params, use_tqdm=False)
    tokens = disaggregated(smollm2_llm.engine, overlapped.engine, prompts, params)
    assert [tokens[str(i)] for i in range(len(CASES))] == [
        o.outputs[0].token_ids for o in colocated
    ]

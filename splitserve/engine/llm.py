"""The offline API: ``LLM(model).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import resolve_model
from splitserve.engine.request import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.vision.chat_images import split_images
from splitserve.engine.vision.config import load_vision_config
from splitserve.engine.vision.encoder import VisionEncoder
from splitserve.engine.vision.image_inputs import image_hash
from splitserve.engine.vision.multimodal import ImageInput, expand_image_tokens
from splitserve.kvstore.hashing import ImageSpan

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        speculative_config: Mapping[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        """engine_args: EngineConfig's fields. speculative_config: vLLM's dict ("method",
        "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
        "dynamic"; engine/spec/config.py)."""
        if speculative_config is not None:
            engine_args["speculative"] = SpeculativeConfig.from_dict(speculative_config)
        self._attach(LLMEngine(EngineConfig(model=model, **engine_args)))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (for example one sharing a loaded tokenizer)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()
        self.vision: VisionEncoder | None = None
        path = resolve_model(engine.config.model)
        if load_vision_config(path) is not None:
            dtype = engine.runner.dtype
            self.vision = VisionEncoder(path, engine.config.device, dtype)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A list of ints is one tokenized prompt;
        params: one for all prompts, or one per prompt."""
        batch = _as_prompt_list(prompts)
        request_ids = []
        for prompt, prompt_params in zip(batch, _per_prompt(params, len(batch)), strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, prompt_params)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate.
        params: one for all conversations, or one per conversation.

        Messages may hold image content parts (engine/vision/chat_images.py) for a vision-language
        model: each image is encoded here and its embeddings fill its placeholder tokens."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        request_ids = []
        each = _per_prompt(params, len(conversations))
        for conversation, conversation_params in zip(conversations, each, strict=True):
            rendered, pictures = split_images(conversation)  # type: ignore[arg-type]
            prompt, images = self._with_images(self.apply_chat_template(rendered), pictures)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, conversation_params, images=images)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def _with_images(
        self, token_ids: list[int], pictures: list[Any]
    ) -> tuple[list[int], list[ImageInput]]:
        """Expand each image token to the encoder's tokens and attach the embeddings."""
        if not pictures:
            return token_ids, []
        if self.vision is None:
            raise ValueError("this model does not accept images")
        config = self.vision.config
        ids, spans = expand_image_tokens(token_ids, config.image_token_id, config.tokens_per_image)
        if len(spans) != len(pictures):
            raise ValueError(f"{len(pictures)} images but {len(spans)} image tokens in the prompt")
        embeddings = self.vision.encode(pictures)
        return ids, [
            ImageInput(ImageSpan(image_hash(picture), offset, length), embedding)
            for picture, (offset, length), embedding in zip(pictures, spans, embeddings)
        ]

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[request_id] for request_id in request_ids]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(p, int) for p in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]

"""Chat formats for GGUF files that carry no chat template, by the file's architecture.

Gemma 3's files (the 270M base model's among them) ship without one; Gemma writes a
conversation as turns, ``<start_of_turn>user\\n...<end_of_turn>\\n`` and
``<start_of_turn>model\\n...``, after ``<bos>``, a system message put at the head of the first
user turn (Gemma has no system role), and ends its own turn with ``<end_of_turn>``, where
generation stops as at EOS (Gemma's generation configs stop at both). The converted tokenizer
gets the template and that token, as ``eot_token`` (``loader.eos_token_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    template: str
    """A Jinja chat template as transformers renders them."""
    end_of_turn: str
    """The token that ends the model's turn."""


GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set state = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{%- set state.system = text + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n'"
    " + state.system + text + '<end_of_turn>\\n' }}"
    "{%- set state.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

FORMATS = {"gemma3": ChatFormat(GEMMA_TURNS, "<end_of_turn>")}
"""GGUF ``general.architecture`` -> its chat format."""

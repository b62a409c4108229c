"""Render conversations with the target's own chat template and derive assistant-only loss masks.

The mask marks exactly the tokens the target generates in assistant turns: the answer (and tool calls,
and thinking unless ``thinking_in_mask=False``) plus the end-of-turn token; the template's scaffolding
(role headers, BOS, the newline after an end-of-turn token) stays 0. Two ways, for any HF template:

* **generation markers** (``{% generation %}...{% endgeneration %}``): the rendered character spans the
  template marks are mapped to tokens through the tokenizer's offsets.
* **prefix diffing** (templates without markers): for each assistant message ``i`` the prompt
  ``messages[:i]`` rendered with ``add_generation_prompt=True`` must be a prefix of the full rendering,
  both as text and as tokens; the turn starts right after it and ends at the first end-of-turn token.
  End-of-turn ids are the tokenizer's eos ids, the generation config's, and the special token the
  template writes right after an assistant message (found by rendering a probe). A template or
  tokenizer that is not prefix-stable raises :class:`~data.sources.DataError` naming the conversation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fledge.data.prepare.sources import DataError

_MARKER_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A thinking block with the whitespace that separates it from the answer ("</think>\n\n"): with
# thinking out of the mask, the separator goes too (with thinking off, the serving prompt already ends in it).
_THINK_SPAN_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_PROBE = "fledge probe answer"


class ChatRenderer:
    """Tokenize normalised conversations (see data/prepare/sources.py) into ``(input_ids, loss_mask)``.

    ``tokenizer`` is the target's (a fast tokenizer: offsets are needed); ``extra_eot_ids`` adds ids
    that end a turn (e.g. the target's ``generation_config.eos_token_id``).
    """

    def __init__(self, tokenizer, last_turn_only: bool = False, thinking_in_mask: bool = True,
                 extra_eot_ids: Iterable[int] = ()):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__}: a fast tokenizer is needed (offsets map the mask)")
        self.tok = tokenizer
        try:
            self.template = tokenizer.get_chat_template()
        except ValueError as e:
            raise ValueError(f"the target's tokenizer has no chat template ({e}); set one in its "
                             "tokenizer_config.json / chat_template.jinja") from None
        self.has_markers = bool(_MARKER_RE.search(self.template))
        # Templates that read a reasoning field get it as a field; others see the thinking inline.
        self.reads_reasoning = any(k in self.template for k in ("reasoning_content", "thinking", "reasoning"))
        self.last_turn_only = last_turn_only
        self.thinking_in_mask = thinking_in_mask
        eos = tokenizer.eos_token_id
        self.eot_ids = set([eos] if isinstance(eos, int) else list(eos or [])) | set(extra_eot_ids)
        self.eot_ids |= self._probe_eot_ids()

    # ------------------------------------------------------------------ rendering
    def render(self, conversation: dict, add_generation_prompt: bool = False, template_kwargs: dict | None = None,
               upto: int | None = None, spans: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for ``messages[:upto]`` (all when None) and, with ``spans``, the character
        spans its generation markers enclose."""
        from transformers.utils.chat_template_utils import render_jinja_template

        msgs = [self._template_message(m) for m in conversation["messages"][:upto]]
        kwargs = {**self.tok.special_tokens_map, **(template_kwargs or conversation.get("template_kwargs") or {})}
        texts, gen = render_jinja_template(
            conversations=[msgs], tools=conversation.get("tools"), chat_template=self.template,
            return_assistant_tokens_mask=spans, add_generation_prompt=add_generation_prompt, **kwargs)
        return texts[0], (gen[0] if spans else [])

    def _template_message(self, m: dict) -> dict:
        m = {k: v for k, v in m.items() if v is not None}
        r = m.get("reasoning_content")
        if r is not None and not self.reads_reasoning:
            m.pop("reasoning_content")
            m["content"] = f"<think>\n{r}\n</think>\n\n{m['content']}"
        return m

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        backend = getattr(self.tok, "_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: same ids, ~3x less per-call overhead
            enc = backend.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    # ------------------------------------------------------------------ masks
    def encode(self, conversation: dict, where: str = "conversation") -> tuple[list[int], list[int]]:
        """``(input_ids, loss_mask)`` of the whole conversation; raises DataError naming ``where``."""
        try:
            if self.has_markers:
                text, spans = self.render(conversation, spans=True)
            else:
                text, spans = self.render(conversation)[0], None
        except DataError:
            raise
        except Exception as e:  # jinja errors, raise_exception() in the template, bad tool schemas
            raise DataError(where, f"the chat template failed to render it ({type(e).__name__}: {e})") from None
        ids, offsets = self._encode(text)
        if spans is None:
            spans = self._diff_spans(conversation, text, ids, offsets, where)
        elif not spans:
            raise DataError(where, "the template's generation markers enclose nothing (no assistant turn rendered)")
        if self.last_turn_only:
            spans = spans[-1:]
        if not self.thinking_in_mask:
            spans = _subtract(spans, [m.span() for m in _THINK_SPAN_RE.finditer(text)])
        mask = [0] * len(ids)
        j = 0
        for t, (s, e) in enumerate(offsets):
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j < len(spans) and e > s and s < spans[j][1] and e > spans[j][0]:
                mask[t] = 1
        return ids, mask

    def _diff_spans(self, conversation: dict, text: str, ids: list[int], offsets: list[tuple[int, int]],
                    where: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns found by rendering prompts and diffing (no markers)."""
        turns = [i for i, m in enumerate(conversation["messages"]) if m["role"] == "assistant"]
        if self.last_turn_only:
            turns = turns[-1:]
        starts = []
        for i in turns:
            prompt, _ = self.render(conversation, add_generation_prompt=True, upto=i)
            if not text.startswith(prompt):
                raise DataError(where, f"chat template is not prefix-stable: the prompt before assistant message {i} "
                                       "is not a prefix of the full rendering (the template rewrites earlier "
                                       "turns); set data.last_turn_only=true or add {% generation %} markers")
            p_ids, _ = self._encode(prompt)
            if ids[:len(p_ids)] != p_ids:
                raise DataError(where, f"tokenization is not prefix-stable at assistant message {i}: the prompt's "
                                       "last tokens merge with the answer's first; add {% generation %} markers "
                                       "to the template")
            starts.append(len(p_ids))
        spans = []
        for k, (i, start) in enumerate(zip(turns, starts)):
            bound = starts[k + 1] if k + 1 < len(starts) else len(ids)
            end = next((t + 1 for t in range(start, bound) if ids[t] in self.eot_ids), None)
            if end is None:  # no end-of-turn token: the turn runs to where its own rendering ends
                own, _ = self.render(conversation, upto=i + 1)
                if not text.startswith(own):
                    raise DataError(where, f"assistant message {i}: no end-of-turn token (ids {sorted(self.eot_ids)}) "
                                           "and the template is not prefix-stable there")
                o_ids, _ = self._encode(own)
                end = len(o_ids)
            if end > start:
                spans.append((offsets[start][0], offsets[end - 1][1]))
        return spans

    def _probe_eot_ids(self) -> set[int]:
        """The special token a template writes right after an assistant message's content (e.g. ChatML's
        <|im_end|>, Llama-3's <|eot_id|>), found by rendering a two-message probe."""
        probe = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]}
        try:
            text, _ = self.render(probe)
        except Exception:
            return set()
        end = text.rfind(_PROBE)
        if end < 0:
            return set()
        end += len(_PROBE)
        ids, offsets = self._encode(text)
        special = set(self.tok.all_special_ids) | set(getattr(self.tok, "added_tokens_decoder", {}) or {})
        for t, (s, e) in enumerate(offsets):
            if s >= end and e > s:
                return {ids[t]} if ids[t] in special else set()
        return set()


def _subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` minus ``holes`` (both sorted, character offsets)."""
    out = []
    for s, e in spans:
        for hs, he in holes:
            if he <= s or hs >= e:
                continue
            if hs > s:
                out.append((s, hs))
            s = max(s, he)
        if e > s:
            out.append((s, e))
    return out


def eot_ids_from_target(path: str, revision: str | None = None) -> list[int]:
    """``eos_token_id`` of the target's generation config (an int or a list), [] when it has none."""
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path, revision=revision).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's eos and the probe decide
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])


def prompt_ids(renderer: ChatRenderer, conversation: dict, upto: int | None = None) -> list[int]:
    """Token ids of ``messages[:upto]`` plus the generation prompt (what the eval stage feeds the target)."""
    text, _ = renderer.render(conversation, add_generation_prompt=True, upto=upto)
    return renderer._encode(text)[0]


def describe(renderer: ChatRenderer) -> dict[str, Any]:
    """What the mask derivation will use, for the stage summary."""
    return {"mask_method": "generation_markers" if renderer.has_markers else "prefix_diff",
            "eot_ids": sorted(renderer.eot_ids)}

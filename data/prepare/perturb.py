"""Template perturbation (EAGLE-3.1's robustness case): vary what the chat template wraps around a
conversation without touching the turns themselves.

Each perturbed conversation gets one system-prompt mode drawn from ``PerturbConfig.system_modes``:

* ``none``: an explicit empty system prompt;
* ``default``: no system message at all, so the template writes its own default (Llama-3.1's date header,
  Qwen's "You are Qwen..." on older templates);
* ``list``: a prompt drawn from ``system_prompts`` (skipped when the list is empty);

and, with ``vary_date``, a random ``date_string`` template variable (the date line Llama-3.1 templates
print), plus one value drawn for every key of ``template_vars``. The draw depends only on the seed and
the conversation's (source, index), so the same run perturbs the same rows whatever the process count.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random

from fledge.conf.schema import PerturbConfig

SYSTEM_MODES = ("none", "default", "list")


def _rng(seed: int, key: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little"))


def chosen(cfg: PerturbConfig, key: str) -> bool:
    """Whether the training conversation keyed ``key`` (``source:index``) is perturbed."""
    return cfg.fraction > 0 and _rng(cfg.seed, "pick:" + key).random() < cfg.fraction


def perturb(conversation: dict, cfg: PerturbConfig, key: str) -> dict:
    """A perturbed copy of a normalised conversation; the template variables drawn go to
    ``template_kwargs`` (passed to the template when rendering, and written to the eval jsonl)."""
    for m in cfg.system_modes:
        if m not in SYSTEM_MODES:
            raise ValueError(f"data.perturb.system_modes: unknown mode {m!r}; expected some of {list(SYSTEM_MODES)}")
    rng = _rng(cfg.seed, "perturb:" + key)
    modes = [m for m in cfg.system_modes if m != "list" or cfg.system_prompts] or ["default"]
    mode = rng.choice(modes)
    turns = [m for m in conversation["messages"] if m["role"] != "system" or m is not conversation["messages"][0]]
    if mode == "none":
        turns = [{"role": "system", "content": ""}] + turns
    elif mode == "list":
        turns = [{"role": "system", "content": rng.choice(cfg.system_prompts)}] + turns
    kwargs = dict(conversation.get("template_kwargs") or {})
    if cfg.vary_date:
        day = dt.date(2023, 1, 1) + dt.timedelta(days=rng.randrange(3 * 365))
        kwargs["date_string"] = day.strftime("%d %b %Y")
    for name, values in sorted(cfg.template_vars.items()):
        if values:
            kwargs[name] = rng.choice(list(values))
    out = {**conversation, "messages": turns, "template_kwargs": kwargs}
    out["perturbation"] = {"system": mode, **{k: kwargs[k] for k in sorted(kwargs)}}
    return out

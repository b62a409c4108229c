"""The tiny MLA target with an MTP module (``fledge tiny-target mla_mtp``): the DeepSeek-V3-shaped target of
testbed/tiny_families.py with ``num_nextn_predict_layers: 1``, its MTP module (models/mtp.py) trained with it as
DeepSeek trains V3's, and written into its checkpoint under the names vLLM's deepseek_mtp.py reads, so vLLM serves
it with ``method: mtp``.

The objective (DeepSeek-V3 report, section 2.2, depth D = 1): the target's next-token cross-entropy plus
lambda times the module's, whose slot t reads the target's final normed hidden state at t and the embedding of
token t+1 and predicts token t+2; both on answer tokens only, like every tiny target's. The module's loss
reaches the target's layers, its embedding and its head (shared): the trunk learns for the module too, so this
target is not the ``mla`` target plus a head. lambda is DeepSeek's schedule scaled to the step count: 0.3 for the
first 10T of its 14.8T tokens, then 0.1.

What the module's figures mean: ``mtp_heldout_top1`` in metrics.json is its teacher-forced agreement with token
t+2 on held-out answers (the target's next token given); served, vLLM drafts with it (docs/targets.md has the
acceptance per position at k = 1..5 and scripts/bench_mtp.py measures it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fledge.models.mtp import MTPModule, checkpoint_tensors, draft_chain, load_mtp

# DeepSeek-V3's MTP loss weight: 0.3 for the first 10T training tokens, 0.1 for the remaining 4.8T.
LAMBDA_EARLY, LAMBDA_LATE, EARLY_SHARE = 0.3, 0.1, 10.0 / 14.8
SCHEDULE = (LAMBDA_EARLY, LAMBDA_LATE, EARLY_SHARE)  # in the target's build key


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` [B, T, V] against ``targets`` [B, T], weighted by ``mask`` [B, T]."""
    w = mask.flatten().float()
    return (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none") * w).sum() / w.sum()


def mtp_weight(progress: float) -> float:
    """lambda at ``progress`` (the share of training steps done)."""
    return LAMBDA_EARLY if progress < EARLY_SHARE else LAMBDA_LATE


class TargetWithMTP(nn.Module):
    """A transformers DeepSeek-V3 target and its MTP module over the target's own embedding and head: what
    the tiny target's training loop optimises (its parameters() holds the shared ones once)."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.target = target
        self.mtp = MTPModule(target.config, target.model.embed_tokens, target.lm_head)

    def training_loss(self, x: torch.Tensor, mask: torch.Tensor, progress: float) -> torch.Tensor:
        """The joint loss on ids ``x`` [B, L + 1] with answer mask ``mask`` [B, L] (mask[:, j] marks x[:, j + 1])."""
        h = self.target.model(input_ids=x[:, :-1]).last_hidden_state  # after the final norm, as vLLM hands it over
        main = masked_ce(self.target.lm_head(h), x[:, 1:], mask)
        _, logits = self.mtp(h[:, :-1], x[:, 1:-1])  # slot t: h_t and token t+1 predict token t+2
        return main + mtp_weight(progress) * masked_ce(logits, x[:, 2:], mask[:, 1:])


def add_mtp_tensors(path: Path, mtp: MTPModule, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``mtp``'s tensors into the saved target's model.safetensors (in ``dtype``, as the target's own)."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    extra = {n: t.to(dtype).contiguous() for n, t in checkpoint_tensors(mtp).items()}
    assert not set(extra) & set(tensors), "the target already holds an MTP layer"
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})


@torch.no_grad()
def mtp_heldout(path: Path, data_dir: Path) -> dict:
    """The saved module's teacher-forced top-1 agreement with token t+2 on the held-out set's answers (fp32,
    from the bf16 weights): what it predicts given the target's hidden state and the true token t+1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mtp = load_mtp(path, torch.float32)
    correct = count = 0
    for line in (data_dir / "eval.jsonl").read_text().splitlines():
        c = json.loads(line)
        enc = tok.apply_chat_template(c["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                      return_tensors="pt", **c["template_kwargs"])
        ids, mask = enc["input_ids"], enc["assistant_masks"][0, 2:].bool()
        h = target.model(input_ids=ids).last_hidden_state
        _, logits = mtp(h[:, :-2], ids[:, 1:-1])
        correct += (logits[0][mask].argmax(-1) == ids[0, 2:][mask]).sum().item()
        count += int(mask.sum())
    return {"mtp_heldout_top1": correct / count, "mtp_heldout_tokens": count}


@torch.no_grad()
def chain_acceptance(target: nn.Module, mtp: MTPModule, prompts: list[list[int]], k: int, max_new: int,
                     stop_ids: list[int]) -> dict:
    """Greedy speculative decoding in process as vLLM runs ``method: mtp`` (models/mtp.py draft_chain), counted as
    vLLM counts: ``drafts`` (rounds), ``draft_tokens``, ``accepted`` and ``accepted_per_pos`` (rounds whose first i
    drafts were all accepted; a round's every accepted draft counts, past a stop or the token budget too), and
    the ``outputs``."""
    drafts, per_pos, outputs = 0, [0] * k, []
    for prompt in prompts:
        ids = list(prompt)
        h = target.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        ids.append(int(target.lm_head(h[-1]).argmax()))
        while len(ids) - len(prompt) < max_new and not any(t in stop_ids for t in ids[len(prompt):]):
            guess = draft_chain(mtp, h, ids, k)
            h = target.model(input_ids=torch.tensor([ids + guess]), use_cache=False).last_hidden_state[0]
            best = target.lm_head(h[len(ids) - 1:]).argmax(-1).tolist()  # the target's token after each
            a = next((i for i in range(k) if guess[i] != best[i]), k)
            drafts, per_pos = drafts + 1, [c + (i < a) for i, c in enumerate(per_pos)]
            ids += best[: a + 1]
        out = ids[len(prompt):][:max_new]
        outputs.append(out[: next((i + 1 for i, t in enumerate(out) if t in stop_ids), len(out))])
    return {"drafts": drafts, "draft_tokens": drafts * k, "accepted": sum(per_pos), "accepted_per_pos": per_pos,
            "outputs": outputs}

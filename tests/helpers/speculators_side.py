"""The speculators side of the parity check (tests/oracle/test_speculators_parity.py); run it only with the
oracle environment first on the path: PYTHONPATH=.oracle/site (speculators 0.9.0, transformers 5.19).

    python tests/helpers/speculators_side.py JOBS.json

JOBS.json is a list of jobs, {"drafter": DIR, "inputs": IN.safetensors, "out": OUT.safetensors, "steps": N,
"decay": D or null}, run one after another in this one process: speculators' imports (~10 CPU-seconds) are
paid once for all the parity cases. For each job it loads a Fledge export in the speculators dialect with
speculators' own loader (strict about keys), runs its TTT forward on the inputs (CPU: sdpa attention) and
saves the logits of every step, plus what its loader reported, for the test to compare with Fledge's
forward. When the inputs also hold ``verifier_hidden`` and ``loss_mask`` it runs the training forward
instead (eager KL loss, step decay D), backpropagates, and saves the loss and every parameter's gradient.
Imports nothing from Fledge.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(drafter_dir, inputs_path, out_path, steps, decay=1.0):
    config = Eagle3SpeculatorConfig.from_pretrained(drafter_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex has no CPU backward
    model = Eagle3DraftModel.from_pretrained(drafter_dir, config=config, dtype=torch.float32)
    # Its from_pretrained drops output_loading_info: compare the files' tensor names with its modules'.
    files = {}
    for path in Path(drafter_dir).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            files.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    model.load_verifier_weights()  # the target's embedding (checkpoint tensors take precedence)
    model.eval()
    x = load_file(inputs_path)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().float()))
    kwargs = dict(hidden_states=x["aux_hidden"], input_ids=x["input_ids"], document_ids=x["document_ids"],
                  position_ids=x["position_ids"], ttt_steps=steps)
    out = {}
    if "verifier_hidden" in x:
        from speculators.losses import resolve_loss_config

        _, loss, _ = model(**kwargs, verifier_last_hidden_states=x["verifier_hidden"], loss_mask=x["loss_mask"],
                           ttt_step_loss_decay=decay, loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
        out = {f"grad/{n}": p.grad.contiguous() for n, p in model.named_parameters() if p.grad is not None}
        out["loss"] = loss.detach().reshape(1)
    else:
        with torch.no_grad():
            model(**kwargs)
    hook.remove()
    report = {
        "missing": sorted(set(params) - set(files)),
        "unexpected": sorted(set(files) - set(params)),
        "mismatched": sorted(k for k in set(files) & set(params) if files[k] != params[k]),
        "flags": {k: getattr(config, k) for k in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")},
        "aux_ids": list(config.eagle_aux_hidden_state_layer_ids or []),
        "nan_params": sorted(n for n, p in model.named_parameters() if p.isnan().any()),
    }
    out.update({f"logits_{k}": t.contiguous() for k, t in enumerate(logits)})
    save_file(out, out_path, metadata={"report": json.dumps(report)})


if __name__ == "__main__":
    for job in json.loads(Path(sys.argv[1]).read_text()):
        main(job["drafter"], job["inputs"], job["out"], job["steps"],
             *([] if job["decay"] is None else [job["decay"]]))

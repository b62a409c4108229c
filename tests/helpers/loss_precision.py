"""A near-converged TTT problem in bf16 and its gradients, for the losses' precision tests (the soft CE's
shared-teacher path: tests/unit/train/test_loss.py on the torch path, tests/unit/models/test_kernels_interpret.py
for the Triton kernel; every loss on the generic and fp32-head paths: tests/unit/train/test_loss_family.py).

The drafter is close to its teacher (W_d = W_t + noise, y_k at row r = teacher state r+1+k + noise), so the
gradient (softmax(b) - p) W is a small difference of two large terms: where bf16 rounding of either term
hurts most. Gradients are compared with fp64 math on the same bf16 values, and against the "standard" error:
fp32 math throughout, the gradient rounded to bf16 once.
"""

from __future__ import annotations

import torch

from fledge.models.alignment import StepRows


def near_converged(n: int, h: int, vd: int, steps: int, eps: float, seed: int = 0, device: str = "cpu") -> dict:
    """K = ``steps`` drafter states ``ys`` [n + K, H] (rows >= n not counted), teacher states ``t`` [n + K, H],
    heads ``w_d`` / ``w_t`` [vd, H], all bf16; ``rows`` the StepRows train/losses consumes; ``eps`` sets the
    distance to the teacher (eps=0.03: drafter-teacher KL ~0.004 per row); built on CPU, moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    m = n + steps
    t = torch.randn(m, h, generator=g, dtype=torch.float64)
    w_t = torch.randn(vd, h, generator=g, dtype=torch.float64) * 3 / h**0.5
    w_d = w_t + eps * torch.randn(vd, h, generator=g, dtype=torch.float64) / h**0.5
    ys, rows = [], []
    for k in range(steps):
        y = torch.roll(t, -(1 + k), 0) + eps * torch.randn(m, h, generator=g, dtype=torch.float64)
        ys.append(y.bfloat16().to(device))
        counted = torch.arange(m, device=device) < n
        rows.append(StepRows(lead=1 + k, teacher_argmax=torch.zeros(m, dtype=torch.long, device=device),
                             counted=counted, scored=counted))
    bf = lambda x: x.bfloat16().to(device)  # noqa: E731
    return dict(ys=ys, t=bf(t), w_d=bf(w_d), w_t=bf(w_t), rows=rows)


def soft_ce_sum(b, a):
    """The soft CE summed over rows, in the dtype of its logits."""
    return -(torch.softmax(a, -1) * torch.log_softmax(b, -1)).sum()


def _loss(ys, t, w_d, w_t, rows, dtype, loss_sum):
    """sum_k 0.8^k mean-over-rows ``loss_sum`` in ``dtype`` math, written as plain autograd of the formula."""
    a = t.to(dtype) @ w_t.to(dtype).T
    total = 0.0
    for k, (y, s) in enumerate(zip(ys, rows)):
        r = s.counted.nonzero().squeeze(1)
        total = total + 0.8**k * loss_sum(y[r] @ w_d.T, a[r + s.lead]) / r.numel()
    return total, torch.softmax(a, -1)


def reference_grads(problem: dict, dtype: torch.dtype,
                    loss_sum=soft_ce_sum) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(dys stacked, dW_d, mean drafter-teacher KL at step 0) from ``dtype`` math on the problem's bf16 values
    (``loss_sum(drafter_logits, teacher_logits)``: the summed loss of some rows, the soft CE by default); fp32
    gradients are rounded to bf16 once at the end (the "standard" error)."""
    ys = [y.to(dtype).requires_grad_() for y in problem["ys"]]
    w_d = problem["w_d"].to(dtype).requires_grad_()
    total, p = _loss(ys, problem["t"], w_d, problem["w_t"], problem["rows"], dtype, loss_sum)
    total.backward()
    s0 = problem["rows"][0]
    r = s0.counted.nonzero().squeeze(1)
    with torch.no_grad():
        pt = p[r + s0.lead]
        kl = (pt * (pt.log() - torch.log_softmax(ys[0][r] @ w_d.T, -1))).sum(-1).mean().item()
    dys, dw = torch.stack([y.grad for y in ys]), w_d.grad
    if dtype == torch.float32:
        dys, dw = dys.bfloat16(), dw.bfloat16()
    return dys.double(), dw.double(), kl


def shared_teacher_grads(problem: dict, impl: str, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dys stacked, dW_d) from train/losses' shared-teacher path in bf16, with ``impl`` for the drafter part."""
    from fledge.train.losses.paths import shared_teacher_steps as _shared_teacher_steps

    ys = [y.clone().requires_grad_() for y in problem["ys"]]
    head = torch.nn.Linear(*problem["w_d"].shape[::-1], bias=False, dtype=torch.bfloat16, device=problem["w_d"].device)
    with torch.no_grad():
        head.weight.copy_(problem["w_d"])
    parts = _shared_teacher_steps(ys, problem["rows"], problem["t"], head, problem["w_t"], impl, chunk_size)
    total = sum(0.8**k * part / int(s.counted.sum()) for k, ((part, _, _), s) in enumerate(zip(parts, problem["rows"])))
    total.backward()
    assert head.weight.grad.dtype == torch.bfloat16 and all(y.grad.dtype == torch.bfloat16 for y in ys)
    return torch.stack([y.grad for y in ys]).double(), head.weight.grad.double()


def path_grads(problem: dict, path: str, loss_sum, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dys stacked, dW_d) from train/losses' ``path`` in bf16: "generic" (ZeRO-3's: lm_head's own forward)
    or "fp32_head" (elsewhere), running ``loss_sum``."""
    import fledge.train.losses.paths as L

    ys = [y.clone().requires_grad_() for y in problem["ys"]]
    head = torch.nn.Linear(*problem["w_d"].shape[::-1], bias=False, dtype=torch.bfloat16, device=problem["w_d"].device)
    with torch.no_grad():
        head.weight.copy_(problem["w_d"])
    run = {"generic": L.per_step_module_calls, "fp32_head": L.fp32_head_steps}[path]
    parts = run(loss_sum, ys, problem["rows"], problem["t"], head, problem["w_t"], chunk_size)
    total = sum(0.8**k * part / int(s.counted.sum()) for k, ((part, _, _), s) in enumerate(zip(parts, problem["rows"])))
    total.backward()
    assert head.weight.grad.dtype == torch.bfloat16 and all(y.grad.dtype == torch.bfloat16 for y in ys)
    return torch.stack([y.grad for y in ys]).double(), head.weight.grad.double()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in the Frobenius norm."""
    return ((got - want).norm() / want.norm()).item()

"""Training losses (docs/architecture.md, Training-time test): the registry ``drafter.loss`` selects from, and the
shared TTT code: base.py (the unroll, weights, metrics, registry), objectives.py (the registered losses),
divergences.py (their formulas), paths.py (how ``loss_sum`` executes).

A loss is a :class:`TTTLoss` subclass registered under a name. It writes one method, ``loss_sum``: the
summed loss of some rows given their drafter logits and teacher logits over the draft vocab (fp32
``[rows, Vd]`` each). Everything else is shared and written once here or in models/alignment.py: the
unroll of K steps, which rows count at step k and against which teacher row, the step weights
(``sum_k w^k L_k``, L_k the mean over step k's counted rows of the whole optimizer step: every micro-batch
on every rank, :func:`step_denominators`), the metrics, and the execution::

    @register_loss("my_loss")
    class MyLoss(TTTLoss):
        def loss_sum(self, logits, teacher_logits):
            ...  # a fp32 scalar, differentiable in logits

    # then train with drafter.loss=my_loss (TTTModel receives build_loss(inputs.drafter))

Registered: ``ttt_ce`` (the soft CE, forward KL up to a constant; the default), ``rkl``, ``jsd``
(``drafter.loss_options.jsd_beta``), ``tv``, ``lk_lambda`` (``drafter.loss_options.lk_eta``), ``lk_alpha``
and ``mix`` (``drafter.loss_mix``: weights of any of the others); their formulas and what each optimises
are in train/losses/divergences.py.

Execution paths. Under ZeRO-3, ``loss_sum`` runs through the *generic* path: per step, in row chunks
recomputed in backward, the logits come from ``lm_head``'s own forward (the partitioned lm_head weight
exists only inside that forward). Elsewhere it runs through the *fp32-head* path
(paths.py, models/kernels/head_loss.py): step k reads teacher row t+1+k, so the steps share teacher rows, and there
each chunk of teacher rows has its logits computed once for all K steps (measured 25% less time than per
step at K=7); logits come from fp32-result GEMMs and lm_head's gradient is summed in fp32, which in bf16
keeps the gradient accurate near convergence where the generic path's is not. Both derive from
``loss_sum``: a new loss gets them for free. The soft CE has, besides, its own *shared-teacher* rewrite:
``-sum_i p_i log softmax(y W)_i = lse(y W) - y . q`` with ``q = p W`` depending on the teacher row alone,
so q is computed once per batch and each step pays for its drafter logsumexp only (on CUDA a Triton
kernel). That rewrite cannot be derived from ``loss_sum``: a loss that has one provides
``shared_teacher_sums`` itself, and a test pins it to the generic path
(tests/unit/train/test_loss.py::test_zero3_path_equals_the_shared_teacher_path). The other registered losses
have none: each couples p_v and q_v through a non-linear function per vocab entry, so the teacher's part
does not reduce to a vector per teacher row.
"""

from fledge.train.losses.base import (
    LOSSES,
    TTTLoss,
    TTTResult,
    build_loss,
    check_loss_config,
    register_loss,
    step_denominators,
)
from fledge.train.losses.objectives import (  # importing them registers them
    JensenShannon,
    LKAlpha,
    LKLambda,
    Mix,
    ReverseKL,
    SoftCrossEntropy,
    TotalVariation,
    ttt_loss,
)

__all__ = ["LOSSES", "JensenShannon", "LKAlpha", "LKLambda", "Mix", "ReverseKL", "SoftCrossEntropy", "TTTLoss",
           "TTTResult", "TotalVariation", "build_loss", "check_loss_config", "register_loss", "step_denominators",
           "ttt_loss"]

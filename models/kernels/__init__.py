"""Kernels for the hot paths, each with a torch path that is the CPU fallback and the test oracle.

Dispatch rule: impl="auto" runs the Triton kernel on CUDA tensors and the torch path elsewhere;
impl="triton" forces the kernel (on CPU only under TRITON_INTERPRET=1, set before this package is
imported); impl="torch" (or "chunked"/"naive" for the loss) forces a torch path. RMSNorm defaults to
"torch", which on CUDA is torch's own fused kernel (see rmsnorm.py).
"""

from fledge.models.kernels.fp8 import dequantize_e4m3, quantize_e4m3
from fledge.models.kernels.fp32_accum import fp32_grad
from fledge.models.kernels.fused_loss import draft_cross_entropy, draft_logsumexp, fused_draft_loss, teacher_expectation
from fledge.models.kernels.rmsnorm import RMSNorm, rms_norm

__all__ = ["RMSNorm", "dequantize_e4m3", "draft_cross_entropy", "draft_logsumexp", "fp32_grad", "fused_draft_loss",
           "quantize_e4m3", "rms_norm", "teacher_expectation"]

"""Kernels for the hot paths, each with a torch path that is the CPU fallback and the test oracle.

Dispatch rule, the same for every function here: impl="auto" runs the Triton kernel on CUDA tensors and the
torch path elsewhere; impl="triton" forces the kernel (on CPU only under TRITON_INTERPRET=1, set before
this package is imported); impl="torch" (or "chunked"/"naive" for the loss) forces a torch path.
"""

from models.kernels.fp8 import dequantize_e4m3, quantize_e4m3
from models.kernels.fused_loss import fused_draft_loss
from models.kernels.rmsnorm import RMSNorm, rms_norm

__all__ = ["RMSNorm", "dequantize_e4m3", "fused_draft_loss", "quantize_e4m3", "rms_norm"]

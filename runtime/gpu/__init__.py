"""GPU fast path of the tiered KV cache: a Triton decode-attention kernel over the packed tiers, and its wiring.

Nothing here imports Triton or needs CUDA at import time: ``attention_kernel.HAS_TRITON`` says whether the kernel can
run, and the fp32 torch reference (``reference.py``) computes the same function anywhere.
"""

from docfuse.runtime.gpu.reference import tiered_decode_reference

__all__ = ["tiered_decode_reference"]

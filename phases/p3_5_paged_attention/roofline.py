"""Where the compute roofline and the decode-step profiler used to live: now common/roofline.py.

A re-export kept only until phase 3.5's demo.py imports these names from common.roofline.
"""

from common.roofline import measure_matmul_flops, profile_decode_step, roofline_tokens_per_s

__all__ = ["measure_matmul_flops", "profile_decode_step", "roofline_tokens_per_s"]

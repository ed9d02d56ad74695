"""Where Hugging Face's own engines (the peers ours are measured against) used to live: now common/hf_peers.py.

A re-export kept only until phase 3.5's runners.py imports these names from common.hf_peers.
"""

from common.hf_peers import BaselineRun, hf_compiled_generate, hf_generate_batch, hf_static_generate

__all__ = ["BaselineRun", "hf_compiled_generate", "hf_generate_batch", "hf_static_generate"]

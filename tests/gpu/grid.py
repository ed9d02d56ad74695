"""The gpu tier's kernel grid, shared by the decode/gather/store tests and the varlen prefill tests."""

import torch

BLOCK_SIZES = [8, 16, 32, 64]
GQA_GROUPS = [1, 2, 4, 8]
HEAD_DIMS = [64, 128]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
N_KV_HEADS = 2           # query heads = N_KV_HEADS x group (2 to 16)

"""Left padding: turn prompts of different lengths into one rectangular batch.

    row 0 (4 tok): [PAD PAD PAD  The quick brown fox]
    row 1 (7 tok): [Once upon  a time  ,  the  dog  ]

Why LEFT padding: after the prompt, every row appends its next token at the
same column (the right edge), so one decode step is one column for the whole
batch. Right padding would put each row's next token at a different column.

Two things keep padding invisible to the real tokens:
- the attention mask (0 on PAD) stops real tokens from attending to PAD keys;
- per-row position ids count only real tokens, so "The" is position 0 in
  row 0 exactly as it would be without padding (RoPE sees the same angles).
"""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int, device: str | torch.device = "cpu"):
    """Pad token-id rows on the left to the longest row.

    Returns (input_ids [B, T], attention_mask [B, T], position_ids [B, T]), T = longest row.
    """
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, longest - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, longest - len(row):] = 1
    return input_ids.to(device), attention_mask.to(device), positions_from_mask(attention_mask).to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among its row's real tokens: [0,0,0,1,2] for mask [0,0,1,1,1].

    PAD columns get 0 (any value works: nothing attends to them).
    attention_mask: [B, T] -> position_ids [B, T]
    """
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


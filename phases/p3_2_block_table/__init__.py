"""Phase 3.2 adds a per-sequence block table to phase 3.1's pool: logical token positions -> (physical block, offset).

Files:
- block_table.py  `BlockTable` (maybe_extend / ensure_capacity / append_slots / physical_pos /
                  slot_mapping / release)
- demo.py         `table_demo` (one sequence's table at each block boundary, or N sequences competing
                  for one pool), `block_size_study` (tail waste vs table entries across block sizes,
                  on the latency workload's real lengths) and `vm_analogy` (a page table and a block
                  table, one address walked through each, drawn)
- README.md       the idea, its files, how to run it; its tables: docs/measurements/p3_2_block_table.md
"""

from phases.p3_2_block_table.block_table import BlockTable

__all__ = ["BlockTable"]

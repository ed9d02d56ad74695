"""Beside phase 3.6: the attention refusals (support.py) and a cheap attention switch (switch.py)."""

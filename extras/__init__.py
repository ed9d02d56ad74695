"""Off the reading path: alternative paths and speed-only variants that are not a phase's idea."""

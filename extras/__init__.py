"""Off the reading path: speed-only variants and alternative code paths that are not a phase's idea."""

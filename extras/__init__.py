"""Off the reading path: speed-only and alternative code paths the phases do not teach."""

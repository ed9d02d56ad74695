"""Orca's reservations: the baseline phase 4.4's paged allocation is measured against."""

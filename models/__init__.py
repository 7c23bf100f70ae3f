"""Builders of the benchmark models (seeded weights, symbolic dims)."""

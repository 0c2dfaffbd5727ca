"""The learning demo: a tiny model learns to count through the whole stack."""

"""Export of stored trajectories (SFT corpus, Slime samples; JSONL, Parquet)."""

from services.export.export import ExportStats, export

__all__ = ["ExportStats", "export"]

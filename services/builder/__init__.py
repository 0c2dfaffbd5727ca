"""Trajectory builder service: captured CompletionRecords -> trainable Trajectories."""

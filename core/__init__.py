"""Shared by every room: the DataProto batch, the run config, prompt data, models, checkpoints, trackers, metrics, and
the single-process trainer."""

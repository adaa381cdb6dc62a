"""Auto-mapping: the cost model, the planner and its calibration (HybridFlow paper, section 6)."""

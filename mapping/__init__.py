"""Auto-mapping (HybridFlow paper, section 6, Algorithm 1): choose where the run's models live (placement), how many
devices each pool gets (allocation) and each model's parallel strategy, by estimating the iteration's latency with a
cost model over a hardware profile.

Modules: `hardware` (device profiles), `shapes` (model dimensions), `cost` (per-stage seconds and bytes per device),
`dataflow` (the iteration's stages and their simulation on pools), `planner` (the search), `render` (a plan as
config keys)."""

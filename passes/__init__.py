"""Pure FX graph passes of zerocompile: each takes a graph and rewrites it in place.

- `stages`: the one table of what each ZeRO stage does; every pass asks it.
- `marker_args`: each marker op's arguments, declared once (its schema and records derive from it).
- `markers`: the `zerocompile::unshard` / `zerocompile::reduce_grad` marker ops the passes rewrite.
- `lowering`: what a marker means in functional collectives (shared by eager kernels and graphs).
- `merge_unshards`: one gather per parameter per Dynamo graph (tied / reused weights).
- `recompute_gathers`: stage 3 joint-graph tags so the backward re-gathers instead of saving
  (all but the parameters `memory_budget` keeps).
- `lower_markers`: markers -> collectives, placed by stage.
- `recording`: the aten ops a function runs, as the FX graph `lower_markers` splices in.
- `secondary_shards`: hpZ, stage 3's backward re-gathers inside a node.
- `one_in_flight`, `gloo_release`: on gloo, one collective in flight, and its tensors held until
  gloo lets go of them.
- `analysis`, `ledger`: read-only facts of a lowered graph, and its collectives' ledger.
"""

"""Deciding what each saved activation costs and where it goes: the cost model (bytes and
rebuild time per operator, learned from traced forwards), the planner (keep, offload or
recompute per operator under a budget) and the overlap scheduler (when copies run beside
compute in a pipeline)."""

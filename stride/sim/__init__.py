"""The simulated backend and the logical-time simulator: a worker stand-in whose step time comes from the
planner's cost model, synthetic workloads, and ``stride simulate``."""

"""The tier planner (what each layer keeps decoded, compressed, as sign+mantissa planes or on disk under a budget)
and the calibration that measures its costs on this machine."""

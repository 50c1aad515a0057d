"""Measuring this machine for the planner: kernel and collective timings, whole-step probes and
calibration runs (``axon4d calibrate``). The pricing itself (axon4d.plan) never imports this."""

"""Measuring this machine for the planner (docs/design.md §6, §7): per-rank timing (``timing``),
compute rates (``kernels``), collective costs, overlap and interference (``collectives``), whole
training steps of the probe transformer (``probe``, ``steps``), local worlds (``spawn``), machine
files (``merge``) and the ``axon4d calibrate`` run (``calibrate``). Above the planner in the
layering (§9): the pricing (axon4d.plan) never imports this; it reads the machine files it writes."""

"""Driving the simulated engine in real time: the bridge, the stream fast path, lockstep DP, lateness."""

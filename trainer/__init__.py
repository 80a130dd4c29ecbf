"""The DeepSpeed trainer: advantages, PPO-family losses with off-policy correction, packing, weight publishing."""

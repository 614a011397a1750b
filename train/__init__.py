"""Training (AdamC, CompleteP, sharding, data, checkpoints, CLI). Lands with the training issue (#4)."""

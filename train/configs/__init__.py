"""Training configs: each module defines ``get_config() -> kvm_jax.train.TrainConfig``; pass its
path to ``kvm-train --config=``."""

"""Training configs: each module defines ``get_config() -> train.loop.TrainConfig``."""

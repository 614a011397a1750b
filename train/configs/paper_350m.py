"""The paper's 350M KVM-256 run: 15000 steps (~7.9B tokens), lr 1.26491e-3 / wd 0.126491."""

from kvm_jax.train.configs.paper import paper_config


def get_config():
  return paper_config("kvm256_350m", tokens=7.5e9, steps=15000, eval_every=625)

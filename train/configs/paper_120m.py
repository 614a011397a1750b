"""The paper's 120M KVM-256 run: 6000 steps (~3.1B tokens), lr 2e-3 / wd 0.2 (see paper.py)."""

from kvm_jax.train.configs.paper import paper_config


def get_config():
  return paper_config("kvm256_120m", tokens=3e9, steps=6000, eval_every=250)

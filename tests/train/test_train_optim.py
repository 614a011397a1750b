"""AdamC against a hand-written torch-AdamW-style loop; μP groups and masks; the LR schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.train import adamc as adamc_lib
from kvm_jax.train import completep, sharding


def _reference_adamw(params, grads_per_step, lr_fn, lr_peak, wd_peak, lr_scale, wd_scale,
                     b1=0.9, b2=0.95, eps=1e-8):
  """torch.optim.AdamW semantics, with wd set to wd_peak*lr_t/lr_peak before every step."""
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for step, grads in enumerate(grads_per_step):
    lr_t = lr_fn(step)
    for k in p:
      lr = lr_t * lr_scale[k]
      wd = wd_peak * lr_t / lr_peak * wd_scale[k]
      p[k] = p[k] * (1 - lr * wd)                      # decoupled decay first (torch order)
      m[k] = b1 * m[k] + (1 - b1) * grads[k]
      v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
      m_hat, v_hat = m[k] / (1 - b1 ** (step + 1)), v[k] / (1 - b2 ** (step + 1))
      p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
  return p


def test_adamc_matches_reference_loop_for_50_steps():
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(3,)), "e": rng.normal(size=(5,))}
  grads = [{k: rng.normal(size=x.shape) for k, x in params.items()} for _ in range(50)]
  lr_scale = {"w": 0.5, "b": 1.0, "e": 1.0}
  wd_scale = {"w": 2.0, "b": 0.0, "e": 1.0}
  schedule = completep.lr_schedule(1e-2, total_steps=60, warmup_steps=10)
  opt = adamc_lib.adamc(schedule, peak_learning_rate=1e-2, weight_decay=0.3, lr_scale=lr_scale,
                        wd_scale=wd_scale)
  p = {k: jnp.asarray(x, jnp.float32) for k, x in params.items()}
  state = opt.init(p)
  step = jax.jit(lambda g, s, p: opt.update(g, s, p))
  for g in grads:
    updates, state = step({k: jnp.asarray(x, jnp.float32) for k, x in g.items()}, state, p)
    p = optax.apply_updates(p, updates)
  want = _reference_adamw(params, grads, lambda s: float(schedule(s)), 1e-2, 0.3, lr_scale,
                          wd_scale)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=2e-5, atol=2e-6)


def test_decay_follows_lr_squared():
  """With zero gradients the only change is theta *= 1 - wd_peak * lr_t^2 / lr_peak."""
  schedule = completep.lr_schedule(0.1, total_steps=20, warmup_steps=5)
  opt = adamc_lib.adamc(schedule, peak_learning_rate=0.1, weight_decay=0.5)
  p = {"x": jnp.ones((3,))}
  state = opt.init(p)
  expected = 1.0
  for s in range(12):
    updates, state = opt.update({"x": jnp.zeros((3,))}, state, p)
    p = optax.apply_updates(p, updates)
    lr = float(schedule(s))
    expected *= 1 - 0.5 * lr * lr / 0.1
  np.testing.assert_allclose(np.asarray(p["x"]), expected, rtol=1e-5)


def test_schedule_warmup_and_decay():
  s = completep.lr_schedule(1.0, total_steps=1000, warmup_steps=200)
  np.testing.assert_allclose([float(s(0)), float(s(199)), float(s(200)), float(s(600)),
                              float(s(999))], [1 / 200, 1.0, 1.0, 0.5, 1 / 800], rtol=1e-6)
  assert np.isclose(completep.reference_lr(7.5e9), 1.26491e-3, rtol=1e-5)
  assert np.isclose(completep.reference_wd(15e9), 0.0894427, rtol=1e-5)


def test_groups_and_mup_scales_on_the_model():
  cfg = kj.presets.kvm256_350m()
  model = nnx.eval_shape(lambda: kj.LM(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  groups = completep.group_tree(params)
  lr_s, wd_s = completep.mup_scales(params, cfg)
  flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(groups)}
  lr_flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(lr_s)}
  wd_flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(wd_s)}
  def find(*parts):
    return next(k for k in flat if all(p in k for p in parts))
  ratio = 1024 / 768
  for parts, group, lr, wd in [
      (("lm_head", "kernel"), "lm_head", 1 / ratio, ratio),
      (("wte",), "wte_embed", 1.0, 1.0),
      (("c_q", "kernel"), "matrix_params", 1 / ratio, ratio),
      (("key_weighting", "kernel"), "matrix_params", 1 / ratio, ratio),
      (("v_gate2", "kernel"), "matrix_params", 1.0, 1.0),   # lora 32 / lora_base 32
      (("ln_s", "scale"), "scalars", 1.0, 0.0),
      (("state_temperature",), "scalars", 1.0, 0.0),
      (("x_q",), "scalars", 1.0, 0.0),
      (("v_gate0",), "scalars", 1.0, 0.0),
  ]:
    key = find(*parts)
    assert (flat[key], lr_flat[key], wd_flat[key]) == (group, pytest.approx(lr), pytest.approx(wd)), key


def _flat(tree):
  return {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("preset", ["rwkv7_350m", "ovq_swa_350m"])
def test_baselines_groups_mup_ratios_and_sharding_axes(preset):
  """The authors' labels for the baselines' parameters (their ``set_label`` calls): RWKV-7's
  projections and LoRAs are matrix_params, its LoRA outputs with their own ratio lora / lora at
  width 768 (``mup_d_in_ratio``: 64/64 for w and a, 32/32 for v, 160/128 for g at width 1024), the
  mixes, w0/a0/v0, k_k/k_a, r_k and ln_x scalars; OVQ's beta a scalar. Every 2-D parameter has
  logical sharding axes."""
  cfg = getattr(kj.presets, preset)()
  model = nnx.eval_shape(lambda: kj.LM(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  groups = _flat(completep.group_tree(params))
  lr_s, wd_s = map(_flat, completep.mup_scales(params, cfg))
  ratio = 1024 / 768
  attn = "['blocks'][1]['attn']"
  want = {
      "rwkv7_350m": [("['receptance']['kernel']", "matrix_params", ratio),
                     ("['output']['kernel']", "matrix_params", ratio),
                     ("['w2']['kernel']", "matrix_params", 1.0),
                     ("['w1']['kernel']", "matrix_params", ratio),
                     ("['g2']['kernel']", "matrix_params", 160 / 128),
                     ("['v2']['kernel']", "matrix_params", 1.0),
                     ("['x_g']", "scalars", None), ("['w0']", "scalars", None),
                     ("['k_a']", "scalars", None), ("['r_k']", "scalars", None),
                     ("['ln_x']['scale']", "scalars", None)],
      "ovq_swa_350m": [("['beta']", "scalars", None), ("['c_q']['kernel']", "matrix_params", ratio),
                       ("['v_gate2']['kernel']", "matrix_params", 1.0)],
  }[preset]
  for suffix, group, r in want:
    key = f"{attn}{suffix}.value"
    assert groups[key] == group, key
    if r is None:
      assert (lr_s[key], wd_s[key]) == (1.0, 0.0), key
    else:
      assert (lr_s[key], wd_s[key]) == (pytest.approx(1 / r), pytest.approx(r)), key
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if leaf.ndim == 2:
      assert len(sharding.logical_axes(path, 2)) == 2, jax.tree_util.keystr(path)


def test_float32_master_keeps_small_updates_for_bf16_params():
  """Updates far below bf16 resolution accumulate in the master instead of vanishing."""
  inner = optax.sgd(1e-4)
  opt = adamc_lib.with_float32_master(inner)
  p = {"x": jnp.ones((4,), jnp.bfloat16)}
  state = opt.init(p)
  for _ in range(100):
    _, state = opt.update({"x": jnp.ones((4,), jnp.bfloat16)}, state, p)
    p = adamc_lib.params_from_master(state, p)
  # 100 steps of 1e-4 = 0.01: visible in bf16 (ulp at 1.0 is 2^-7 ~ 0.0078) only via the master
  assert float(state.master["x"][0]) == pytest.approx(0.99, abs=5e-5)  # 100 float32 roundings
  assert p["x"].dtype == jnp.bfloat16 and float(p["x"][0]) < 1.0

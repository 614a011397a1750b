"""An independent float64 oracle of the GPTAlpha-2 language model, written from docs/kvm-spec.md
(and docs/ovq-rwkv7.md for the OVQ and RWKV-7 baselines).

Everything here follows the written specification (§4 backbone, §5 RoPE, §6.1-§6.7 and §6.10 KVM
layer, §11 traps), not the project's modules: this file imports nothing from ``kvm_jax``, only
numpy. Its purpose is to catch semantic slips that internal-consistency tests
(decode == forward, causality, overfitting, parameter counts) cannot see, such as ReLU instead of
squared ReLU, a token shift in the wrong place, or a missing temperature.

Inputs are plain data:

* ``params``: the model's parameters as a nested dict of float64 numpy arrays, named like the
  model's state (``wte/embedding``, ``ln_emb/{scale,bias}``, ``blocks[i]/attn/c_q/kernel``, ...,
  ``lm_head/kernel``); ``blocks`` is a list indexed by layer. Linear kernels are ``[in, out]``.
* ``cfg``: a dict of the configuration values used below (see :func:`lm_logits`).

Layout is ``[B, T, heads, dim]`` (the spec writes ``[B, heads, T, dim]``; only the layout differs).
Routing decisions of the KVM state update can be recorded in a list (``log``) so a test can check
which code paths a case exercises and how far each decision is from a tie.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

LN_EPS = 1e-5        # every LayerNorm of the model (§4), QK-LN and LN_s included
NORMALIZE_EPS = 1e-12  # F.normalize's epsilon in the state-value readout (§6.6, §6.12)


# -- small pieces (§4, §5) --------------------------------------------------------------------------

def layer_norm(x: np.ndarray, p: dict, eps: float = LN_EPS) -> np.ndarray:
  """LayerNorm over the last axis with weight ``p["scale"]`` and bias ``p["bias"]``."""
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def linear(x: np.ndarray, p: dict) -> np.ndarray:
  """Bias-free projection ``x @ kernel`` (kernel ``[in, out]``)."""
  return x @ p["kernel"]


def sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-x))


def elu(x: np.ndarray) -> np.ndarray:
  return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def token_shift(z: np.ndarray, mix: np.ndarray, fallback: str) -> np.ndarray:
  """``z + mix ⊙ (z_{t-1} - z_t)`` over axis 1 of ``z`` [B, T, n]; z_{-1} is z_0 ("first": the
  attention front end, §4 step 3) or 0 ("zero": the MLP, §4)."""
  first = z[:, :1] if fallback == "first" else np.zeros_like(z[:, :1])
  previous = np.concatenate([first, z[:, :-1]], axis=1)
  return z + mix * (previous - z)


def rope(x: np.ndarray, rotary: int, theta: float) -> np.ndarray:
  """Partial interleaved RoPE of §5 on ``x`` [B, T, heads, D] at positions 0..T-1.

  Frequencies f_i = (1/θ)^(i/(r/2-1)) (exponents ``linspace(0, 1, r/2)``: f runs from 1 to exactly
  1/θ, not the usual θ^(-2i/r)); channels 2i and 2i+1 share f_i; the rotation is by -angle:
  out[2i] = cos·x[2i] + sin·x[2i+1], out[2i+1] = cos·x[2i+1] - sin·x[2i]. Channels >= r are left
  as they are (NoPE). Tables in float64 (the spec's are fp32/bf16; the model's default is fp32).
  """
  if rotary == 0:
    return x
  T = x.shape[1]
  freqs = (1.0 / theta) ** np.linspace(0.0, 1.0, rotary // 2)           # [r/2]
  angle = np.arange(T, dtype=np.float64)[:, None] * freqs[None, :]       # [T, r/2]
  cos, sin = np.cos(angle)[None, :, None, :], np.sin(angle)[None, :, None, :]
  even, odd = x[..., 0:rotary:2], x[..., 1:rotary:2]
  out = x.copy()
  out[..., 0:rotary:2] = cos * even + sin * odd
  out[..., 1:rotary:2] = cos * odd - sin * even
  return out


def softmax_rows(scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
  """Softmax over the last axis, restricted to ``visible`` (broadcastable bool mask)."""
  scores = np.where(visible, scores, -np.inf)
  scores = scores - scores.max(-1, keepdims=True)
  w = np.exp(scores)
  return w / w.sum(-1, keepdims=True)


def expand_kv(x: np.ndarray, num_heads: int) -> np.ndarray:
  """KV heads [B, T, Hkv, d] -> query heads [B, T, H, d]: query head h reads KV head h // G."""
  group = num_heads // x.shape[2]
  return x[:, :, np.arange(num_heads) // group]


def masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     visible: np.ndarray) -> np.ndarray:
  """Softmax attention with scale 1/√D. q [B, T, H, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv],
  ``visible`` [T (query), T (key)] bool. Returns [B, T, H, Dv]."""
  H, D = q.shape[2], q.shape[3]
  k, v = expand_kv(k, H), expand_kv(v, H)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
  return np.einsum("bhqk,bkhd->bqhd", softmax_rows(scores, visible), v)


# -- the baseline mixers (§4 and the config's docstrings) -----------------------------------------

def causal_mask(T: int) -> np.ndarray:
  """[T, T]: query p sees keys j <= p."""
  return np.tril(np.ones((T, T), bool))


def sliding_window_mask(T: int, window: int) -> np.ndarray:
  """[T, T]: query p sees the last ``window`` tokens including itself, p - window < j <= p."""
  p, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return (j <= p) & (j > p - window)


def block_window_mask(T: int, chunk: int, window_chunks: int, sinks: int) -> np.ndarray:
  """[T, T]: query p in chunk c = p // C sees keys [max(0, (c - nb + 1)·C), p] (its own chunk and
  the nb - 1 previous ones) plus the first ``sinks`` tokens (causally)."""
  p, j = np.arange(T)[:, None], np.arange(T)[None, :]
  begin = np.maximum(0, (p // chunk - window_chunks + 1) * chunk)
  return (j <= p) & ((j >= begin) | (j < sinks))


# -- KVM (§6.2-§6.7, §6.10) ---------------------------------------------------------------------------

def budget_target(budget: dict, ctx_len: int) -> int:
  """B(ctx_len) of §6.3 before the caps: "fixed" (``rows``), "power_law" (``factor``,
  ``exponent``, ``min_rows``, ``round_down``) or "saturation" (``limit``, ``min_rows``,
  ``round_down``), in Python float math."""
  mode = budget["mode"]
  if mode == "fixed":
    return budget["rows"]
  if mode == "power_law":
    t = math.floor(budget["factor"] * float(ctx_len) ** budget["exponent"])
  elif mode == "saturation":
    n = float(budget["limit"])
    t = math.floor(n * ctx_len / (n + ctx_len))
  else:
    raise ValueError(f"budget mode {mode!r}: choose 'fixed', 'power_law' or 'saturation'.")
  step = max(budget["round_down"], 1)
  t = max(t, 0) // step * step
  return max(t, budget["min_rows"])


def rows_to_append(kvm: dict, ctx_len: int, available: int, current: int, overflow: int) -> int:
  """n_append of §6.3: the budget at ``ctx_len``, capped by ``available`` and ``max_state_rows``,
  never shrinking, at most the overflow length."""
  t = min(budget_target(kvm["budget"], ctx_len), available)
  if kvm["max_state_rows"] is not None:
    t = min(t, kvm["max_state_rows"])
  desired = max(t, current)
  return min(max(desired - current, 0), overflow)


def window_begin(n: int, chunk: int, span: int) -> int:
  """bswa_begin(n) = max(0, ceil(n/C)·C - L) (§6.4): first token of the exact window once n
  tokens exist."""
  return max(0, -(-n // chunk) * chunk - span)


def prep_keys(k: np.ndarray, ln_s: dict, rotary: int) -> np.ndarray:
  """prep(k) = LN_s(k with its first ``rotary`` channels zeroed) (§6.2): the zeroed channels take
  part in mean and variance and come out non-zero (§11.2)."""
  k = k.copy()
  k[..., :rotary] = 0.0
  return layer_norm(k, ln_s)


def normalize(x: np.ndarray) -> np.ndarray:
  """x / max(‖x‖, 1e-12) over the last axis (F.normalize)."""
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), NORMALIZE_EPS)


class KVMState:
  """The state of one (batch element, KV head), §1: raw key sums ``keys`` [M, D] (sums of prep(k),
  not normalized), raw value sums ``values`` [M, Dv], and the radius ``radius`` [M] (‖v‖ of the
  creating token, never changed by merges)."""

  def __init__(self, keys, values):
    self.keys, self.values = keys.copy(), values.copy()
    self.radius = np.linalg.norm(values, axis=-1)

  def readout(self, ln_s: dict):
    """Readout keys LN_s(S_K) (LN_s applied again, §11.1) and values normalize(S_V)·radius (§6.6;
    float64 here, no bf16 cast: the model's default ``readout_value_dtype`` is None)."""
    return layer_norm(self.keys, ln_s), normalize(self.values) * self.radius[:, None]


def kvm_update(state: KVMState, k_bar: np.ndarray, v: np.ndarray, g: np.ndarray, ln_s: dict,
               n_append: int, sinks: int, log: Optional[list]) -> None:
  """State update from one overflow chunk (§6.7), in place.

  k_bar [n, D] = prep(k) of the overflow tokens (ungated), v [n, Dv], g [n] merge gates. The
  ``n_append`` tokens least similar to the state (lowest "novelty" score, which is a similarity)
  become new rows, ungated; every other token is gated (g·k̄, g·v) and merged winner-take-all into
  the non-sink row of the post-append state that its gated key matches best.
  """
  n = k_bar.shape[0]
  k_gated, v_gated = k_bar * g[:, None], v * g[:, None]
  record = {"n_append": n_append, "n_merge": n - n_append}
  if n_append > 0:
    # Novelty: the best similarity of the *ungated* k̄ to the *pre-append* state, sinks included.
    novelty = (k_bar @ layer_norm(state.keys, ln_s).T).max(-1)                       # [n]
    order = np.argsort(novelty, kind="stable")     # least similar first; ties: lower token first
    appended = np.sort(order[:n_append])
    merged = np.sort(order[n_append:])
    ranked = novelty[order]
    if n_append < n:  # how far the append/merge cut is from a tie
      record["append_gap"] = ranked[n_append] - ranked[n_append - 1]
    state.keys = np.concatenate([state.keys, k_bar[appended]])
    state.values = np.concatenate([state.values, v[appended]])
    state.radius = np.concatenate([state.radius, np.linalg.norm(v[appended], axis=-1)])
  else:
    merged = np.arange(n)
  if merged.size:
    protected = min(sinks, state.keys.shape[0])
    if state.keys.shape[0] <= protected:
      raise ValueError("no non-sink row to merge into")
    # Routing: gated k̄ against the *post-append* state; sink rows can never win.
    logits = k_gated[merged] @ layer_norm(state.keys, ln_s).T                         # [m, M]
    record["sink_would_win"] = int((logits.argmax(-1) < protected).sum())
    logits[:, :protected] = -np.inf
    target = logits.argmax(-1)                     # first index on exact ties
    top2 = np.sort(logits, axis=-1)[:, -2:]
    record["route_gap"] = float((top2[:, 1] - top2[:, 0]).min())
    np.add.at(state.keys, target, k_gated[merged])
    np.add.at(state.values, target, v_gated[merged])
  if log is not None:
    log.append(record)


def kvm_group(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, temp_window: np.ndarray,
              temp_state: np.ndarray, ln_s: dict, kvm: dict, log: Optional[list]) -> np.ndarray:
  """KVM over one (batch element, KV head) and its G query heads (§6.5 prefill loop).

  q [T, G, D] (post QK-LN and RoPE), k [T, D], v [T, Dv], g [T], temperatures [G] (linear,
  multiplying keys, before 1/√D: τ_f on every exact-window key, τ_s on state keys). Returns
  [T, G, Dv].
  """
  T, G, D = q.shape
  C, L = kvm["chunk_size"], kvm["chunk_size"] * kvm["window_chunks"]
  scale = 1.0 / math.sqrt(D)
  y = np.zeros((T, G, v.shape[-1]))

  # Front: plain causal attention over the first L tokens, no state, τ_f still applied (§11.7).
  F = min(T, L)
  scores = np.einsum("qhd,kd->hqk", q[:F], k[:F]) * temp_window[:, None, None] * scale
  y[:F] = np.einsum("hqk,kd->qhd", softmax_rows(scores, causal_mask(F)), v[:F])

  # Initial state: the first min(T, C) tokens, prep(k), ungated, radius ‖v‖ (§6.5, §6.10).
  c0 = min(T, C)
  state = KVMState(prep_keys(k[:c0], ln_s, kvm["rope_dims"]), v[:c0])
  for qb in range(L, T, C):
    qe = min(T, qb + C)
    wb = window_begin(qe, C, L)
    # Readout + ONE softmax over state rows and the exact window [wb, qe) (§6.6).
    state_k, state_v = state.readout(ln_s)
    s_state = np.einsum("qhd,md->hqm", q[qb:qe], state_k) * temp_state[:, None, None]
    s_window = np.einsum("qhd,kd->hqk", q[qb:qe], k[wb:qe]) * temp_window[:, None, None]
    positions = np.arange(qb, qe)[:, None]
    visible = np.concatenate([np.ones((qe - qb, state_k.shape[0]), bool),
                              np.arange(wb, qe)[None, :] <= positions], axis=1)
    w = softmax_rows(np.concatenate([s_state, s_window], -1) * scale, visible)
    y[qb:qe] = np.einsum("hqk,kd->qhd", w, np.concatenate([state_v, v[wb:qe]]))
    if qe >= T:
      break  # no update fires after the last chunk
    nwb = window_begin(min(T, qe + C), C, L)
    if nwb > wb:  # the oldest window chunk [wb, nwb) leaves the window: fold it into the state
      n_app = rows_to_append(kvm, ctx_len=qe, available=nwb, current=state.keys.shape[0],
                             overflow=nwb - wb)
      kvm_update(state, prep_keys(k[wb:nwb], ln_s, kvm["rope_dims"]), v[wb:nwb], g[wb:nwb],
                 ln_s, n_app, kvm["sink_rows"], log)
  return y


def check_kvm_flags(kvm: dict) -> None:
  """Only the default flags (the paper's configuration) are modelled."""
  want = dict(gate_keys=True, gate_values=True, gate_appends=False, gate_initial_state=False,
              head_temperatures=True, value_norm="radius", readout_value_dtype=None)
  for name, value in want.items():
    if kvm[name] != value:
      raise ValueError(f"kvm.{name}={kvm[name]!r}: the reference models only the paper's "
                       f"{name}={value!r}.")


def kvm_mixer(p: dict, x: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, kvm: dict,
              log: Optional[list]) -> np.ndarray:
  """KVM attention of a layer: x [B, T, C_model] (the LN_attn output), q [B, T, H, D],
  k [B, T, Hkv, D], v [B, T, Hkv, Dv]. Returns [B, T, H, Dv]."""
  check_kvm_flags(kvm)
  B, T, H, _ = q.shape
  Hkv = k.shape[2]
  G = H // Hkv
  g = 1.0 + elu(linear(x, p["key_weighting"]))   # [B, T, Hkv]; x NOT token-shifted (§6.2)
  y = np.zeros((B, T, H, v.shape[-1]))
  for b in range(B):
    for j in range(Hkv):
      heads = slice(j * G, (j + 1) * G)   # query heads h with h // G == j
      y[b, :, heads] = kvm_group(q[b, :, heads], k[b, :, j], v[b, :, j], g[b, :, j],
                                 p["window_temperature"][heads], p["state_temperature"][heads],
                                 p["ln_s"], kvm, log)
  return y


# -- OVQ (docs/ovq-rwkv7.md, "OVQ") ---------------------------------------------------------------

def ovq_dictionary_size(ovq: dict, tokens: int) -> int:
  """Rows after ``tokens`` tokens: floor(t·M / (t + M)), or min(t, M) with ``min_state_size``."""
  M = ovq["max_centroids"]
  if tokens <= 0:
    return 0
  return min(tokens, M) if ovq["min_state_size"] else min(math.floor(tokens * M / (tokens + M)), M)


def ovq_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: float, ovq: dict) -> np.ndarray:
  """OVQ over one (batch element, head): q, k [T, D] (L2-normalized), v [T, Dv]. Returns
  [T, Dv]. The dictionary grows by concatenation; each centroid is recomputed as the running mean
  of everything assigned to it."""
  T, D = q.shape
  C = ovq["chunk_size"]
  scale = beta * math.sqrt(D)
  keys, values, counts = np.zeros((0, D)), np.zeros((0, v.shape[1])), np.zeros(0)
  y = np.zeros((T, v.shape[1]))
  size = 0
  for s in range(0, T, C):
    e = min(T, s + C)
    n = e - s
    own = (q[s:e] * scale) @ k[s:e].T
    dictionary = (q[s:e] * scale) @ keys.T
    if ovq["count_bias"]:
      dictionary = dictionary + np.log(counts)[None, :]
    scores = np.concatenate([dictionary, own], axis=1)
    visible = np.concatenate([np.ones((n, len(counts)), bool), causal_mask(n)], axis=1)
    w = softmax_rows(scores, visible)
    y[s:e] = w @ np.concatenate([values, v[s:e]])
    # fold the chunk in
    size = max(size, ovq_dictionary_size(ovq, e))
    n_new = size - len(counts)
    if len(counts) == 0:
      nearest = np.zeros(n, int)
      likeness = k[s:e] @ k[s]
      likeness[0] = np.inf
      first, opened = 0 + 1, n_new - 1
    else:
      sims = k[s:e] @ keys.T
      nearest, likeness = sims.argmax(1), sims.max(1)
      first, opened = len(counts), n_new
    target = nearest.copy()
    for rank, token in enumerate(np.argsort(likeness, kind="stable")[:max(opened, 0)]):
      target[token] = first + rank
    if ovq["delta_rule"]:
      if len(counts):
        bias = np.log(counts)[None, :] if ovq["count_bias"] else 0.0
        weights = softmax_rows((k[s:e] * scale) @ keys.T + bias, np.ones((n, len(counts)), bool))
        predicted = weights @ values
      else:
        predicted = np.zeros((n, v.shape[1]))
    keys = np.concatenate([keys, np.zeros((n_new, D))])
    values = np.concatenate([values, np.zeros((n_new, v.shape[1]))])
    counts = np.concatenate([counts, np.zeros(n_new)])
    for row in range(size):
      members = np.flatnonzero(target == row)
      if members.size == 0:
        continue
      total = counts[row] + members.size
      keys[row] = (counts[row] * keys[row] + k[s:e][members].sum(0)) / total
      if ovq["delta_rule"]:
        values[row] = values[row] + (v[s:e][members] - predicted[members]).sum(0) / total
      else:
        values[row] = (counts[row] * values[row] + v[s:e][members].sum(0)) / total
      counts[row] = total
    if ovq["normalize_centroids"]:
      keys = normalize(keys)
      if not ovq["delta_rule"]:
        values = normalize(values)
  return y


def ovq_mixer(p: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray, ovq: dict) -> np.ndarray:
  """OVQ attention of a layer on the front end's q [B, T, H, D], k, v (no QK-LN, no RoPE):
  queries and keys L2-normalized as x / (‖x‖ + 1e-5). Returns [B, T, H, Dv]."""
  unit = lambda x: x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-5)
  q, k = unit(q), unit(k)
  B, T, H, _ = q.shape
  y = np.zeros((B, T, H, v.shape[-1]))
  for b in range(B):
    for h in range(H):
      y[b, :, h] = ovq_head(q[b, :, h], k[b, :, h], v[b, :, h], p["beta"][h], ovq)
  return y


# -- RWKV-7 (docs/ovq-rwkv7.md, "RWKV-7") ---------------------------------------------------------

def group_norm(x: np.ndarray, p: dict, groups: int, eps: float) -> np.ndarray:
  """torch GroupNorm over the channels of x [B, T, C]: each of ``groups`` contiguous groups
  normalized on its own, then a weight and bias per channel."""
  B, T, C = x.shape
  g = x.reshape(B, T, groups, C // groups)
  mu = g.mean(-1, keepdims=True)
  var = ((g - mu) ** 2).mean(-1, keepdims=True)
  return ((g - mu) / np.sqrt(var + eps)).reshape(B, T, C) * p["scale"] + p["bias"]


def rwkv7_shifted(p: dict, x: np.ndarray, name: str, cfg: dict) -> np.ndarray:
  """x + (x_{t-1} - x_t) ⊙ x_name, with x_{-1} = 0 (the input itself without token shift)."""
  if not cfg["tokenshift_attention"]:
    return x
  previous = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  return x + (previous - x) * p[f"x_{name}"]


def rwkv7_anchor(p: dict, x: np.ndarray, cfg: dict) -> np.ndarray:
  """v_first of an RWKV-7 model: the first layer's value projection of its shifted input."""
  return linear(rwkv7_shifted(p, x, "v", cfg), p["value"])


def rwkv7_layer(p: dict, x: np.ndarray, v_first: np.ndarray, cfg: dict) -> np.ndarray:
  """RWKV-7's time mix on x [B, T, C] (the LN_attn output), output projection included."""
  B, T, C = x.shape
  H = cfg["num_heads"]
  N = C // H
  shifted = {name: rwkv7_shifted(p, x, name, cfg) for name in "rwkvag"}
  lora = lambda name, z, inner=lambda u: u: linear(inner(linear(z, p[f"{name}1"])), p[f"{name}2"])
  softplus = lambda z: np.logaddexp(0.0, z)
  r = linear(shifted["r"], p["receptance"])
  w = -np.exp(-softplus(-(p["w0"] + lora("w", shifted["w"], np.tanh))) - 0.5)
  k = linear(shifted["k"], p["key"])
  v = linear(shifted["v"], p["value"])
  v = v + (v_first - v) * sigmoid(p["v0"] + lora("v", shifted["v"]))
  a = sigmoid(p["a0"] + lora("a", shifted["a"]))
  g = linear(sigmoid(linear(shifted["g"], p["g1"])), p["g2"])
  heads = lambda z: z.reshape(B, T, H, N)
  kk = normalize(heads(k * p["k_k"]))
  k = k * (1 + (a - 1) * p["k_a"])
  r, w, k, v, a = map(heads, (r, w, k, v, a))
  out = np.zeros((B, T, H, N))
  for b in range(B):
    for h in range(H):
      S = np.zeros((N, N))                                      # [Dv, Dk]
      for t in range(T):
        transition = np.diag(np.exp(w[b, t, h])) + np.outer(-kk[b, t, h], kk[b, t, h] * a[b, t, h])
        S = S @ transition + np.outer(v[b, t, h], k[b, t, h])
        out[b, t, h] = S @ r[b, t, h]
  out = group_norm(out.reshape(B, T, C), p["ln_x"], H, 64e-5)
  bonus = (r * k * p["r_k"]).sum(-1, keepdims=True) * v
  return linear((out + bonus.reshape(B, T, C)) * g, p["output"])


# -- attention front end, MLP, blocks, LM (§4) -----------------------------------------------------

def front_end(p: dict, x: np.ndarray, v_first: np.ndarray, cfg: dict, rotary: int):
  """§4 steps 1-5 on x [B, T, C_model] (the LN_attn output): q [B,T,H,D], k, v [B,T,Hkv,·]."""
  B, T, _ = x.shape
  H, Hkv, D, Dv = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["value_head_dim"]
  q, k, v = linear(x, p["c_q"]), linear(x, p["c_k"]), linear(x, p["c_v"])
  if cfg["value_residual"]:  # before the token shift; identity in the anchor layer
    gate = sigmoid(p["v_gate0"] + linear(linear(x, p["v_gate1"]), p["v_gate2"]))
    v = v + (v_first - v) * gate
  if cfg["tokenshift_attention"]:  # on the projected q/k/v, z_{-1} := z_0
    q = token_shift(q, p["x_q"], "first")
    k = token_shift(k, p["x_k"], "first")
    v = token_shift(v, p["x_v"], "first")
  q, k = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D)
  if "ln_q" in p:  # QK-LN over the head dim, shared by heads (OVQ layers have none)
    q, k = layer_norm(q, p["ln_q"]), layer_norm(k, p["ln_k"])
  v = v.reshape(B, T, Hkv, Dv)
  return rope(q, rotary, cfg["rope_theta"]), rope(k, rotary, cfg["rope_theta"]), v


def attention_layer(p: dict, x: np.ndarray, v_first: np.ndarray, kind: str, cfg: dict,
                    log: Optional[list]) -> np.ndarray:
  """One mixer on x [B, T, C_model] (the LN_attn output), through c_proj: [B, T, C_model]."""
  T = x.shape[1]
  if kind == "rwkv7":
    return rwkv7_layer(p, x, v_first, cfg)
  rotary = {"swa": cfg["swa_rope_dims"], "ovq": 0}.get(kind, cfg["rope_dims"])
  q, k, v = front_end(p, x, v_first, cfg, rotary)
  if kind == "full":
    y = masked_attention(q, k, v, causal_mask(T))
  elif kind == "swa":
    y = masked_attention(q, k, v, sliding_window_mask(T, cfg["swa_window"]))
  elif kind == "bswa":
    y = masked_attention(q, k, v, block_window_mask(T, cfg["bswa_chunk_size"],
                                                    cfg["bswa_window_chunks"],
                                                    cfg["bswa_sink_rows"]))
  elif kind == "kvm":
    y = kvm_mixer(p, x, q, k, v, cfg["kvm"], log)
  elif kind == "ovq":
    y = ovq_mixer(p, q, k, v, cfg["ovq"])
  else:
    raise ValueError(f"mixer {kind!r}: choose 'full', 'swa', 'bswa', 'kvm', 'ovq' or 'rwkv7'.")
  return linear(y.reshape(*x.shape[:2], -1), p["c_proj"])


def mlp(p: dict, x: np.ndarray, cfg: dict) -> np.ndarray:
  """Token shift on the normalized input (z_{-1} := 0), then c_proj(relu(c_fc(x))²)."""
  if cfg["tokenshift_mlp"]:
    x = token_shift(x, p["x_k"], "zero")
  return linear(np.maximum(linear(x, p["c_fc"]), 0.0) ** 2, p["c_proj"])


def anchor_layer(cfg: dict, layer: int) -> int:
  """The layer whose c_v(ln_attn(x0)) is ``layer``'s v_first: layer 0 with a shared anchor, else
  the first layer of the same mixer kind (the paper's hybrids: SWA on even layers anchor on layer
  0, the main mixer on layer 1; §4)."""
  if cfg["share_value_anchor"]:
    return 0
  return cfg["mixers"].index(cfg["mixers"][layer])


def lm_logits(params: dict, cfg: dict, tokens: np.ndarray, log: Optional[list] = None):
  """Logits [B, T, V] float64 of token ids [B, T] (§4).

  ``cfg`` keys: ``mixers`` (one per layer), ``num_heads``, ``num_kv_heads``, ``head_dim``,
  ``value_head_dim``, ``residual_scale``, ``rope_dims``, ``swa_rope_dims``, ``rope_theta``,
  ``swa_window``, ``bswa_chunk_size``, ``bswa_window_chunks``, ``bswa_sink_rows``,
  ``tokenshift_attention``, ``tokenshift_mlp``, ``value_residual``, ``share_value_anchor``, and
  ``kvm``: ``chunk_size``, ``window_chunks``, ``sink_rows``, ``rope_dims``, ``budget`` (see
  :func:`budget_target`), ``max_state_rows`` and the flags of :func:`check_kvm_flags`; ``ovq``:
  ``chunk_size``, ``max_centroids``, ``min_state_size``, ``count_bias``, ``normalize_centroids``,
  ``delta_rule``.
  ``log`` receives one dict per KVM state update (layer order, then batch, KV head, chunk).
  """
  return linear(lm_mixer_io(params, cfg, tokens, log)[2], params["lm_head"])


def embed(params: dict, tokens: np.ndarray) -> np.ndarray:
  """The blocks' first input x0 [B, T, C]: the embedding and its LayerNorm."""
  return layer_norm(params["wte"]["embedding"][tokens], params["ln_emb"])


def value_anchors(params: dict, cfg: dict, x0: np.ndarray) -> dict:
  """{anchor layer: v_first}: each anchor layer's value of ln_attn(x0) (§4)."""
  blocks, anchors = params["blocks"], {}
  for i in range(len(cfg["mixers"])):
    a = anchor_layer(cfg, i)
    if a not in anchors:
      x_a = layer_norm(x0, blocks[a]["ln_attn"])
      anchors[a] = (rwkv7_anchor(blocks[a]["attn"], x_a, cfg) if cfg["mixers"][a] == "rwkv7"
                    else linear(x_a, blocks[a]["attn"]["c_v"]))
  return anchors


def lm_mixer_io(params: dict, cfg: dict, tokens: np.ndarray, log: Optional[list] = None):
  """Per block i: its input x_i [B, T, C] (the residual stream) and its mixer's output h_i
  (before the residual scale); and the final hidden states (after the head LayerNorm, before the
  LM head). ``cfg`` and ``log`` as in :func:`lm_logits`."""
  blocks, s = params["blocks"], cfg["residual_scale"]
  x = x0 = embed(params, tokens)
  anchors = value_anchors(params, cfg, x0)
  inputs, outputs = [], []
  for i, kind in enumerate(cfg["mixers"]):
    blk = blocks[i]
    inputs.append(x)
    outputs.append(attention_layer(blk["attn"], layer_norm(x, blk["ln_attn"]),
                                   anchors[anchor_layer(cfg, i)], kind, cfg, log))
    x = x + s * outputs[-1]
    x = x + s * mlp(blk["mlp"], layer_norm(x, blk["ln_mlp"]), cfg)
  return inputs, outputs, layer_norm(x, params["ln_head"])

"""Matrix-multiply FLOPs of a compiled XLA program, every loop counted as often as it runs.

XLA's ``cost_analysis()`` counts the body of a ``while`` loop once, whatever its trip count. A
train step whose blocks run in a scan (``remat="block"``), whose KVM layers fold chunk after
chunk in loops, and whose loss runs slice by slice is almost all loop bodies, so its
``cost_analysis()["flops"]`` is a fraction of the work (about a twelfth for a 12-block scan).
This module reads the optimized HLO text instead (``compiled.as_text()``) and counts:

* ``dot``: 2 x (output elements) x (contracted elements of the left operand);
* ``convolution`` (XLA:TPU writes matmuls as convolutions, a batch of them as one whose window
  spans the batch over a padded or dilated axis): 2 x (the kernel's input features) x (output
  elements, each spatial position counted once per window tap that meets an input element, not
  padding or a dilation hole);
* a computation called by a fusion or ``call`` once per call, a ``conditional``'s costliest
  branch, and a ``while`` body times its trip count: the loop's ``known_trip_count`` where XLA
  records it, else read from its condition (a counter compared ``<`` or ``<=`` with a constant,
  starting from the constant the loop's initial tuple holds, by default 0).

Elementwise work (softmax exponentials, norms, the optimizer) is left out: the count is the
matmul work a FLOP model of a transformer describes (6·N plus attention), which is what it is
compared with. Custom calls (Pallas kernels) are opaque and count 0; :class:`HloFlops` says how
many there were and which loops' trip counts were not found.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_ARRAY_TYPE = re.compile(r"^[a-z]+[0-9]*\[(?P<dims>[0-9,]*)\]")
_OPERAND = re.compile(r"%([^\s,()]+)")
# Custom calls that run a kernel (Mosaic on TPU, Triton on GPU), as opposed to XLA's own
# bookkeeping custom calls (buffer allocation, layout markers), which compute nothing.
_KERNEL_TARGETS = r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|[^"]*triton[^"]*)"'



@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: Optional[tuple]     # dims of an array result; None for a tuple or token
  opcode: str
  operands: tuple            # operand names, in order
  attributes: str            # the text after the operand list


@dataclasses.dataclass(frozen=True)
class HloFlops:
  """A program's matmul FLOPs (``flops``), the custom calls it could not look into
  (``opaque_calls``) and the while loops whose trip count it could not read (``unknown_loops``,
  counted once)."""

  flops: float
  opaque_calls: int
  unknown_loops: int


def _split_type(rest: str) -> tuple[str, str]:
  """(result type, the rest) of an instruction's right-hand side."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _operand_list(text: str) -> tuple[str, str]:
  """(the operand list inside the opcode's parentheses, the attributes after it)."""
  depth = 0
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0 and ch == ")":
      return text[1:i], text[i + 1:]
  return text[1:], ""


def parse_instruction(line: str) -> Optional[Instruction]:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  type_text, rest = _split_type(m["rest"])
  opcode_match = re.match(r"([a-z][a-z0-9-]*)", rest)
  if not opcode_match:
    return None
  opcode = opcode_match.group(1)
  operands, attributes = _operand_list(rest[len(opcode):])
  array = _ARRAY_TYPE.match(type_text)
  shape = (tuple(int(d) for d in array["dims"].split(",") if d) if array else None)
  return Instruction(m["name"], shape, opcode, tuple(_OPERAND.findall(operands)), attributes)


def parse_module(text: str) -> tuple[dict, str]:
  """({computation name: [Instruction]}, the entry computation's name) of an HLO module's
  text."""
  computations, entry, current = {}, "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header["name"], [])
      if line.startswith("ENTRY"):
        entry = header["name"]
      continue
    if line.strip() == "}":
      current = None
      continue
    if current is not None:
      inst = parse_instruction(line)
      if inst is not None:
        current.append(inst)
  return computations, entry


def _ints(attributes: str, key: str) -> tuple:
  m = re.search(key + r"=\{([0-9,]*)\}", attributes)
  return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def dot_flops(inst: Instruction, shapes: dict) -> float:
  lhs = shapes.get(inst.operands[0]) if inst.operands else None
  if inst.shape is None or lhs is None:
    return 0.0
  contracted = math.prod(lhs[d] for d in _ints(inst.attributes, "lhs_contracting_dims"))
  return 2.0 * math.prod(inst.shape) * contracted


def _window(attributes: str, rank: int) -> dict:
  """A convolution's window per spatial dimension: size, stride, padding (low), and the input's
  and kernel's dilation, each a list of ``rank`` ints (XLA prints them joined by ``x``)."""
  text = re.search(r"window=\{([^}]*)\}", attributes)
  fields = dict(f.split("=", 1) for f in text.group(1).split() if "=" in f) if text else {}
  ints = lambda key, default: ([int(n) for n in fields[key].split("x")] if key in fields  # noqa
                               else [default] * rank)
  pads = ([int(p.split("_")[0]) for p in fields["pad"].split("x")] if "pad" in fields
          else [0] * rank)
  return {"size": ints("size", 1), "stride": ints("stride", 1), "pad": pads,
          "lhs_dilate": ints("lhs_dilate", 1), "rhs_dilate": ints("rhs_dilate", 1)}


def real_taps(out_size: int, in_size: int, size: int, stride: int, pad: int, lhs_dilate: int,
              rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dimension whose input index lands on an
  input element, not on padding or a dilation hole. XLA:TPU writes a batch of matmuls as a
  convolution whose window spans the batch over a padded or dilated axis, where each output
  position meets one real tap of the window."""
  extent = (in_size - 1) * lhs_dilate + 1
  count = 0
  for o in range(out_size):
    for w in range(size):
      i = o * stride + w * rhs_dilate - pad
      count += 0 <= i < extent and i % lhs_dilate == 0
  return count


def convolution_flops(inst: Instruction, shapes: dict) -> float:
  labels = re.search(r"dim_labels=([^_\s,]+)_([^-\s,]+)->([^\s,]+)", inst.attributes)
  lhs = shapes.get(inst.operands[0]) if inst.operands else None
  rhs = shapes.get(inst.operands[1]) if len(inst.operands) > 1 else None
  if inst.shape is None or lhs is None or rhs is None or not labels:
    return 0.0
  lhs_labels, kernel, out_labels = labels.groups()
  features = math.prod(size for size, label in zip(rhs, kernel) if label == "i")
  spatial = sorted({c for c in out_labels if c.isdigit()})
  window = _window(inst.attributes, len(spatial))
  out_spatial, pairs = 1, 1
  for d, digit in enumerate(spatial):
    out_d, in_d = inst.shape[out_labels.index(digit)], lhs[lhs_labels.index(digit)]
    out_spatial *= out_d
    if out_d * window["size"][d] > 1 << 20:  # a real convolution: every tap counts
      pairs *= out_d * window["size"][d]
      continue
    pairs *= real_taps(out_d, in_d, window["size"][d], window["stride"][d], window["pad"][d],
                       window["lhs_dilate"][d], window["rhs_dilate"][d])
  return 2.0 * math.prod(inst.shape) / out_spatial * features * pairs


def _called(inst: Instruction, key: str) -> list[str]:
  m = re.search(key + r"=\{?([^}\s]+(?:,\s*%[^}\s,]+)*)\}?", inst.attributes)
  return [n.strip().lstrip("%").rstrip(",") for n in m.group(1).split(",")] if m else []


def _initial_value(loop: Instruction, index: int, producers: dict, constants: dict) -> int:
  """The loop counter's first value: the constant at ``index`` of the loop's initial tuple
  (0 when it is not a constant there, as in every loop JAX's scans and fori_loops lower to)."""
  init = producers.get(loop.operands[0]) if loop.operands else None
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return 0
  return int(constants.get(init.operands[index], 0))


def scalar_constants(text: str) -> dict:
  """{instruction name: value} of the module's integer scalar constants."""
  return {m.group(1): int(m.group(2)) for m in re.finditer(
      r"%([^\s=]+)\s*=\s*[a-z]+[0-9]*\[\]\S*\s+constant\((-?\d+)\)", text)}


def hlo_flops(text: str) -> HloFlops:
  """Matmul FLOPs of the optimized HLO module ``text`` (see the module docstring)."""
  constants = scalar_constants(text)
  computations, entry = parse_module(text)
  opaque, unknown = [0], [0]

  @functools.lru_cache(maxsize=None)
  def cost(name: str) -> float:
    instructions = computations.get(name, [])
    shapes = {i.name: i.shape for i in instructions}
    producers = {i.name: i for i in instructions}
    total = 0.0
    for inst in instructions:
      if inst.opcode == "dot":
        total += dot_flops(inst, shapes)
      elif inst.opcode == "convolution":
        total += convolution_flops(inst, shapes)
      elif inst.opcode in ("fusion", "call"):
        total += sum(cost(c) for c in _called(inst, "calls") + _called(inst, "to_apply")
                     if inst.opcode == "call" or c in computations)
      elif inst.opcode == "while":
        trips = _trip_count(inst, computations, producers, constants)
        if trips is None:
          unknown[0] += 1
          trips = 1
        total += trips * sum(cost(c) for c in _called(inst, "body"))
      elif inst.opcode == "conditional":
        branches = (_called(inst, "branch_computations")
                    or _called(inst, "true_computation") + _called(inst, "false_computation"))
        total += max((cost(c) for c in branches), default=0.0)
      elif inst.opcode == "custom-call" and re.search(_KERNEL_TARGETS, inst.attributes):
        opaque[0] += 1
    return total

  flops = cost(entry)
  return HloFlops(flops, opaque[0], unknown[0])


def _trip_count(loop: Instruction, computations: dict, producers: dict, constants: dict
                ) -> Optional[int]:
  """How often ``loop`` (a ``while``) runs its body, or None when it cannot be read."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attributes)
  if known:
    return int(known.group(1))
  condition = _called(loop, "condition")
  if not condition or condition[0] not in computations:
    return None
  cond = computations[condition[0]]
  named = {i.name: i for i in cond}
  root = cond[-1]
  direction = re.search(r"direction=(LT|LE)", root.attributes)
  if root.opcode != "compare" or not direction or len(root.operands) != 2:
    return None
  counter, bound = (named.get(n) for n in root.operands)
  if (counter is None or bound is None or bound.opcode != "constant"
      or counter.opcode != "get-tuple-element" or bound.name not in constants):
    return None
  index = int(re.search(r"index=(\d+)", counter.attributes).group(1))
  start = _initial_value(loop, index, producers, constants)
  return max(constants[bound.name] - start + (direction.group(1) == "LE"), 0)

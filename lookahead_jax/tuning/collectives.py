"""The collectives of a compiled XLA program, and the mesh axes each one communicates over.

Read from the program's text, `jax.jit(f).lower(*args).compile().as_text()`:

    found = collectives(hlo_text)
    [mesh_axes(c, mesh) for c in found]        # e.g. [frozenset({'model'}), ...]
    count(found, mesh, op="all-reduce", axes="model", in_loop=True)
    count(found, mesh, axes="lookahead", floats=True)   # 0: no activations cross "lookahead"

What is found: every instruction whose opcode is one of `OPS` (the synchronous form), or that
name with `-start` (an asynchronous form; its `-done` is not counted again). Only the opcode
position of an instruction line is read, so text in `metadata={...}` or other attributes never
counts. For an asynchronous start the result arrays are the collective's results, not the
start's bookkeeping: an `all-reduce-start`'s shape is its result; an `all-gather-start`'s shape
is the tuple (operands, results), of which the results half is taken; a
`collective-permute-start`'s is (operand, result, contexts...), of which the result is taken.
A collective that XLA wraps in a generic `async-start` computation is found in its sync form
inside the wrapped computation.

Device ids: the ids in replica groups are the program's logical device ids (the program runs
SPMD with one replica, so a partition id is a device id). A program jitted with shardings on a
`Mesh` (`NamedSharding`, `shard_map`) has the mesh's devices, in `mesh.devices` row-major order,
as its device assignment, so logical id i is the device at flat position i of `mesh.devices`,
whatever that device's `.id`. `mesh_axes` maps ids to mesh coordinates that way (on an
unpermuted mesh, e.g. `np.array(jax.devices()).reshape(2, 4)`, the two agree).

The replica-group formats parsed (the text after `replica_groups=`):

  * explicit lists, `{{0,2,4,6},{1,3,5,7}}`; `{}` (or no `replica_groups` at all) is one group of
    every device, 0..N-1, N being `num_devices` or else the module header's
    `replica_count * num_partitions`;
  * iota lists, `[G,S]<=[d0,d1,...]` optionally followed by `T(p0,p1,...)`: the rows of
    `arange(prod(d)).reshape(d).transpose(p).reshape(G, S)`;
  * mesh-axes lists (Shardy), `mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0))
    {'axis_1'}`: a mesh with those named axis sizes whose device at each position (row-major) is
    read from `device_ids` (an iota as above, or a plain list of ids; absent: 0..N-1); the
    trailing set names the axes the groups span: a group is the devices whose positions differ
    only along those axes, listed with the set's axes major to minor. A sub-axis,
    `'x':(p)s`, is the size-s factor of axis x after its major factor of size p (axis x read as
    `[p, s, size/(p*s)]`), as XLA's `MeshAxesReplicaGroupList` defines it;
  * `source_target_pairs={{0,1},{1,2}}` for `collective-permute`: the groups are the pairs.

The HLO mesh's axes (`axis_0`...) are XLA's own, not the JAX mesh's; `mesh_axes` reads every
group as device ids and finds the JAX mesh axes along which they differ.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Optional, Union

import jax
import numpy as np

OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
       "collective-broadcast")

AnyMesh = Union[jax.sharding.Mesh, jax.sharding.AbstractMesh]
Groups = tuple[tuple[int, ...], ...]

_HEADER = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLED = re.compile(r"\b(to_apply|calls|condition|body|branch_computations|true_computation|"
                     r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH = re.compile(r"mesh\[(?P<axes>[^\]]*)\]"
                   r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?[^()]*)\))?"
                   r"\s*\{(?P<span>[^}]*)\}")
_MESH_AXIS = re.compile(r"\s*'?([^'=]+?)'?\s*=\s*(\d+)\s*")
_SPAN_AXIS = re.compile(r"\s*'?([^':]+?)'?\s*(?::\((\d+)\)(\d+))?\s*")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    op: its opcode without `-start`, one of `OPS`.
    dtypes: the HLO element types of its result arrays, e.g. ("f32",), ("s32", "s32").
    elements: the total element count of its result arrays.
    groups: the device-id groups that communicate; for a collective-permute the
        (source, target) pairs.
    computation: the name of the HLO computation holding it.
    in_loop: whether that computation runs inside a loop: it is a while loop's body or
        condition, or is called (transitively) from one. A collective in the ENTRY computation
        or in a conditional's branch reached from the ENTRY only is not in a loop.
    """

    op: str
    dtypes: tuple[str, ...]
    elements: int
    groups: Groups
    computation: str
    in_loop: bool

    def is_float(self) -> bool:
        """Whether any result array is floating point (f16, bf16, f32, f64, f8..., complex)."""
        return any(_is_float_type(t) for t in self.dtypes)


def _is_float_type(dtype: str) -> bool:
    return re.match(r"(b?f\d|c\d|tf32)", dtype) is not None


# ------------------------------------------------------------------------------------------
# shapes


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start] ('(' or '{')."""
    close = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in close:
            stack.append(close[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in {text[start:start + 200]!r}")


def _split_shape(text: str) -> tuple[str, str]:
    """(shape, rest) of the text after `name = `: a tuple shape `( ... )` or one array shape."""
    if text.startswith("("):
        end = _balanced_end(text, 0)
        return text[:end], text[end:]
    m = re.match(r"\S+", text)
    if m is None:
        raise ValueError(f"no shape in {text[:200]!r}")
    return m.group(0), text[m.end():]


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, (b, c), d)`; [shape] for an array shape."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return [shape]
    inner, parts, depth, start = shape[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    if inner[start:].strip():
        parts.append(inner[start:].strip())
    return parts


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(element type, element count) of every array in a shape; tokens are skipped."""
    out = []
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", shape)):
        if dtype == "token":
            continue
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        out.append((dtype, math.prod(sizes)))
    return out


def _result_shape(opcode: str, shape: str) -> str:
    """The part of an instruction's shape that holds the collective's results."""
    if not opcode.endswith("-start") or opcode == "all-reduce-start":
        return shape
    parts = _tuple_elements(shape)
    if len(parts) < 2:
        return shape
    if opcode == "collective-permute-start":  # (operand, result, u32[] contexts...)
        return parts[1]
    return "(" + ", ".join(parts[len(parts) // 2:]) + ")"  # (operands..., results...)


# ------------------------------------------------------------------------------------------
# replica groups


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]


def _iota(dims: list[int], perm: Optional[list[int]]) -> np.ndarray:
    """The flat device ids of an iota `[dims]T(perm)`: arange reshaped, transposed, flattened."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _list_of_lists(text: str) -> Groups:
    """`{{0,1},{2,3}}` -> ((0, 1), (2, 3)); text starts at the outer brace."""
    body = text[1:_balanced_end(text, 0) - 1]
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", body))


def _mesh_device_ids(ids_text: Optional[str], n: int) -> np.ndarray:
    if ids_text is None:
        return np.arange(n)
    m = re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", ids_text)
    if m:
        return _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)
    values = _ints(ids_text)  # an explicit list, possibly after its dimensions `[2,4]...`
    if len(values) < n:
        raise ValueError(f"device_ids ({ids_text}) lists fewer than {n} devices")
    return np.asarray(values[-n:])


def _mesh_groups(m: re.Match) -> Groups:
    """The groups of a mesh-axes replica group list (see the module docstring)."""
    names, sizes = [], []
    for entry in m.group("axes").split(","):
        a = _MESH_AXIS.fullmatch(entry)
        if a is None:
            raise ValueError(f"cannot read mesh axis {entry!r} in {m.group(0)!r}")
        names.append(a.group(1))
        sizes.append(int(a.group(2)))
    ids = _mesh_device_ids(m.group("ids"), math.prod(sizes))
    refs = []  # (mesh axis index, sub-axis (pre_size, size) or None), in the listed order
    for entry in (e for e in m.group("span").split(",") if e.strip()):
        a = _SPAN_AXIS.fullmatch(entry)
        if a is None or a.group(1) not in names:
            raise ValueError(f"cannot read axis {entry!r} in {m.group(0)!r}")
        sub = (int(a.group(2)), int(a.group(3))) if a.group(2) else None
        refs.append((names.index(a.group(1)), sub))
    # read every mesh axis as one or more dimensions so that each listed (sub-)axis is one
    dims: list[int] = []
    where: dict[tuple[int, Optional[tuple[int, int]]], int] = {}
    for axis, size in enumerate(sizes):
        mine = sorted((sub for ax, sub in refs if ax == axis), key=lambda s: s[0] if s else 0)
        if not mine or mine[0] is None:
            where[(axis, None)] = len(dims)
            dims.append(size)
            continue
        prefix = 1
        for pre, sub_size in mine:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            where[(axis, (pre, sub_size))] = len(dims)
            dims.append(sub_size)
            prefix *= sub_size
        if prefix != size:
            dims.append(size // prefix)
    grouped = [where[r] for r in refs]
    perm = [d for d in range(len(dims)) if d not in grouped] + grouped
    group_size = math.prod(dims[d] for d in grouped)
    rows = ids.reshape(dims).transpose(perm).reshape(-1, group_size)
    return tuple(tuple(int(v) for v in row) for row in rows)


def parse_replica_groups(text: str, num_devices: int) -> Groups:
    """The groups of the replica-group text `text` (what follows `replica_groups=`)."""
    text = text.lstrip()
    if text.startswith("{"):
        groups = _list_of_lists(text)
        return groups if groups else (tuple(range(num_devices)),)
    m = _IOTA.match(text)
    if m:
        shape = _ints(m.group(1))
        flat = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        rows = flat.reshape(shape[0], -1)
        return tuple(tuple(int(v) for v in row) for row in rows)
    m = _MESH.match(text)
    if m:
        return _mesh_groups(m)
    raise ValueError(f"unknown replica group format: {text[:200]!r}")


def _groups(op: str, attrs: str, num_devices: int) -> Groups:
    key = "source_target_pairs=" if op == "collective-permute" else "replica_groups="
    at = attrs.find(key)
    if at < 0:
        if op == "collective-permute":
            raise ValueError(f"collective-permute without source_target_pairs: {attrs[:200]!r}")
        return (tuple(range(num_devices)),)
    rest = attrs[at + len(key):]
    if op == "collective-permute":
        return _list_of_lists(rest.lstrip())
    return parse_replica_groups(rest, num_devices)


# ------------------------------------------------------------------------------------------
# the program


def _module_devices(hlo_text: str) -> int:
    header = next((line for line in hlo_text.splitlines() if line.startswith("HloModule")), "")
    replicas = re.search(r"\breplica_count=(\d+)", header)
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    return (int(replicas.group(1)) if replicas else 1) * (
        int(partitions.group(1)) if partitions else 1)


def _loop_computations(calls: dict[str, set[str]], loop_roots: set[str]) -> set[str]:
    """Every computation reachable from a while loop's body or condition."""
    seen, todo = set(), list(loop_roots)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return seen


def collectives(hlo_text: str, num_devices: Optional[int] = None) -> list[Collective]:
    """Every collective of an HLO module's text, in program text order.

    num_devices: the device count for replica groups `{}` (one group of all devices); by
    default `replica_count * num_partitions` from the module header.
    """
    n = num_devices if num_devices is not None else _module_devices(hlo_text)
    found: list[tuple[str, str, str, str]] = []  # (opcode, shape, attrs, computation)
    calls: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    computation = None
    for line in hlo_text.splitlines():
        if not line[:1].isspace():
            header = _HEADER.match(line)
            computation = header.group(2) if header else None
            continue
        if computation is None:
            continue
        inst = _INSTRUCTION.match(line)
        if inst is None:
            continue
        shape, rest = _split_shape(line[inst.end():])
        opcode = _OPCODE.match(rest)
        if opcode is None:
            continue
        attrs = _QUOTED.sub('""', rest[opcode.end() - 1:])  # operands and attributes
        for key, value in _CALLED.findall(attrs):
            called = set(re.findall(r"[\w.\-]+", value.replace("%", " ")))
            calls.setdefault(computation, set()).update(called)
            if opcode.group(1) == "while" and key in ("body", "condition"):
                loop_roots.update(called)
        name = opcode.group(1)
        if name in OPS or (name.endswith("-start") and name[:-len("-start")] in OPS):
            found.append((name, shape, attrs, computation))
    in_loop = _loop_computations(calls, loop_roots)
    out = []
    for opcode, shape, attrs, comp in found:
        op = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        arrays = _arrays(_result_shape(opcode, shape))
        out.append(Collective(op=op, dtypes=tuple(t for t, _ in arrays),
                              elements=sum(e for _, e in arrays), groups=_groups(op, attrs, n),
                              computation=comp, in_loop=comp in in_loop))
    return out


# ------------------------------------------------------------------------------------------
# mesh axes


def mesh_axes(c: Collective, mesh: AnyMesh) -> frozenset[str]:
    """The axes of `mesh` along which the devices of `c`'s groups differ (union over groups).

    Empty: the collective is trivial (every group a single device, or every pair a device to
    itself). Device id i is the device at flat position i of the mesh (see the module
    docstring). `mesh` may be a `Mesh` or an `AbstractMesh`.
    """
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    total = math.prod(sizes)
    axes: set[str] = set()
    for group in c.groups:
        if any(not 0 <= i < total for i in group):
            raise ValueError(f"device id outside the {total}-device mesh in {group}")
        coords = np.stack(np.unravel_index(np.asarray(group, dtype=np.int64), sizes), axis=1)
        varies = (coords != coords[:1]).any(axis=0)
        axes.update(name for name, v in zip(names, varies) if v)
    return frozenset(axes)


def count(found: Iterable[Collective], mesh: AnyMesh, *, op: Optional[str] = None,
          axes: Union[str, Iterable[str], None] = None, floats: Optional[bool] = None,
          in_loop: Optional[bool] = None) -> int:
    """How many of `found` match every filter given.

    op: the opcode ("all-reduce", ...). axes: the exact set of mesh axes (a name or names;
    `()` for trivial collectives). floats: `Collective.is_float()`. in_loop: `Collective.in_loop`.
    """
    want = frozenset([axes] if isinstance(axes, str) else axes) if axes is not None else None
    return sum(1 for c in found
               if (op is None or c.op == op)
               and (floats is None or c.is_float() == floats)
               and (in_loop is None or c.in_loop == in_loop)
               and (want is None or mesh_axes(c, mesh) == want))

"""Reading collectives and their mesh axes from compiled programs (`tuning/collectives.py`).

Two kinds of test:
  * string tests (any device count): each replica-group format, parsed from hand-written HLO
    lines, against groups worked out by hand; async `-start`/`-done` forms; text in metadata;
    in-loop detection; `mesh_axes` and `count` on an `AbstractMesh`;
  * compiled programs on 8 CPU devices: collectives whose axes are known by construction
    (shard_map psum / all_gather / ppermute / psum_scatter / all_to_all over given axes, GSPMD
    matmuls contracting a sharded dimension, partial-manual shard_maps, a scan) on meshes
    (2, 4), (1, 8), (4, 2), (8, 1), a permuted (2, 4) and a 3-axis (2, 2, 2); the parser must
    give the right axes, and the same groups whatever format XLA printed them in.

The 8-device tests need XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX
starts, so (as in test_parallel.py) `test_on_8_cpu_devices` runs this file again in its own
process with that flag and the tests marked `needs8` run there.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from lookahead_jax.tuning.collectives import (Collective, collectives, count, mesh_axes,
                                              parse_replica_groups)

sys.path.insert(0, os.path.dirname(__file__))
from multidevice import DEVICES, ON_8_CPU_DEVICES, needs8, rerun_on_8_cpu_devices  # noqa: E402

NEEDS8_TESTS = 9  # needs8 tests that run on every JAX version (parametrized cases counted)


@pytest.mark.skipif(ON_8_CPU_DEVICES, reason="already running on 8 CPU devices")
def test_on_8_cpu_devices():
    rerun_on_8_cpu_devices(__file__, min_passed=NEEDS8_TESTS)


# ------------------------------------------------------------------------------------------
# string tests


def module(*lines: str, header: str = "HloModule m, is_scheduled=true, num_partitions=8") -> str:
    body = "\n".join("  " + line for line in lines)
    return f"{header}\n\nENTRY %main.0_spmd (p: f32[8]) -> f32[8] {{\n{body}\n}}\n\n"


def test_explicit_groups():
    assert parse_replica_groups("{{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true", 8) == (
        (0, 2, 4, 6), (1, 3, 5, 7))
    assert parse_replica_groups("{{0},{1},{2}}", 3) == ((0,), (1,), (2,))
    assert parse_replica_groups("{}, to_apply=%add", 4) == ((0, 1, 2, 3),)


def test_all_devices_from_header_or_argument():
    line = "%a = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={}, to_apply=%add"
    assert collectives(module(line))[0].groups == (tuple(range(8)),)  # num_partitions=8
    assert collectives(module(line), num_devices=2)[0].groups == ((0, 1),)
    header = "HloModule m, replica_count=2, num_partitions=2"
    assert collectives(module(line, header=header))[0].groups == ((0, 1, 2, 3),)
    no_groups = "%a = f32[4]{0} all-reduce(%p), channel_id=1, to_apply=%add"
    assert collectives(module(no_groups))[0].groups == (tuple(range(8)),)


@pytest.mark.parametrize("text, groups", [
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
    # arange(8).reshape(4,2).T = [[0,2,4,6],[1,3,5,7]]
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    # arange(8).reshape(2,4).T = [[0,4],[1,5],[2,6],[3,7]]
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    # arange(8).reshape(2,2,2).transpose(0,2,1) flattened = 0,2,1,3,4,6,5,7
    ("[2,4]<=[2,2,2]T(0,2,1), use_global_device_ids=true", ((0, 2, 1, 3), (4, 6, 5, 7))),
    ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
])
def test_iota_groups(text, groups):
    assert parse_replica_groups(text, 8) == groups


@pytest.mark.parametrize("text, groups", [
    # the GSPMD all-reduce over "model" of a (2, 4) mesh: device_ids = 0,4,1,5,2,6,3,7 placed
    # on the (1, 4, 2) mesh; a group varies axis_1 at fixed axis_2
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     ((0, 1, 2, 3), (4, 5, 6, 7))),
    # iota device ids (none printed): (1, 2, 4) mesh, groups vary axis_1
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['axis_0'=1,'axis_1'=8], device_ids=([8]) {'axis_1'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    # device_ids 0,2,1,3,4,6,5,7 on (1, 4, 2): axis_2 = 0 holds 0,1,4,5; axis_2 = 1 holds 2,3,6,7
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}",
     ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_0'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    # several axes: members listed with the first named axis major
    ("mesh['a'=2,'b'=2,'c'=2] {'a','c'}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=2] {'axis_1','axis_3'}",
     ((0, 1, 4, 5), (2, 3, 6, 7))),
    # no axis: every device alone
    ("mesh['a'=2,'b'=2] {}", ((0,), (1,), (2,), (3,))),
    # sub-axes: x = 8 read as [2, 2, 2]; 'x':(2)2 is the middle factor, 'x':(1)2 the major one
    ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['x'=8] {'x':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['x'=4,'y'=2] {'x':(2)2,'y'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    # an explicit (non-iota) device list
    ("mesh['a'=2,'b'=2], device_ids=(3,1,0,2) {'b'}", ((3, 1), (0, 2))),
    # unquoted axis names
    ("mesh[x=2,y=4] {y}", ((0, 1, 2, 3), (4, 5, 6, 7))),
])
def test_mesh_groups(text, groups):
    assert parse_replica_groups(text + ", use_global_device_ids=true", 8) == groups


def test_unknown_format_raises():
    with pytest.raises(ValueError, match="unknown replica group format"):
        parse_replica_groups("groups(0,1)", 8)
    with pytest.raises(ValueError):
        parse_replica_groups("mesh['a'=2] {'b'}", 2)


def test_real_lines():
    hlo = module(
        '%all_gather.7 = s32[2,8]{1,0} all-gather(%bitcast), channel_id=1, replica_groups='
        '{{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true, metadata={'
        'op_name="jit(body)/shard_map/all_gather" stack_frame_id=4}',
        '%all-reduce.1 = f32[8,8]{1,0} all-reduce(%ynn_fusion), channel_id=2, replica_groups='
        '[2,4]<=[8], use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit('
        'body)/shard_map/dot_general" stack_frame_id=5}',
        "ROOT %all-reduce = f32[8,8]{1,0} all-reduce(%ynn_fusion), channel_id=1, replica_groups="
        "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, "
        "use_global_device_ids=true, to_apply=%add.clone",
        "%ppermute.3 = f32[4,4]{1,0} collective-permute(%param.1), channel_id=1, "
        "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
        "%all-to-all = (f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0},"
        " /*index=5*/f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0}) all-to-all(%w, %w.1, %w.2, %w.3,"
        " %w.4, /*index=5*/%w.5, %w.6, %w.7), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
    )
    found = collectives(hlo)
    assert found == [
        Collective("all-gather", ("s32",), 16, ((0, 4), (1, 5), (2, 6), (3, 7)), "main.0_spmd",
                   False),
        Collective("all-reduce", ("f32",), 64, ((0, 1, 2, 3), (4, 5, 6, 7)), "main.0_spmd", False),
        Collective("all-reduce", ("f32",), 64, ((0, 1, 2, 3), (4, 5, 6, 7)), "main.0_spmd", False),
        Collective("collective-permute", ("f32",), 16, ((0, 1), (1, 2), (2, 3), (3, 0)),
                   "main.0_spmd", False),
        Collective("all-to-all", ("f32",) * 8, 16, (tuple(range(8)),), "main.0_spmd", False),
    ]
    assert [c.is_float() for c in found] == [False, True, True, True, True]


def test_async_forms_counted_once():
    hlo = module(
        "%ars = f32[4,8]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1},{2,3}}, "
        "to_apply=%add",
        "%ard = f32[4,8]{1,0} all-reduce-done(%ars)",
        "%ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), channel_id=2, "
        "replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true",
        "%agd = f32[16,8]{1,0} all-gather-done(%ags)",
        "%ags2 = ((s32[2]{0}, bf16[2]{0}), (s32[8]{0}, bf16[8]{0})) all-gather-start(%a, %b), "
        "channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}",
        "%agd2 = (s32[8]{0}, bf16[8]{0}) all-gather-done(%ags2)",
        "%cps = (s32[4]{0}, s32[4]{0}, u32[], u32[]) collective-permute-start(%q), channel_id=4, "
        "source_target_pairs={{0,2},{2,0}}",
        "%cpd = s32[4]{0} collective-permute-done(%cps)",
    )
    found = collectives(hlo, num_devices=4)
    assert [(c.op, c.dtypes, c.elements) for c in found] == [
        ("all-reduce", ("f32",), 32), ("all-gather", ("f32",), 128),
        ("all-gather", ("s32", "bf16"), 16), ("collective-permute", ("s32",), 4)]
    assert found[1].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert found[3].groups == ((0, 2), (2, 0))
    assert [c.is_float() for c in found] == [True, True, True, False]


def test_text_outside_the_opcode_is_not_counted():
    hlo = module(
        '%x = f32[4]{0} add(%a, %b), metadata={op_name="all-reduce(x) all-gather-start(y)"}',
        '%y = f32[4]{0} custom-call(%x), custom_call_target="all-reduce", backend_config="{}"',
        "%all-reduce.z = f32[4]{0} copy(%y)",
    ) + "FileNames\n1 \"all-reduce(.py\"\n"
    assert collectives(hlo) == []


def test_in_loop():
    hlo = "\n".join([
        "HloModule m, num_partitions=4",
        "",
        "%add (x: f32[], y: f32[]) -> f32[] {",
        "  ROOT %s = f32[] add(%x, %y)",
        "}",
        "",
        "%inner (p: f32[4]) -> f32[4] {",
        "  ROOT %ar.in = f32[4]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add",
        "}",
        "",
        "%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {",
        "  %g = f32[4]{0} get-tuple-element(%t), index=1",
        "  %c = f32[4]{0} call(%g), to_apply=%inner",
        "  %ar.body = f32[4]{0} all-reduce(%c), replica_groups={{0,2},{1,3}}, to_apply=%add",
        "  ROOT %r = (s32[], f32[4]) tuple(%i, %ar.body)",
        "}",
        "",
        "%cond (t: (s32[], f32[4])) -> pred[] {",
        "  ROOT %lt = pred[] compare(%i, %n), direction=LT",
        "}",
        "",
        "%branch (p: s32[2]) -> s32[8] {",
        "  ROOT %ag.branch = s32[8]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}",
        "}",
        "",
        "ENTRY %main (p: f32[4]) -> f32[4] {",
        "  %w = (s32[], f32[4]) while(%t0), condition=%cond, body=%body",
        "  %k = s32[8]{0} conditional(%pr, %ids), true_computation=%branch, "
        "false_computation=%branch",
        "  ROOT %ar.entry = f32[4]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add",
        "}",
    ])
    found = {c.computation + ":" + c.op: c.in_loop for c in collectives(hlo)}
    assert found == {"inner:all-reduce": True, "body:all-reduce": True,
                     "branch:all-gather": False, "main:all-reduce": False}


def test_mesh_axes_and_count():
    mesh = AbstractMesh((2, 4), ("lookahead", "model"))

    def c(op, groups, dtype="f32", in_loop=False):
        return Collective(op, (dtype,), 8, groups, "main", in_loop)

    found = [
        c("all-reduce", ((0, 1, 2, 3), (4, 5, 6, 7)), in_loop=True),
        c("all-reduce", ((0, 1), (2, 3), (4, 5), (6, 7)), in_loop=True),
        c("all-gather", ((0, 4), (1, 5), (2, 6), (3, 7)), dtype="s32"),
        c("all-reduce", (tuple(range(8)),)),
        c("all-reduce", tuple((i,) for i in range(8))),
        c("collective-permute", ((0, 1), (1, 2), (2, 3), (3, 0))),
        c("collective-permute", ((0, 4), (4, 0))),
        c("collective-permute", tuple((i, i) for i in range(8))),
    ]
    assert [mesh_axes(f, mesh) for f in found] == [
        {"model"}, {"model"}, {"lookahead"}, {"lookahead", "model"}, set(), {"model"},
        {"lookahead"}, set()]
    assert count(found, mesh, op="all-reduce", axes="model", in_loop=True) == 2
    assert count(found, mesh, axes="lookahead", floats=False) == 1
    assert count(found, mesh, axes=("model", "lookahead")) == 1
    assert count(found, mesh, axes=()) == 2
    assert count(found, mesh, floats=True, in_loop=False) == 5
    assert count(found, mesh) == len(found)
    with pytest.raises(ValueError, match="outside"):
        mesh_axes(c("all-reduce", ((0, 8),)), mesh)


# ------------------------------------------------------------------------------------------
# compiled programs on 8 CPU devices


def sm(f, mesh, in_specs, out_specs, **kw):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                         **kw)


def compiled(f, *args, **jit_kw) -> str:
    return jax.jit(f, **jit_kw).lower(*args).compile().as_text()


def check(hlo: str, mesh, want_axes, ops, *, dtype="f32", in_loop=False) -> list[Collective]:
    """Every collective of `hlo` is one of `ops`, spans exactly the non-trivial part of
    `want_axes` (a size-1 axis spans nothing), has `dtype`, and at least one is there unless
    all of `want_axes` are trivial (XLA may then drop it)."""
    want = frozenset(a for a in want_axes if mesh.shape[a] > 1)
    found = collectives(hlo)
    for c in found:
        assert c.op in ops and mesh_axes(c, mesh) == want, (c, want)
        assert set(c.dtypes) == {dtype} and c.in_loop == in_loop, c
    assert found or not want, hlo
    return found


def group_sets(found: list[Collective]) -> set[frozenset[frozenset[int]]]:
    return {frozenset(frozenset(g) for g in c.groups) for c in found}


def make_mesh(shape, perm=None):
    devices = np.array(jax.devices()[:DEVICES])
    return Mesh((devices[perm] if perm else devices).reshape(shape), ("lookahead", "model"))


MESHES = [((2, 4), None), ((1, 8), None), ((4, 2), None), ((8, 1), None),
          ((2, 4), [3, 1, 7, 5, 0, 6, 2, 4])]


@needs8
@pytest.mark.parametrize("shape, perm", MESHES)
def test_shard_map_collectives(shape, perm):
    mesh = make_mesh(shape, perm)
    x = jnp.ones((8, 16))
    spec = P("lookahead", "model")
    explicit = {}
    for axes in [("model",), ("lookahead",), ("lookahead", "model")]:
        out = P(*[None if a in axes else a for a in ("lookahead", "model")])
        f = sm(lambda a, axes=axes: jax.lax.psum(a, axes), mesh, spec, out)
        explicit[axes] = check(compiled(f, x), mesh, axes, {"all-reduce"})
    ids = jnp.arange(16, dtype=jnp.int32)
    f = sm(lambda a: jax.lax.all_gather(a, "lookahead", tiled=True), mesh, P("lookahead"), P())
    check(compiled(f, ids), mesh, ("lookahead",), {"all-gather"}, dtype="s32")
    m = shape[1]
    pairs = [(i, (i + 1) % m) for i in range(m)]
    f = sm(lambda a: jax.lax.ppermute(a, "model", pairs), mesh, spec, spec)
    check(compiled(f, x), mesh, ("model",), {"collective-permute"})
    f = sm(lambda a: jax.lax.psum_scatter(a, "model", tiled=True), mesh, P(None, "model"),
           P("model"))
    check(compiled(f, jnp.ones((32, 16))), mesh, ("model",), {"reduce-scatter"})
    f = sm(lambda a: jax.lax.all_to_all(a, "model", 0, 1, tiled=True), mesh, P(None, "model"),
           P("model"))
    check(compiled(f, jnp.ones((8, 16))), mesh, ("model",), {"all-to-all"})

    # GSPMD (no shard_map): a matmul contracting a dimension sharded over `axes` all-reduces
    # over them, in the mesh-axes format; its groups are the shard_map psum's
    rep = NamedSharding(mesh, P())
    for axes in [("model",), ("lookahead",), ("lookahead", "model"), ("model", "lookahead")]:
        xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, axes)))
        ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(axes, None)))
        found = check(compiled(lambda a, b: a @ b, xs, ws, out_shardings=rep), mesh, axes,
                      {"all-reduce"})
        if found:
            assert group_sets(found) == group_sets(explicit[tuple(sorted(axes))])

    # partial manual: int32 ids gathered over the manual axis, the matmul over the auto axis
    for manual, auto in [("lookahead", "model"), ("model", "lookahead")]:
        xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, auto)))
        ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(auto, None)))

        def body(i, a, b, manual=manual):
            return jax.lax.all_gather(i, manual), a @ b

        f = sm(body, mesh, (P(manual), P(), P()), (P(), P()), axis_names={manual})
        found = collectives(compiled(f, ids, xs, ws))
        big = {a for a in (manual, auto) if mesh.shape[a] > 1}
        assert count(found, mesh, op="all-gather", axes=big & {manual}, floats=False) == 1
        assert count(found, mesh, axes=manual, floats=True) == 0
        assert count(found, mesh, op="all-reduce", axes=auto, floats=True) == (auto in big)
        assert len(found) == 1 + (auto in big), found
        reduce = [c for c in found if c.op == "all-reduce"]
        if reduce:
            assert group_sets(reduce) == group_sets(explicit[(auto,)])


@needs8
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_psum_in_a_scan_is_in_loop(shape):
    mesh = make_mesh(shape)

    def layers(x, w):
        def step(c, wi):
            return jax.lax.psum(c[:, :wi.shape[0]] @ wi, "model"), None
        return jax.lax.scan(step, x, w)[0]

    f = sm(layers, mesh, (P(), P(None, "model", None)), P())
    found = check(compiled(f, jnp.ones((4, 16)), jnp.ones((3, 16, 16))), mesh, ("model",),
                  {"all-reduce"}, in_loop=True)
    assert count(found, mesh, op="all-reduce", axes="model", in_loop=True) == 1
    assert found[0].computation != re.search(r"ENTRY %([\w.\-]+)", compiled(
        f, jnp.ones((4, 16)), jnp.ones((3, 16, 16)))).group(1)


FORMATS_RECORDED_ON = "0.10.2"  # the jaxlib whose XLA printed the forms asserted below


@needs8
@pytest.mark.skipif(jax.__version__ != FORMATS_RECORDED_ON,
                    reason=f"the replica-group forms were recorded on JAX {FORMATS_RECORDED_ON}'s "
                           f"XLA, and other versions print other ones; the semantic tests above "
                           f"(axes and groups of real programs) run on every version")
def test_formats_seen_on_cpu():
    """The 8-device tests above exercise every format: explicit, iota (with a transpose),
    mesh-axes with and without device_ids."""
    mesh = make_mesh((2, 4))
    ids = jnp.arange(16, dtype=jnp.int32)
    xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "lookahead")))
    ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("lookahead", None)))
    f = sm(lambda i, a, b: (jax.lax.all_gather(i, "model"), a @ b), mesh,
           (P("model"), P(), P()), (P(), P()), axis_names={"model"})
    hlo = compiled(f, ids, xs, ws)
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo
    assert "replica_groups=[4,2]<=[2,4]T(1,0)" in hlo
    xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "model")))
    ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("model", None)))
    hlo = compiled(lambda a, b: a @ b, xs, ws, out_shardings=NamedSharding(mesh, P()))
    assert re.search(r"replica_groups=mesh\[[^\]]*\], device_ids=\(\[2,4\]T\(1,0\)\)", hlo)
    xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "lookahead")))
    ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("lookahead", None)))
    hlo = compiled(lambda a, b: a @ b, xs, ws, out_shardings=NamedSharding(mesh, P()))
    assert re.search(r"replica_groups=mesh\[[^\]]*\] \{", hlo)


@needs8
def test_ids_are_mesh_positions():
    """On a permuted mesh the program's ids are mesh positions, not the devices' .id."""
    permuted = make_mesh((2, 4), [3, 1, 7, 5, 0, 6, 2, 4])
    f = sm(lambda a: jax.lax.psum(a, "model"), permuted, P("lookahead", "model"), P("lookahead"))
    (c,) = collectives(compiled(f, jnp.ones((8, 16))))
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and mesh_axes(c, permuted) == {"model"}


@needs8
def test_three_axis_mesh():
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(2, 2, 2), ("a", "b", "c"))
    rep = NamedSharding(mesh, P())
    for axes in [("a", "c"), ("c", "a"), ("b",), ("a", "b", "c")]:
        xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, axes)))
        ws = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(axes, None)))
        (c,) = collectives(compiled(lambda a, b: a @ b, xs, ws, out_shardings=rep))
        f = sm(lambda v, axes=axes: jax.lax.psum(v, axes), mesh, P(("a", "b", "c")), P())
        (ref,) = collectives(compiled(f, jnp.ones((8,))))
        assert mesh_axes(c, mesh) == mesh_axes(ref, mesh) == set(axes)
        assert group_sets([c]) == group_sets([ref])

"""Helpers shared by the FX passes: op handles, argument binding, node creation with
fake values, and the per-node record that inspection reads.

Every node a pass creates carries ``meta["val"]`` (a FakeTensor computed with the
graph's own fake mode), because later passes and Inductor's lowering read it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ..dispatch.route import Route, cat_problem_of, route
from ..ops.schemas import check_ec_shapes, out_features

W4A16 = torch.ops.spear.w4a16_linear.default
EC_LINEAR = torch.ops.spear.ec_linear.default
SPEAR_OPS = (W4A16, EC_LINEAR)
EC_PARAMS = ("A", "B", "W1", "b1", "W2", "b2", "alpha")

META_KEY = "spear"  # node.meta["spear"]: dict read by inspect/ (source form, EC rank, lowering, reason)


def bind(node: fx.Node) -> dict[str, Any]:
    """Bind a call's args/kwargs to its schema names, filling defaults."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def positional(target, kwargs: dict[str, Any]) -> tuple:
    """Schema-ordered positional args (Inductor's fallback lowering wants positional args)."""
    out = []
    for arg in target._schema.arguments:
        if arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise TypeError(f"{target}: missing argument {arg.name!r}")
    return tuple(out)


def call_op(graph: fx.Graph, target, kwargs: dict[str, Any]) -> fx.Node:
    """Insert a spear op from schema-named arguments."""
    return call(graph, target, positional(target, kwargs))


def fake_mode_of(graph: fx.Graph):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


def _fake(a, fake_mode):
    if isinstance(a, fx.Node):
        return a.meta["val"]
    if isinstance(a, (list, tuple)):
        return type(a)(_fake(x, fake_mode) for x in a)
    return a


def call(graph: fx.Graph, target, args: tuple = (), kwargs: Optional[dict] = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point with ``meta['val']`` set."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(graph)
    if mode is not None:
        with mode:
            node.meta["val"] = target(*_fake(args, mode), **{k: _fake(v, mode) for k, v in kwargs.items()})
    return node


_NOT_COPIED = ("val", "tensor_meta", "eager_input_vals", META_KEY)


def copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """Carry provenance (stack trace, module stack) to a replacement node, not the old values."""
    dst.meta.update({k: v for k, v in src.meta.items() if k not in _NOT_COPIED})


def record(node: fx.Node, **info: Any) -> None:
    node.meta.setdefault(META_KEY, {}).update(info)


def integer_source(node: fx.Node) -> Optional[fx.Node]:
    """Walk up from an integer weight expression to the single graph input it comes from."""
    seen, stack, found = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op == "get_attr":
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and not v.is_floating_point():
                found.append(n)
            continue
        stack.extend(a for a in n.all_input_nodes)
    return found[0] if len(found) == 1 else None


def replace_with_op(graph: fx.Graph, anchor: fx.Node, target, kwargs: dict[str, Any]) -> fx.Node:
    """Insert ``target(**kwargs)`` before ``anchor``, move its uses and provenance over, erase it."""
    with graph.inserting_before(anchor):
        new = call_op(graph, target, kwargs)
    copy_meta(anchor, new)
    anchor.replace_all_uses_with(new)
    graph.erase_node(anchor)
    return new


def emit_spear_linear(graph: fx.Graph, anchor: fx.Node, ctx, kwargs: dict, weight_node: Optional[fx.Node],
                      source_form: str) -> fx.Node:
    """Replace ``anchor`` by a spear linear built from ``kwargs`` (w4a16 schema names).

    If an EC is registered for ``weight_node``'s real tensor, the backend has added its
    parameters as extra graph inputs; the node becomes ``spear::ec_linear`` reading them.
    """

    x_val = kwargs["x"].meta["val"]
    K = x_val.shape[-1]
    N = out_features(kwargs["qweight"].meta["val"], kwargs["scales"].meta["val"], kwargs["layout"])
    weight_name = ctx.name_of(weight_node) if weight_node is not None else "?"
    ec_rank = None
    ec_inputs = ctx.ec_inputs_of(weight_node) if weight_node is not None else None
    if ec_inputs is not None:
        nodes, ec, ec_name = ec_inputs
        where = f"spear backend: EC registered for {ec_name or weight_name}"
        check_ec_shapes(K, N, ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, where)
        new = replace_with_op(graph, anchor, EC_LINEAR, {**kwargs, **nodes, "act": ec.act})
        ec_rank = ec.rank
    else:
        new = replace_with_op(graph, anchor, W4A16, kwargs)
    record(new, source_form=source_form, weight=weight_name, ec_rank=ec_rank, N=int(N), K=int(K),
           group_size=kwargs["group_size"], layout=kwargs["layout"])
    return new


def cat_route(kw: dict, op: str, norm: bool, M: int = 1) -> Optional[Route]:
    """The route of a decode concatenation / GLU op (``op``: w4a16_cat, w4a16_glu, ec_cat, ec_glu) over the
    parts in ``kw`` (a ``w4a16_linear_cat`` / ``ec_linear_cat``'s bound arguments, or the op's own), asked
    from the graph's fake values as the runtime asks it at ``M`` rows; None where a value is missing."""
    x = kw["x"].meta.get("val")
    vals = {k: [getattr(n, "meta", {}).get("val") if n is not None else None for n in kw.get(k) or ()]
            for k in ("qweights", "scales", "zeros", "biases", "As", "Bs", "W1s")}
    if x is None or any(v is None for v in vals["qweights"] + vals["scales"]):
        return None
    ec = op.startswith("ec")
    p = cat_problem_of(op, x, vals["qweights"], vals["scales"], vals["zeros"], kw["group_size"], vals["biases"],
                       vals["As"] if ec else None, vals["Bs"] if ec else None, vals["W1s"] if ec else None,
                       layout=kw["layout"], norm=norm, M=M)
    return route(p)

"""Decoder-with-past ONNX files (optimum's and torch.onnx's export of a decoder step) as in-place
generation over a preallocated KV cache.

Such a file takes `past_key_values.N.key/.value` [B, Hkv, past, D], Concats each with the step's
new rows along the sequence axis into graph output `present.N.key/.value`, and attends over the
concatenation: MatMul(Q, Transpose(K)) x scale (+ the attention mask) -> Softmax -> MatMul(., V),
K and V repeated per query head by Unsqueeze/Expand/Reshape (transformers' repeat_kv) for
grouped-query attention. The scale may sit on Q or on K^T instead: torch's dynamo exporter at
opset 18 writes SDPA out with Q and K^T each x sqrt(scale), K^T a 3D Transpose between two
computed Reshapes (taken where ONNX's shape inference shows it is K^T), and Where(IsNaN(p), 0, p)
after the Softmax; at opset 23 it writes ONNX Attention. Imported as it is, its past length is a symbol and every step copies
the whole cache into a new, longer one.

`import_decoder` imports it as the model the GGUF frontend builds (frontends/gguf/llama.py), so
tilegraph.generation.LanguageModel runs either: inputs `input_ids` [B, T], `pos` i64[B] (where
each sequence's new rows go), `last` i64[B] (which of the B*T logits rows each sequence's next
token comes from), and each layer's K and V cache [B, Hkv, S, D], donated (results 1.. alias
them); result 0 the logits [B, vocab] of the `last` rows; with sampling, `seen` and `u` in and
`next` out (tg.sample). Each past/present Concat becomes tg.cache_write at `pos` (in place), and
each attention reading the concatenation tg.cache_attention over the cache: causal over the
positions written so far, every sequence dense (no padding inside a sequence), which is what a
generation loop feeds (onnxruntime-genai feeds the same). `position_ids` become pos + t. The
attention mask, and whatever the file computes from the past length (the mask, repeat_kv's
expand shapes), are left out: a node that still needs them after the rewrite makes the file
one this import refuses, by name (KVCacheError), as does any part of the pattern that does not
match; `from_onnx` still imports such a file as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.importer import _Importer
from tilegraph.frontends.onnx.load import check_supported, load_model
from tilegraph.frontends.onnx.values import tensor_array
from tilegraph.ir.builder import Tensor
from tilegraph.ir.model import Model
from tilegraph.ir.shapes import Dim, TensorInfo

PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
KINDS = ("key", "value")
SEQUENCE_AXIS = 2  # of [B, Hkv, S, D]


class KVCacheError(FrontendError):
    """A decoder file whose past/present KV pattern the in-place import cannot take."""


@dataclass(frozen=True)
class Attention:
    """One attention over layer `layer`'s cache: its result is the value `output` (the MatMul of
    the probabilities with V), its query the value `q`, its scores scaled by `scale`."""

    layer: int
    output: str
    q: str
    scale: float


@dataclass
class DecoderPlan:
    """What import_decoder rewrites in a file: per layer the past inputs, the Concat outputs
    (the presents) and the new rows they append; the attentions; the nodes still needed."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: int  # the past inputs' ONNX element type
    past: list[tuple[str, str]]  # per layer: the key and value graph inputs
    writes: dict[str, tuple[int, int, str]]  # present value -> (layer, 0 key / 1 value, the new rows' value)
    attentions: dict[str, Attention]  # by output value
    presents: dict[tuple[int, int], str]  # (layer, 0 key / 1 value) -> the present graph output
    fused: dict[str, tuple[int, object]] = field(default_factory=dict)  # GroupQueryAttention nodes: output 0 -> (layer, node)
    live: list = field(default_factory=list)  # the nodes to convert, in the file's order
    logits: str = "logits"


def _consumers(graph) -> dict[str, list]:
    out: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            out.setdefault(i, []).append(node)
    return out


def _reads(node) -> set[str]:
    """Every value `node` reads, the outer names its subgraphs read included."""
    from onnx import AttributeProto

    names = {i for i in node.input if i}
    for a in node.attribute:
        for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS
                  else []):
            for sub in g.node:
                names |= _reads(sub)
    return names


def plan_decoder(proto) -> DecoderPlan:
    """Find the past/present pattern of `proto`; KVCacheError naming what does not match."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    consumers = _consumers(graph)
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name for o in graph.output}
    initializers = {t.name: t for t in graph.initializer}

    def attr(node, name, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def constant(name) -> np.ndarray | None:
        if name in initializers:
            return tensor_array(initializers[name], f"initializer '{name}'")
        n = producer.get(name)
        if n is not None and n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            return numpy_helper.to_array(n.attribute[0].t)
        return None

    past: dict[int, dict[int, str]] = {}
    for name in inputs:
        m = PAST.fullmatch(name)
        if m:
            past.setdefault(int(m.group(1)), {})[KINDS.index(m.group(2))] = name
    if not past:
        raise KVCacheError("no graph input is named past_key_values.N.key / .value: not a decoder-with-past file")
    layers = len(past)
    if sorted(past) != list(range(layers)) or any(len(kv) != 2 for kv in past.values()):
        raise KVCacheError(f"the past inputs do not form layers 0..{layers - 1}, each a key and a value: "
                           f"{sorted(n for kv in past.values() for n in kv.values())}")
    for required in ("input_ids", "logits"):
        if required not in inputs and required not in outputs:
            raise KVCacheError(f"a decoder file has an input_ids input and a logits output; '{required}' is missing")

    shapes, dtypes_ = set(), set()
    writes: dict[str, tuple[int, int, str]] = {}
    presents: dict[tuple[int, int], str] = {}
    fused: dict[str, tuple[int, object]] = {}
    for layer, kv in past.items():
        for kind, name in kv.items():
            tt = inputs[name].type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            users = consumers.get(name, [])
            gqa = [n for n in users if (n.domain, n.op_type) == ("com.microsoft", "GroupQueryAttention")]
            if gqa and len(dims) == 4 and dims[3] is None:  # onnxruntime-genai's kv_cache_dim: the rotary table's
                dims[3] = _gqa_head_dim(gqa[0], constant)
            if len(dims) != 4 or dims[1] is None or dims[3] is None:
                raise KVCacheError(f"graph input '{name}' must be [batch, kv_heads, past, head_dim] with kv_heads "
                                   f"and head_dim fixed; it is declared {dims}")
            shapes.add((dims[1], dims[3]))
            dtypes_.add(tt.elem_type)
            if gqa:  # onnxruntime-genai's fused attention reads the past and makes the present itself
                node = gqa[0]
                if len(gqa) != 1 or len(node.input) <= 4 or node.input[3 + kind] != name \
                        or len(node.output) < 3 or node.output[1 + kind] not in outputs:
                    raise KVCacheError(f"GroupQueryAttention '{node.name}' takes '{name}' other than as its past "
                                       f"{KINDS[kind]} with its present a graph output")
                presents[(layer, kind)] = node.output[1 + kind]
                fused[node.output[0]] = (layer, node)
                continue
            concats = [n for n in users if n.op_type == "Concat"]  # other readers (its Shape) must end up unused
            concat = concats[0] if len(concats) == 1 else None
            if concat is None or len(concat.input) != 2 or concat.input[0] != name \
                    or attr(concat, "axis") not in (SEQUENCE_AXIS, SEQUENCE_AXIS - 4):
                raise KVCacheError(f"graph input '{name}' is read by {[(n.op_type, n.name) for n in users]}; a "
                                   "past is appended to by one Concat(past, new rows) along axis 2")
            if concat.output[0] not in outputs:
                raise KVCacheError(f"the Concat of '{name}' ('{concat.name}') is not a graph output (the present)")
            writes[concat.output[0]] = (layer, kind, concat.input[1])
            presents[(layer, kind)] = concat.output[0]
    if len(shapes) != 1 or len(dtypes_) != 1:
        raise KVCacheError(f"the past inputs differ in kv_heads/head_dim {sorted(shapes)} or element type")
    (kv_heads, head_dim), = shapes
    present = presents

    def unrepeat(name: str) -> str:
        """The value a repeat_kv (Unsqueeze at axis 2 -> Expand -> Reshape) was applied to, else `name`."""
        r = producer.get(name)
        e = producer.get(r.input[0]) if r is not None and r.op_type == "Reshape" else None
        u = producer.get(e.input[0]) if e is not None and e.op_type == "Expand" else None
        if u is None or u.op_type != "Unsqueeze":
            return name
        axes = attr(u, "axes")
        if axes is None and len(u.input) > 1:
            axes = constant(u.input[1])
        return u.input[0] if axes is not None and list(np.atleast_1d(axes)) == [SEQUENCE_AXIS] else name

    def unscaled(name: str) -> tuple[str, float]:
        """(x, s) where `name` is x * s or x / (1 / s) with s a scalar constant, else (name, 1)."""
        node = producer.get(name)
        if node is None or node.op_type not in ("Mul", "Div"):
            return name, 1.0
        for x, c in ((0, 1), (1, 0)) if node.op_type == "Mul" else ((0, 1),):
            factor = constant(node.input[c])
            scalar = factor is not None and factor.size == 1 and factor.dtype.kind in "fiu"
            value = float(factor.reshape(())) if scalar else 0.0
            if value != 0.0 and np.isfinite(value):  # (x / 0 is no scaling the attention can take)
                return node.input[x], value if node.op_type == "Mul" else 1.0 / value
        return name, 1.0

    def scores_of(scores: str):
        """(the MatMul(Q, K^T) node, the scale, the layer's key write) of scaled scores, else None.
        The scale is the scores' factor times K^T's (torch's decomposed SDPA scales Q and K^T each
        by sqrt(scale)); a factor on Q stays in the query the attention reads."""
        scores, scale = unscaled(scores)
        qk = producer.get(scores)
        if qk is None or qk.op_type != "MatMul":
            return None
        kt_name, k_scale = unscaled(qk.input[1])
        k = transposed_key(kt_name)
        key = writes.get(unrepeat(k)) if k is not None else None
        return (qk, scale * k_scale, key) if key is not None and key[1] == 0 else None

    def transposed_key(kt_name: str) -> str | None:
        """K where `kt_name` is K^T: Transpose(K, [0, 1, 3, 2]), or (torch's decomposed SDPA at
        opset 18) Reshape(Transpose(Reshape(K) to [B*H, S, D], [0, 2, 1])) to [B, H, D, S]."""
        kt = producer.get(kt_name)
        if kt is not None and kt.op_type == "Transpose" and list(attr(kt, "perm", [])) == [0, 1, 3, 2]:
            return kt.input[0]
        t = producer.get(kt.input[0]) if kt is not None and kt.op_type == "Reshape" else None
        flat = producer.get(t.input[0]) if t is not None and t.op_type == "Transpose" \
            and list(attr(t, "perm", [])) == [0, 2, 1] else None
        if flat is None or flat.op_type != "Reshape":
            return None
        k, dims = flat.input[0], inferred_dims()  # the Reshapes' targets are computed: their shapes say
        known = all(d is not None for n in (k, flat.output[0], kt.output[0]) for d in dims.get(n, [None]))
        if not known or len(dims[k]) != 4 or len(dims[flat.output[0]]) != 3:
            return None
        b, h, s, d = dims[k]
        return k if dims[flat.output[0]][1:] == [s, d] and dims[kt.output[0]] == [b, h, d, s] else None

    inferred: dict[str, list] = {}

    def inferred_dims() -> dict[str, list]:
        """Every value's dims (an int, a symbol, None unknown) by ONNX's shape inference with its data
        propagation (Shape -> Slice -> Concat targets), run once and only for files that need it. Two
        dims with one symbol are equal; a symbol the exporter chose is not trusted (cleared first)."""
        from onnx import shape_inference

        if not inferred:
            # the graph without its value_info, large initializers as inputs of their type (no copy of
            # the weights; shape targets and other small constants keep their values)
            small = [t for t in graph.initializer if int(np.prod(t.dims, dtype=np.int64)) <= 64]
            typed = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer
                     if int(np.prod(t.dims, dtype=np.int64)) > 64 and t.name not in inputs]
            bare = helper.make_model(helper.make_graph(graph.node, "shapes", [*graph.input, *typed], graph.output,
                                                       small), opset_imports=list(proto.opset_import))
            bare.ir_version = proto.ir_version
            bare.functions.extend(proto.functions)
            try:
                done = shape_inference.infer_shapes(bare, data_prop=True)
            except Exception:  # noqa: BLE001 - inference refusing the file: nothing is known
                done = bare
            for v in [*done.graph.input, *done.graph.value_info, *done.graph.output]:
                tt = v.type.tensor_type
                inferred[v.name] = [x.dim_value if x.HasField("dim_value") else x.dim_param or None
                                    for x in tt.shape.dim] if tt.HasField("shape") else [None]
        return inferred

    def nan_guard(probs: str, users: list) -> bool:
        """`users` of the probabilities are Where(IsNaN(p), 0, p) (torch's decomposed SDPA: a row with
        every key masked gives 0, not NaN); a causal row always sees its own key, so it passes p."""
        isnan = next((u for u in users if u.op_type == "IsNaN"), None)
        where = next((u for u in users if u.op_type == "Where"), None)
        zero = constant(where.input[1]) if where is not None else None
        return len(users) == 2 and isnan is not None and where is not None and list(where.input[::2]) == [
            isnan.output[0], probs] and consumers.get(isnan.output[0]) == [where] and zero is not None \
            and zero.size == 1 and zero.dtype.kind in "fiub" and float(zero.reshape(())) == 0.0

    attentions: dict[str, Attention] = {}
    masks: dict[str, int] = {}  # the values added to each layer's scores -> a layer that adds it
    for softmax in (n for n in graph.node if n.op_type == "Softmax"):
        found, add, mask = scores_of(softmax.input[0]), producer.get(softmax.input[0]), None
        if found is None and add is not None and add.op_type == "Add":  # scores + the attention mask
            for i, operand in enumerate(add.input):
                found, mask = scores_of(operand), add.input[1 - i]
                if found is not None:
                    break
        if found is None:
            continue
        qk, scale, key = found
        if mask is None:
            raise KVCacheError(f"Softmax '{softmax.name}' over layer {key[0]}'s scores adds no attention mask: the "
                               "file attends to every position, the in-place import causally")
        masks.setdefault(mask, key[0])
        probs, users = softmax.output[0], consumers.get(softmax.output[0], [])
        while True:
            if len(users) == 1 and users[0].op_type in ("Cast", "Identity", "Dropout"):
                probs = users[0].output[0]
            elif nan_guard(probs, users):
                probs = next(u for u in users if u.op_type == "Where").output[0]
            else:
                break
            users = consumers.get(probs, [])
        pv = users[0] if len(users) == 1 and users[0].op_type == "MatMul" and users[0].input[0] == probs else None
        if pv is None or writes.get(unrepeat(pv.input[1])) is None \
                or unrepeat(pv.input[1]) != present[(key[0], 1)] or attr(softmax, "axis", -1) not in (-1, 3):
            raise KVCacheError(f"Softmax '{softmax.name}' over the scores of layer {key[0]}'s keys is not followed "
                               "by a MatMul with that layer's values")
        attentions[pv.output[0]] = Attention(key[0], pv.output[0], qk.input[0], scale)
    for node in graph.node:  # ONNX's Attention (opset 23: torch's dynamo exporter's spelling of SDPA)
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            continue
        key = writes.get(unrepeat(node.input[1]))
        if key is None or key[1] != 0:
            continue
        attrs = _gqa_attrs(node)
        problems = [f"{name} = {attrs[name]}" for name, ok in (("softcap", lambda v: v == 0),
                                                            ("is_causal", lambda v: v == 0))
                    if name in attrs and not ok(attrs[name])]
        if unrepeat(node.input[2]) != present[(key[0], 1)]:
            problems.append(f"its V '{node.input[2]}' is not layer {key[0]}'s values")
        if any(node.input[4:]):
            problems.append(f"inputs past the mask {[i for i in node.input[4:] if i]}")
        if any(o in consumers or o in outputs for o in node.output[1:] if o):
            problems.append("its present / qk outputs are read")
        if len(node.input) < 4 or not node.input[3]:
            problems.append("no attention mask (is_causal = 1 aligns upper-left, not to the cache's end)")
        if problems:
            raise KVCacheError(f"Attention '{node.name}' over layer {key[0]}'s cache: {'; '.join(problems)} is not "
                               "supported in place")
        masks.setdefault(node.input[3], key[0])
        scale = float(attrs["scale"]) if attrs.get("scale") else 1.0 / float(np.sqrt(head_dim))
        attentions[node.output[0]] = Attention(key[0], node.output[0], node.input[0], scale)
    for _, node in fused.values():
        _check_gqa(node, kv_heads)
    for mask, layer in masks.items():
        _check_causal_mask(proto, producer, mask, layer, (kv_heads, head_dim, next(iter(dtypes_))))
    missing = sorted(set(range(layers)) - {a.layer for a in attentions.values()} - {f[0] for f in fused.values()})
    if missing:
        raise KVCacheError(f"no attention (MatMul(Q, K^T) [x scale] + the causal mask -> Softmax -> MatMul(., V)) "
                           f"reads the cache of layer(s) {missing}: a mask applied otherwise (Where / masked_fill), "
                           "or a bias between the scores and the mask (an ALiBi position bias, as MPT and BLOOM "
                           "add), is not taken in place")

    # the nodes still needed once the Concats and attentions are replaced
    needed = {o.name for o in graph.output}
    live = []
    for node in reversed(graph.node):
        if not any(o in needed for o in node.output if o):
            continue
        live.append(node)
        out = node.output[0]
        if out in writes:
            needed.add(writes[out][2])
        elif out in attentions:
            a = attentions[out]
            needed |= {a.q, present[(a.layer, 0)], present[(a.layer, 1)]}
        elif out in fused:  # query, key, value, and the rotary tables
            needed |= {i for k, i in enumerate(node.input) if i and k in (0, 1, 2, 7, 8)}
        else:
            needed |= _reads(node)
    live.reverse()
    replaced = set(writes) | set(attentions) | set(fused)
    for node in live:
        if node.output[0] in replaced:
            continue
        bad = _reads(node) & ({n for kv in past.values() for n in kv.values()} | set(writes) | {"attention_mask"})
        if bad and node.op_type == "Shape" and SEQUENCE_AXIS not in range(4)[slice(attr(node, "start", 0),
                                                                                   attr(node, "end"))]:
            continue  # the batch, heads or head size: the cache's are the past's (torch's dynamo exporter reads
            # the batch from a past)
        if bad:
            raise KVCacheError(f"node '{node.name}' ({node.op_type}) reads {sorted(bad)} beyond the cache write "
                               "and the attention (a past length or mask used elsewhere): not importable in place")
    return DecoderPlan(layers, kv_heads, head_dim, dtypes_.pop(), [(past[i][0], past[i][1]) for i in range(layers)],
                       writes, attentions, presents, fused, live)


# (batch, new rows, past rows) at which a mask is evaluated: a prefill after a past, and one decode step
MASK_PROBES = ((2, 3, 2), (1, 1, 4))
MASK_NODES = 400  # more nodes than a mask computation takes (transformers' is ~60): refused unevaluated


def _check_causal_mask(proto, producer: dict, mask: str, layer: int, past_shape: tuple[int, int, int]) -> None:
    """KVCacheError unless the value `mask` that a layer adds to its scores is the causal mask of a
    dense sequence (0 where key j <= the query's position, <= -1e4 elsewhere; or a boolean mask, true
    where a key is attended), which is what
    tg.cache_attention applies: anything else added there (an ALiBi position bias, a sliding window,
    a mask that is not causal) would be dropped. The mask's computation is evaluated (onnx.reference)
    at small shapes from an all-ones attention_mask: it may read attention_mask, input_ids and
    position_ids, and the pasts through Shape only; every other operand must be a constant."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    graph = proto.graph
    inputs = {i.name: i for i in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    nodes, stack, seen, leaves = [], [mask], set(), set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        node = producer.get(v)
        if node is None:
            leaves.add(v)
        elif node not in nodes:
            nodes.append(node)
            stack += sorted(_reads(node))
    why = ""
    if len(nodes) > MASK_NODES:
        why = f"its computation takes {len(nodes)} nodes"
    elif any(n.domain not in ("", "ai.onnx") for n in nodes):
        why = f"it is computed with {sorted({n.domain for n in nodes} - {'', 'ai.onnx'})} operators"
    elif leaves - set(inputs) - set(initializers):
        why = f"it reads {sorted(leaves - set(inputs) - set(initializers))}, defined nowhere"
    elif any(PAST.fullmatch(i) for n in nodes if n.op_type != "Shape" for i in _reads(n)):
        why = "it reads a past's values (not only its shape)"
    elif set(inputs) & leaves - {"attention_mask", "input_ids", "position_ids"} - {i for i in inputs if PAST.fullmatch(i)}:
        why = f"it reads {sorted(set(inputs) & leaves - {'attention_mask', 'input_ids', 'position_ids'})}"
    if why:
        raise KVCacheError(f"the attention mask added to layer {layer}'s scores ('{mask}') cannot be checked to be "
                           f"causal: {why}")
    order = {id(n): k for k, n in enumerate(graph.node)}
    nodes.sort(key=lambda n: order[id(n)])
    kv_heads, head_dim, elem = past_shape
    fed = sorted(leaves & set(inputs))
    sub = helper.make_graph(nodes, "mask", [inputs[i] for i in fed], [helper.make_empty_tensor_value_info(mask)],
                            [initializers[i] for i in sorted(leaves & set(initializers))])
    model = helper.make_model(sub, opset_imports=list(proto.opset_import))
    model.ir_version = proto.ir_version
    try:
        evaluator = ReferenceEvaluator(model)
    except Exception as e:  # noqa: BLE001 - onnx.reference refusing the graph, whatever its error
        raise KVCacheError(f"the attention mask added to layer {layer}'s scores ('{mask}') cannot be evaluated: "
                           f"{type(e).__name__}: {e}") from None
    for batch, steps, past in MASK_PROBES:
        total = past + steps

        values = {}
        for name in fed:
            dtype = helper.tensor_dtype_to_np_dtype(inputs[name].type.tensor_type.elem_type or TensorProto.INT64)
            values[name] = (np.ones((batch, total), dtype) if name == "attention_mask"
                            else np.zeros((batch, steps), dtype) if name == "input_ids"
                            else np.tile(np.arange(past, total, dtype=dtype), (batch, 1)) if name == "position_ids"
                            else np.zeros((batch, kv_heads, past, head_dim), helper.tensor_dtype_to_np_dtype(elem)))
        try:
            (got,) = evaluator.run(None, values)
            got = np.where(got, 0.0, -np.inf) if np.asarray(got).dtype == bool else np.asarray(got, np.float64)
            got = np.broadcast_to(got, (batch, got.shape[1] if got.ndim == 4 else 1, steps, total))
        except Exception as e:  # noqa: BLE001 - the file's own computation failing at these shapes
            raise KVCacheError(f"the attention mask added to layer {layer}'s scores ('{mask}') does not evaluate "
                               f"to [batch, heads, {steps}, {total}] from a past of {past} rows: "
                               f"{type(e).__name__}: {e}") from None
        allowed = np.arange(total)[None, :] <= np.arange(past, total)[:, None]
        through, hidden = got[..., allowed], got[..., ~allowed]
        if (through != 0).any() or (hidden > -1e4).any():
            what = ("adds a bias to the positions it lets through (an ALiBi position bias?)" if (through != 0).any()
                    else "lets through positions after the query's (not causal)")
            raise KVCacheError(f"the attention mask added to layer {layer}'s scores ('{mask}') {what}: the in-place "
                               "import attends causally with no bias and would compute something else; "
                               "tilegraph.compile / from_onnx import the file as it is")


def _gqa_attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _gqa_head_dim(node, constant) -> int | None:
    """The head dim of a GroupQueryAttention whose past's last dim is a symbol: its rotary table's
    width x 2 (the builder's rotary covers the whole head)."""
    cos = constant(node.input[7]) if len(node.input) > 7 and node.input[7] else None
    return int(cos.shape[1]) * 2 if cos is not None and cos.ndim == 2 and _gqa_attrs(node).get("do_rotary") else None


def _gqa_window(attrs: dict) -> int:
    """tg.cache_attention's window for GroupQueryAttention's local_window_size L > 0: onnxruntime
    lets the query at position p see the L keys p - L + 1..p, as tg's window does (checked against
    its kernel). -1: no window."""
    size = int(attrs.get("local_window_size", -1))
    return size if size > 0 else 0


def _check_gqa(node, kv_heads: int) -> None:
    """What the rewrite of a GroupQueryAttention supports: causal attention over the cache, an
    optional rotary embedding in rotate-half form, a local window; no softcap, sinks, bias or positions."""
    a = _gqa_attrs(node)
    extra = [i for k, i in enumerate(node.input) if k > 8 and i]
    problems = [f"{name} = {a[name]}" for name, ok in (("local_window_size", lambda v: v == -1 or 0 < v < 1 << 20),
                                                        ("softcap", lambda v: v == 0),
                                                        ("rotary_interleaved", lambda v: v == 0),
                                                        ("smooth_softmax", lambda v: v in (0, -1)))
                if name in a and not ok(a[name])]
    if a.get("kv_num_heads") != kv_heads or not a.get("num_heads") or a["num_heads"] % kv_heads:
        problems.append(f"num_heads {a.get('num_heads')} over kv_num_heads {a.get('kv_num_heads')} (the past has "
                        f"{kv_heads})")
    if extra:
        problems.append(f"inputs past sin_cache {extra}")
    if problems:
        raise KVCacheError(f"GroupQueryAttention '{node.name}': {'; '.join(problems)} is not supported in place")


class _DecoderImporter(_Importer):
    def __init__(self, proto, plan: DecoderPlan, batch: int, steps: int | str, cache_len: int,
                 cache_dtype: str, sampling: dict | None, arrays: dict[str, np.ndarray]):
        super().__init__(proto, {})
        self.plan, self.batch, self.steps, self.cache_len = plan, batch, steps, cache_len
        self.cache_dtype, self.sampling, self.arrays = cache_dtype, sampling, arrays
        g, B, T = self.g, batch, steps
        # the GGUF model's inputs, in its order: tokens, pos, last, then each layer's K and V cache
        self.tokens = g.input("input_ids", (B, T), "i64")
        self.pos = g.input("pos", (B,), "i64")
        self.last = g.input("last", (B,), "i64")
        self.caches = {name: g.input(name, (B, plan.kv_heads, cache_len, plan.head_dim), cache_dtype)
                       for kv in plan.past for name in kv}

    def initializer(self, t) -> np.ndarray:
        if t.name not in self.arrays:  # one array per initializer for every entry point of a model
            self.arrays[t.name] = tensor_array(t, f"initializer '{t.name}'")
        return self.arrays[t.name]

    def bind_input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> None:
        g = self.g
        if name == "input_ids":
            self.env[name] = self.tokens
        elif name in self.caches:
            self.env[name] = self.caches[name]
        elif name == "position_ids":
            where = self.positions()
            self.env[name] = where if dtype == "i64" else g.cast(where, dtype)
        # anything else (the attention mask) is read by no node that is still needed: left out

    def positions(self) -> Tensor:
        """[B, T] i64: pos_b + t, where the generation loop places the new tokens."""
        g, B, T = self.g, self.batch, self.steps
        if not hasattr(self, "_positions"):
            self._positions = g.op("add", g.reshape(self.pos, (B, 1)),
                                   g.op("iota", result=TensorInfo((1, T), "i64"), axis=1))
        return self._positions

    def graph_nodes(self):
        return self.plan.live

    def declared_dtype(self, out) -> str | None:
        if out.name in self.plan.presents.values():  # the caches, in the type they are kept in
            return self.cache_dtype
        return super().declared_dtype(out)

    def group_query_attention(self, layer: int, node) -> None:
        """onnxruntime's fused attention: packed (or separate) Q/K/V [B, T, heads x D], the rotary
        embedding at positions pos + t (rotate-half), the new K/V rows written into the cache at pos,
        causal attention over it; output [B, T, heads x D]."""
        g, B, T, D = self.g, self.batch, self.steps, self.plan.head_dim
        a = _gqa_attrs(node)
        H, Hkv = a["num_heads"], a["kv_num_heads"]
        x = self.tensor(self.env[node.input[0]], node.input[0])
        if len(node.input) > 2 and node.input[1] and node.input[2]:
            q, k, v = x, self.tensor(self.env[node.input[1]]), self.tensor(self.env[node.input[2]])
        else:
            q, k, v = g.split(x, [H * D, Hkv * D, Hkv * D], axis=2)

        def heads(t, n):
            return g.transpose(g.reshape(t, (B, T, n, D)), (0, 2, 1, 3))
        q, k, v = heads(q, H), heads(k, Hkv), heads(v, Hkv)
        if a.get("do_rotary"):
            cos, sin = (g.reshape(g.gather(self.tensor(self.env[node.input[i]], node.input[i]), self.positions()),
                                  (B, 1, T, D // 2)) for i in (7, 8))
            q, k = g.op("rope", q, cos, sin), g.op("rope", k, cos, sin)
        store = {} if self.cache_dtype == "f32" else {"store": self.cache_dtype}
        kc, vc = (g.op("cache_write", self.caches[self.plan.past[layer][i]], t, self.pos, **store)
                  for i, t in ((0, k), (1, v)))
        o = g.op("cache_attention", q, kc, vc, self.pos, scale=float(a.get("scale") or 1.0 / np.sqrt(D)),
                 window=_gqa_window(a))
        self.env[node.output[0]] = g.reshape(g.transpose(o, (0, 2, 1, 3)), (B, T, H * D))
        self.env[node.output[1]], self.env[node.output[2]] = kc, vc

    def convert(self, proto, depth: int = 0) -> None:
        out = proto.output[0] if proto.output else ""
        plan = self.plan
        if depth == 0 and out in plan.writes:
            layer, kind, new = plan.writes[out]
            cache = self.caches[plan.past[layer][kind]]
            store = {} if self.cache_dtype == "f32" else {"store": self.cache_dtype}
            self.env[out] = self.g.op("cache_write", cache, self.tensor(self.env[new], new), self.pos, **store)
        elif depth == 0 and out in plan.attentions:
            a = plan.attentions[out]
            k, v = self.env[plan.presents[(a.layer, 0)]], self.env[plan.presents[(a.layer, 1)]]
            self.env[out] = self.g.op("cache_attention", self.tensor(self.env[a.q], a.q), k, v, self.pos,
                                      scale=a.scale)
        elif depth == 0 and out in plan.fused:
            self.group_query_attention(*plan.fused[out])
        else:
            super().convert(proto, depth)

    def close(self, outputs: list[Tensor], names: list[str]) -> Model:
        g, plan = self.g, self.plan
        by_name = dict(zip(names, outputs))
        logits = by_name[plan.logits]
        if logits.info.rank != 3:
            raise KVCacheError(f"logits {logits.info}: a decoder's logits are [batch, sequence, vocab]")
        vocab = logits.info.shape[-1]
        logits = g.gather(g.reshape(logits, (-1, vocab)), self.last)  # each sequence's row `last`
        caches = [by_name[plan.presents[(i, kind)]] for i in range(plan.layers) for kind in (0, 1)]
        result_names = ["logits"] + [f"present.{i}.{k}" for i in range(plan.layers) for k in KINDS]
        aliases = {plan.past[i][k]: f"present.{i}.{KINDS[k]}" for i in range(plan.layers) for k in (0, 1)}
        if self.sampling is None:
            return g.build(logits, *caches, names=result_names, aliases=aliases)
        seen, u = g.input("seen", (self.batch, vocab), "ui8"), g.input("u", (self.batch,))
        chosen = g.op("sample", logits, seen, u, **self.sampling)
        return g.build(logits, *caches, chosen, names=result_names + ["next"], aliases=aliases)


@dataclass(frozen=True)
class DecoderConfig:
    """What tilegraph.generation.LanguageModel reads of a model (LlamaConfig's names)."""

    arch: str
    layers: int
    hidden: int  # the attention's width, heads x head_dim
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int = 1 << 20  # the file does not say: the caller's cache_len bounds it


class OnnxDecoder:
    """A decoder-with-past ONNX file, loaded and planned once: `build` imports it for a batch size
    and a step count (an int, or a symbol name for prefill) over caches of `cache_len` positions."""

    def __init__(self, path):
        self.path = path
        self.proto = load_model(path)
        self.plan = plan_decoder(self.proto)
        from onnx import ModelProto

        kept = ModelProto()  # the nodes still needed: those must all convert (GroupQueryAttention need not)
        kept.CopyFrom(self.proto)
        del kept.graph.node[:]
        replaced = set(self.plan.writes) | set(self.plan.attentions) | set(self.plan.fused)
        kept.graph.node.extend(n for n in self.plan.live if n.output[0] not in replaced)
        check_supported(kept)
        self.arrays: dict[str, np.ndarray] = {}

    def config(self) -> DecoderConfig:
        """The sizes generation needs, from one import of a one-token step."""
        from tilegraph.ir.model import info_of
        from tilegraph.ir.ops import Op

        model = self.build(1, 1, 1)
        vocab = model.outputs[0].shape[-1]
        attention = next(op for op in model.ops() if getattr(op, "op_name", None) == Op.cache_attention)
        heads = info_of(attention.operands[0].type).shape[1]
        p = self.plan
        if not isinstance(vocab, int) or not isinstance(heads, int):
            raise KVCacheError(f"the logits' vocabulary ({vocab}) and the query heads ({heads}) must be fixed")
        return DecoderConfig("onnx", p.layers, heads * p.head_dim, heads, p.kv_heads, p.head_dim, vocab,
                             self.context())

    def context(self) -> int:
        """The positions the file can place: its rotary tables' rows (GroupQueryAttention's cos/sin
        caches, which a position past their end would index out of), else DecoderConfig's default."""
        sizes = {t.name: list(t.dims) for t in self.proto.graph.initializer}
        sizes.update({n.output[0]: list(n.attribute[0].t.dims) for n in self.proto.graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
        rows = [sizes[node.input[i]][0] for _, node in self.plan.fused.values() if _gqa_attrs(node).get("do_rotary")
                for i in (7, 8) if len(node.input) > i and sizes.get(node.input[i])]
        return min(rows, default=DecoderConfig.context)

    def build(self, batch: int, steps: int | str, cache_len: int, cache_dtype: str = "f32",
              sampling: dict | None = None) -> Model:
        return _DecoderImporter(self.proto, self.plan, batch, steps, cache_len, cache_dtype, sampling,
                                self.arrays).run()


def import_decoder(path, batch: int = 1, steps: int | str = 1, cache_len: int = 256, cache_dtype: str = "f32",
                   sampling: dict | None = None) -> Model:
    """The in-place model of a decoder-with-past ONNX file (see the module's docstring)."""
    return OnnxDecoder(path).build(batch, steps, cache_len, cache_dtype, sampling)

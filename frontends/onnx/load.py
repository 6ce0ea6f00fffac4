"""Loading an ONNX model and checking, before anything is converted, that every op has a
converter or a function body (one FrontendError listing all that do not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import CONVERTERS


MIN_OPSET = 13  # the oldest default-domain opset whose op definitions this frontend implements
DEFAULT_DOMAINS = ("", "ai.onnx")


# Ops whose definitions from this opset to 13 changed only in types tg does not have (sequences,
# optionals) or in what they refuse (Scan 9 took no negative axes): the converters take them.
UNCHANGED_SINCE = {"If": 11, "Loop": 11, "Scan": 9}
MAX_FUNCTION_DEPTH = 8  # function bodies calling functions: a guard against runaway recursion
# Ops with a function body that is random or otherwise not a computation tg can hold.
NOT_EXPANDED = {"Bernoulli", "SequenceMap"}


# --- loading and checking -------------------------------------------------------


def load_model(model: Any):
    """A `ModelProto` from a proto, a path or raw bytes; FrontendError when it is not one."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(model, onnx.ModelProto):
        proto = model
    else:
        try:
            data = model if isinstance(model, bytes) else Path(model).read_bytes()
        except OSError as e:
            raise FrontendError(f"cannot read ONNX model {model}: {e.strerror}") from None
        try:
            proto = onnx.load_model_from_string(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            raise FrontendError(f"{model} is not an ONNX model (protobuf decode failed: {e})") from None
        if not proto.HasField("graph") or not (proto.graph.node or proto.graph.output):
            raise FrontendError(f"{model} is not an ONNX model (it has no graph)")
    try:
        for f in proto.graph.initializer:
            if f.data_location == onnx.TensorProto.EXTERNAL and isinstance(model, (str, Path)):
                onnx.external_data_helper.load_external_data_for_model(proto, str(Path(model).parent))
                break
    except (OSError, onnx.checker.ValidationError) as e:  # missing, or outside the model's folder
        raise FrontendError(f"cannot read the external data of {model}: {e}") from None
    return proto


def default_opset(proto) -> int:
    versions = [o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS]
    return versions[0] if versions else MIN_OPSET


def _op_key(node) -> str:
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def _changed_since(op_type: str, opset: int) -> bool:
    """Whether the op's definition in force at `opset` (< 13) differs from its opset-13+ one."""
    import onnx.defs

    try:
        old = onnx.defs.get_schema(op_type, opset).since_version
        new = onnx.defs.get_schema(op_type, max(opset, MIN_OPSET)).since_version
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an opset version past int32 (a corrupt file)
        return True
    return old != new


def function_schema(node, opset: int):
    """The schema of an op that ONNX defines as a function of other ops (None if it is not one).

    Such ops (Attention, the losses, RotaryEmbedding, ...) are imported by expanding
    ONNX's own function body, unless a converter maps them directly.
    """
    import onnx.defs

    try:
        schema = onnx.defs.get_schema(node.op_type, opset if node.domain in DEFAULT_DOMAINS else 1 << 30,
                                      "" if node.domain in DEFAULT_DOMAINS else node.domain)
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an opset version past int32 (a corrupt file)
        return None
    versions = list(schema.function_opset_versions) + list(schema.context_dependent_function_opset_versions)  # type: ignore[attr-defined]
    return schema if versions else None


def unsupported_ops(proto) -> dict[str, list[str]]:
    """op key -> names of the nodes using it, for every op the frontend cannot convert."""
    opset = default_opset(proto)
    found: dict[str, list[str]] = {}
    for i, node in enumerate(proto.graph.node):
        key = _op_key(node)
        if key not in CONVERTERS and key not in NOT_EXPANDED and function_schema(node, opset) is not None:
            continue  # expanded into its function body at import
        if key not in CONVERTERS:
            reason = key
        elif opset < MIN_OPSET and opset < UNCHANGED_SINCE.get(key, MIN_OPSET) and _changed_since(node.op_type, opset):
            reason = f"{key} (opset {opset}; only its opset-{MIN_OPSET}+ definition is supported)"
        else:
            continue
        found.setdefault(reason, []).append(node.name or f"#{i} -> {node.output[0] if node.output else '?'}")
    return found


def check_supported(proto) -> None:
    found = unsupported_ops(proto)
    if found:
        total = sum(len(v) for v in found.values())
        lines = [f"  {key}: {len(names)} node{'s' if len(names) > 1 else ''} (e.g. '{names[0]}')"
                 for key, names in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        raise FrontendError(f"the ONNX model uses {len(found)} unsupported op type{'s' if len(found) > 1 else ''} "
                            f"({total} node{'s' if total > 1 else ''}):\n" + "\n".join(lines))

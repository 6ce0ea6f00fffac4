"""`tilegraph export`: a tg model (quantized or not) to ONNX."""

from __future__ import annotations

from pathlib import Path

from tilegraph.cli.common import refuse_overwriting


def _export(args) -> int:
    import tilegraph
    from tilegraph.backends.onnx_export import summary, to_onnx, write_onnx
    from tilegraph.ir.errors import TilegraphError
    from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline

    out = Path(args.output)
    if not out.parent.is_dir():
        raise TilegraphError(f"-o {out}: no such directory {out.parent}")
    refuse_overwriting(args.model, out)
    model = run_pipeline(tilegraph.import_model(args.model, trust_pickle=args.trust_pickle),
                         UNFUSED_PIPELINE if args.pipeline is None else args.pipeline)
    proto = to_onnx(model, out.stem)
    write_onnx(proto, out)
    print(f"wrote {out}: {summary(proto)}")
    return 0

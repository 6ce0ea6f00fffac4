"""`tilegraph-opt`: run tg passes on a model and print the IR, in the spirit of mlir-opt.

    tilegraph-opt model.mlir -p 'canonicalize,cse,decompose' --print-ir-after-change

Built on xDSL's opt main: the same pipeline syntax (`fuse{max-ops=32}`), the same
flags (`--time-passes`, `-o`), restricted to the dialects and passes of tilegraph so
it starts fast. Inputs may be `.mlir` (weights read from `model.weights.npz`
beside it), `.onnx` or `.pt2`; with `-o out.mlir` the weights are written beside
the output.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import IO, Sequence

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass, PassPipeline
from xdsl.xdsl_opt_main import xDSLOptMain

from ir.model import _WEIGHTS_OF, Model, WeightStore, parse_module, print_module, weights_path


class TilegraphOptMain(xDSLOptMain):
    version_format = "tilegraph-opt (xdsl {xdsl_version})"

    def register_all_dialects(self) -> None:
        from xdsl.dialects.builtin import Builtin
        from xdsl.dialects.func import Func

        from ir.dialect import TG

        for dialect in (Builtin, Func, TG):
            self.ctx.register_dialect(dialect.name, lambda d=dialect: d)

    def register_all_passes(self) -> None:
        from passes.registry import PASSES

        for name, factory in PASSES.items():
            self.register_pass(name, factory)

    def register_all_frontends(self) -> None:
        def from_mlir(io: IO[bytes]) -> ModuleOp:
            module = parse_module(io.read().decode(), self.get_input_name())
            store = WeightStore()
            if self.args.input_file and weights_path(Path(self.args.input_file)).is_file():
                store = WeightStore.load(weights_path(Path(self.args.input_file)))
            Model(module, store).verify()
            return module

        def imported(io: IO[bytes]) -> ModuleOp:
            import tilegraph

            io.close()
            return tilegraph.import_model(self.args.input_file).module

        self.available_frontends["mlir"] = from_mlir
        self.available_frontends["onnx"] = imported
        self.available_frontends["pt2"] = imported

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)
        arg_parser.add_argument("--print-ir-after-all", action="store_true",
                                help="print the IR after every pass")
        arg_parser.add_argument("--print-ir-after-change", action="store_true",
                                help="print the IR after each pass that changed it")
        arg_parser.add_argument("--verify-each", action=argparse.BooleanOptionalAction, default=True,
                                help="verify the IR after each pass (default: on)")

    def setup_pipeline(self) -> None:
        from passes.registry import parse_pipeline

        parse_pipeline(self.args.passes)  # a clear error naming an unknown pass, before xDSL's
        last_text: list[str] = []

        def callback(previous: ModulePass | None, module: ModuleOp, following: ModulePass | None) -> None:
            if self.args.verify_each and not self.args.disable_verify:
                module.verify()
            if previous is None:
                if self.args.print_ir_after_change:
                    last_text[:] = [print_module(module)]
                return
            if self.args.print_ir_after_all or self.args.print_ir_after_change:
                text = print_module(module)
                if self.args.print_ir_after_all or text != last_text[0]:
                    print(f"// -----// IR after {previous.name} //----- //")
                    print(text)
                last_text[:] = [text]

        self.pipeline = PassPipeline.parse_spec(self.available_passes, self.args.passes, callback)

    def apply_passes(self, prog: ModuleOp) -> None:
        if self.pipeline.passes:
            self.pipeline.apply(self.ctx, prog)
        self._result = prog

    def prepare_output(self) -> IO[str]:
        # With -o, the output is held in memory and written only once the whole run
        # has succeeded: a bad input leaves no partial file behind.
        return self._held if self.args.output_file else sys.stdout

    def run(self) -> None:
        self._held = _HeldOutput()
        self._result: ModuleOp | None = None
        super().run()
        if self.args.output_file:
            Path(self.args.output_file).write_text(self._held.getvalue())
            store = _WEIGHTS_OF.get(self._result) if self._result is not None else None
            if store:
                store.save(weights_path(Path(self.args.output_file)))


class _HeldOutput(io.StringIO):
    def close(self) -> None:  # xDSL's driver closes its output stream; keep the text readable
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from tilegraph.errors import run_reporting_errors

    return run_reporting_errors("tilegraph-opt", lambda: TilegraphOptMain(
        description="Run tilegraph passes on a model and print the resulting IR.", args=argv).run())


if __name__ == "__main__":
    sys.exit(main())

"""`tilegraph-opt`: run tg passes on a model and print the IR, in the spirit of mlir-opt.

    tilegraph-opt model.mlir -p 'canonicalize,cse,decompose' --print-ir-after-change
    tilegraph-opt model.mlir -p 'canonicalize,fuse,tile' --remarks       # why each group was (not) fused
    tilegraph-opt model.mlir -p 'canonicalize,fuse,tile' --print-cost-after-all --hardware h100 --dim B=8

Built on xDSL's opt main: the same pipeline syntax (`fuse{max-ops=32}`), the same
flags (`--time-passes`, `-o`), restricted to the dialects and passes of tilegraph so
it starts fast. Inputs may be `.mlir` (weights read from `model.weights.npz`
beside it), `.onnx` or `.pt2`; with `-o out.mlir` the weights are written beside
the output.

`--hardware` names the hardware (h100, h200, a100, cpu, c): `--print-cost-after-all`
costs the module on it after every pass, and passes with a `hardware` option (fuse,
tile, shard) decide for it
unless the pipeline gives them one. `--remarks` prints, on stderr after the run,
every decision a pass explained (passes/remarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import IO, Sequence

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass, PassPipeline
from xdsl.xdsl_opt_main import xDSLOptMain

from tilegraph.ir.escape import terminal_text
from tilegraph.ir.model import _WEIGHTS_OF, Model, ModelError, WeightStore, decode_text, parse_module, print_module, weights_path


class TilegraphOptMain(xDSLOptMain):
    version_format = "tilegraph-opt (xdsl {xdsl_version})"

    def register_all_dialects(self) -> None:
        from xdsl.dialects.builtin import Builtin
        from xdsl.dialects.func import Func

        from tilegraph.ir.dialect import TG

        for dialect in (Builtin, Func, TG):
            self.ctx.register_dialect(dialect.name, lambda d=dialect: d)  # type: ignore[misc]

    def register_all_passes(self) -> None:
        from tilegraph.passes.registry import PASSES

        for name, factory in PASSES.items():
            self.register_pass(name, factory)

    def register_all_targets(self) -> None:
        super().register_all_targets()
        self.available_targets = {"mlir": self.available_targets["mlir"]}

    def register_all_frontends(self) -> None:
        def from_mlir(io: IO[bytes]) -> ModuleOp:
            module = parse_module(decode_text(io.read(), self.get_input_name()), self.get_input_name())
            store = WeightStore()
            if self.args.input_file and weights_path(Path(self.args.input_file)).is_file():
                store = WeightStore.load(weights_path(Path(self.args.input_file)))
            Model(module, store).verify()
            return module

        def imported(kind: str):
            def frontend(io: IO[bytes]) -> ModuleOp:
                import tilegraph

                io.close()
                path = Path(self.args.input_file or "")
                if path.suffix.lower() != f".{kind}":  # import_model goes by the suffix: -f must agree
                    raise ModelError(f"-f {kind}: {path} is not a .{kind} file (tilegraph-opt reads a file as "
                                     "its suffix says; leave out -f)")
                return tilegraph.import_model(path, trust_pickle=self.args.trust_pickle).module
            return frontend

        self.available_frontends["mlir"] = from_mlir
        self.available_frontends["onnx"] = imported("onnx")
        self.available_frontends["pt2"] = imported("pt2")

    def register_all_arguments(self, arg_parser: argparse.ArgumentParser) -> None:
        super().register_all_arguments(arg_parser)
        arg_parser.add_argument("--print-ir-after-all", action="store_true",
                                help="print the IR after every pass")
        arg_parser.add_argument("--print-ir-after-change", action="store_true",
                                help="print the IR after each pass that changed it")
        arg_parser.add_argument("--verify-each", action=argparse.BooleanOptionalAction, default=True,
                                help="verify the IR after each pass (default: on)")
        # --- cost and remarks (passes/cost/, passes/remarks.py) ---
        arg_parser.add_argument("--remarks", action="store_true",
                                help="print every decision the passes explained (stderr, after the run)")
        arg_parser.add_argument("--print-cost-after-all", action="store_true",
                                help="print the predicted time and kernel count of the module after every pass")
        # xDSL's -t/--target picks an output format; tilegraph-opt prints tg IR only. Its other
        # formats import packages tilegraph does not ship (llvm) or print no tg IR, and a value
        # that is not a name reached xDSL's spec parser as a traceback: argparse refuses them.
        output = next(a for a in arg_parser._actions if "--target" in a.option_strings)
        output.choices = ("mlir",)
        output.help = "output format: mlir (tg IR, the only one)"
        arg_parser.add_argument("--hardware", default=None, metavar="HARDWARE",
                                help="hardware to cost on (--print-cost-after-all) and to give the passes' hardware "
                                     "option (fuse, tile, shard): h100, h200, a100, cpu or c (the C backend's "
                                     "profile; default: cpu)")
        from tilegraph.cli.parser import TRUST_PICKLE

        arg_parser.add_argument("--trust-pickle", action="store_true", help=TRUST_PICKLE)
        arg_parser.add_argument("--load-pass-plugin", action="append", default=[], metavar="MODULE",
                                help="import a Python module (a name, or a .py file) that registers passes "
                                     "with tilegraph.passes.registry.register_pass, before the pipeline is read")
        arg_parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                                help="size of a symbolic dimension for --print-cost-after-all "
                                     "(default: 128 each) and --check-semantics (default: 3 each)")
        # --- semantic checking (tilegraph/check_semantics.py) ---
        arg_parser.add_argument("--check-semantics", action="store_true",
                                help="run the float64 interpreter on seeded random valid inputs before the "
                                     "pipeline and after each pass; on a divergence name the pass, write the IR "
                                     "before and after, exit 1")
        arg_parser.add_argument("--check-each-rewrite", action="store_true",
                                help="with --check-semantics: check after every rewrite of a rule-driven pass "
                                     "too, naming the rule")
        arg_parser.add_argument("--check-seed", type=int, default=0, help="seed of the checked inputs (default 0)")
        arg_parser.add_argument("--check-dir", default=".",
                                help="where --check-semantics writes the IR before and after a divergence")

    def setup_pipeline(self) -> None:
        from tilegraph.cli.common import parse_dims
        from tilegraph.passes.registry import PASSES, parse_pipeline, with_hardware

        for plugin in self.args.load_pass_plugin:
            _load_plugin(plugin)
        for name, factory in PASSES.items():  # what the plugins registered
            if name not in self.available_passes:
                self.register_pass(name, factory)
        parse_pipeline(self.args.passes)  # a clear error naming an unknown pass, before xDSL's
        spec = self.args.passes
        self._cost = None
        if self.args.hardware is not None or self.args.print_cost_after_all:
            from tilegraph.ir.hardware import hardware

            hw = hardware(self.args.hardware or "cpu")  # an unknown name: a clear error, before any work
            self._cost = _CostPrinter(hw, parse_dims(self.args.dim))
            if self.args.hardware is not None:
                spec = with_hardware(spec, hw.name)
        last_text: list[str] = []
        self._check = None  # a check_semantics.PipelineCheck while --check-semantics runs the pipeline

        def callback(previous: ModulePass | None, module: ModuleOp, following: ModulePass | None) -> None:
            if self.args.verify_each and not self.args.disable_verify:
                module.verify()
            if self._check is not None:
                from tilegraph.ir.model import weights_of

                if previous is not None:
                    self._check.after(previous, Model(module, weights_of(module)))
                if following is not None:
                    self._check.before(following, Model(module, weights_of(module)))
            if self.args.print_cost_after_all:
                self._cost.show(previous, module)
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

        self.pipeline = PassPipeline.parse_spec(self.available_passes, spec, callback)

    def apply_passes(self, prog: ModuleOp) -> None:
        self._weights_before = set(_WEIGHTS_OF.get(prog) or ())
        if self.args.check_semantics or self.args.check_each_rewrite:
            self._check_semantics(prog)
        elif self.pipeline.passes:
            self.pipeline.apply(self.ctx, prog)
        elif self.args.print_cost_after_all:
            self._cost.show(None, prog)
        self._result = prog

    def _check_semantics(self, prog: ModuleOp) -> None:
        """Run the pipeline once, with the pass callback checking each pass' result (and, with
        --check-each-rewrite, each rewrite) against the float64 reference."""
        import time

        from tilegraph.check_semantics import PipelineCheck
        from tilegraph.cli.common import parse_dims
        from tilegraph.ir.model import weights_of

        start = time.perf_counter()
        passes = [p for p in self.pipeline.passes]
        stem = Path(self.args.input_file).stem if self.args.input_file else "model"
        self._check = PipelineCheck(Model(prog, weights_of(prog)), each_rewrite=self.args.check_each_rewrite,  # type: ignore[assignment]
                                    seed=self.args.check_seed, sizes=parse_dims(self.args.dim),
                                    out_dir=self.args.check_dir, stem=stem)
        try:
            self.pipeline.apply(self.ctx, prog)
        finally:
            self._check.close()  # type: ignore[attr-defined]
        checker, self._check = self._check.checker, None  # type: ignore[attr-defined]
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(checker.sizes.items()))
        print(f"// check-semantics: {len(passes)} pass{'es' if len(passes) != 1 else ''} ({checker.checks} checks) "
              f"keep every output within tolerance on seeded inputs{' at ' + sizes if sizes else ''}; "
              f"{time.perf_counter() - start:.1f} s, {checker.seconds:.1f} s of it in the interpreter",
              file=sys.stderr)

    def prepare_output(self) -> IO[str]:
        # With -o, the output is held in memory and written only once the whole run
        # has succeeded: a bad input leaves no partial file behind.
        return self._held if self.args.output_file else sys.stdout

    def run(self) -> None:
        from tilegraph.passes.remarks import collect

        self._held = _HeldOutput()
        self._result: ModuleOp | None = None  # type: ignore[assignment, no-redef]
        # Passes format remarks only while someone collects them: only with --remarks.
        with collect() if self.args.remarks else contextlib.nullcontext([]) as remarks:  # type: ignore[attr-defined]
            try:
                super().run()
            finally:  # what the passes explained is shown even when a later pass fails
                for r in remarks:  # (they quote fusion kinds, which a .mlir file names)
                    print(terminal_text(str(r)), file=sys.stderr)
        store = _WEIGHTS_OF.get(self._result) if self._result is not None else None
        if self.args.output_file:
            Path(self.args.output_file).write_text(self._held.getvalue())
            if store:
                store.save(weights_path(Path(self.args.output_file)))
        elif store and set(store) - self._weights_before:
            # The printed IR names weights the passes made (quantized ones): only -o saves them.
            new = sorted(set(store) - self._weights_before)
            print(terminal_text(f"tilegraph-opt: note: the passes made {len(new)} new weight(s) ({', '.join(new[:3])}"
                                f"{', ...' if len(new) > 3 else ''}) that are saved only with -o OUT.mlir"),
                  file=sys.stderr)


def _load_plugin(plugin: str) -> None:
    """Import a pass plugin: a module name, or a .py file run as a script (the user's own code, by their choice)."""
    import importlib
    import runpy

    from tilegraph.ir.errors import TilegraphError

    try:
        runpy.run_path(plugin) if plugin.endswith(".py") else importlib.import_module(plugin)
    except (ImportError, OSError) as e:
        raise TilegraphError(f"cannot load the pass plugin '{plugin}': {e}") from None


class _CostPrinter:
    """`--print-cost-after-all`: the module's predicted time and kernel count after each pass,
    and how much the pass changed it."""

    def __init__(self, hw, dims: dict[str, int]):
        self.hw = hw
        self.dims = dims
        self.sizes: dict[str, int] | None = None
        self.previous: float | None = None

    def show(self, after: ModulePass | None, module: ModuleOp) -> None:
        import sympy

        from tilegraph.passes.cost.model import at, module_cost
        from tilegraph.cli.common import check_dims, describe_sizes, format_count, format_time, sizes_for

        cost = module_cost(module, self.hw)
        symbols = {s.name for s in sympy.sympify(cost.time).free_symbols}
        if self.sizes is None:  # the input: say at which sizes the costs are evaluated
            check_dims(self.dims, symbols)
            self.sizes, defaulted = sizes_for(symbols, self.dims)
            print(f"// cost on {self.hw.name}" + (f" at {describe_sizes(self.sizes, defaulted)}" if self.sizes else ""))
        self.sizes = sizes_for(symbols, self.sizes)[0]  # a symbol a pass introduced: the default size
        time = at(cost.time, self.sizes)
        change = ""
        if self.previous is not None:
            delta = time - self.previous
            change = f" ({'+' if delta > 0 else '-'}{format_time(abs(delta))})" if delta else " (unchanged)"
        where = "input" if after is None else f"after {after.name}"
        print(f"// cost {where}: {format_time(time)}, {cost.kernels} kernel{'s' if cost.kernels != 1 else ''}, "
              f"{format_count(at(cost.flops, self.sizes))} FLOPs{change}")
        self.previous = time


class _HeldOutput(io.StringIO):
    def close(self) -> None:  # xDSL's driver closes its output stream; keep the text readable
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from tilegraph.check_semantics import SemanticDivergence
    from tilegraph.reporting import run_reporting_errors

    def body() -> int:
        try:
            TilegraphOptMain(description="Run tilegraph passes on a model and print the resulting IR.", args=argv).run()
        except SemanticDivergence as e:  # not a mistake of the user's: a pass is wrong (exit 1, not 2)
            print(f"tilegraph-opt: semantic check failed: {e}", file=sys.stderr)
            return 1
        return 0

    return run_reporting_errors("tilegraph-opt", body)


if __name__ == "__main__":
    sys.exit(main())

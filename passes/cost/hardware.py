"""The hardware descriptions live below passes and backends, in `tilegraph.ir.hardware`;
this name is the same module (one object: setting an attribute here sets it there)."""

import sys

from tilegraph.ir import hardware

sys.modules[__name__] = hardware

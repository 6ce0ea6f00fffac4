"""tilegraph: a compiler for machine-learning models, written in Python on xDSL."""

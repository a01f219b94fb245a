"""Constrained decoding: regex, JSON Schema and EBNF grammars (xgrammar), compiled off
the scheduler loop and cached; per-sequence grammar state; the batch token mask applied
before sampling; jump-forward over forced text.

`spec` is free of torch and xgrammar (the frontend imports it); the other modules run in
the engine process.
"""
